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
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(zc.small_model())
    model.register_comm_hook(state=None, hook=average_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    zc.event(args, "start", step=0)
    for step in range(args.steps):
        zc.slow_phase(args, step, rank)
        x, y = zc.batch(16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        zc.straggle(args, rank)
        zc.step_done(args, step)
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
