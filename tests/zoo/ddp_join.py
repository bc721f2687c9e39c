"""DDP with uneven inputs: each rank has a different number of batches and the loop runs under
``Join([model])``, so ranks that run out shadow the others' collectives instead of hanging. Variants:
zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = zc.parse_args(__doc__)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(zc.small_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    my_steps = args.steps + rank  # uneven: rank r has r more batches
    zc.event(args, "start", step=0)
    with Join([model]):
        for step in range(my_steps):
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
