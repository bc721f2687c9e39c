"""DDP with a communication hook of the user's own (the pattern from the DDP comm hooks docs): each gradient
bucket is all-reduced asynchronously by the hook and averaged in its future's callback. Variants: zoo_common."""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects (dist.GradBucket).
import torch
import torch.distributed as dist
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


def average_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    world = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        model = DDP(zc.small_model())
        model.register_comm_hook(state=None, hook=average_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        zc.train_loop(args, rank, zc.plain_step(model, opt))


if __name__ == "__main__":
    main()
