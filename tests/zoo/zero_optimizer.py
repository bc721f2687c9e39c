"""DDP with ``ZeroRedundancyOptimizer`` (optimizer state sharded across ranks, parameters broadcast after each
step) and ``consolidate_state_dict`` to rank 0 for checkpoints. Variants: zoo_common."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = zc.parse_args(__doc__)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(zc.small_model())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    zc.event(args, "start", step=0)
    for step in range(args.steps):
        zc.slow_phase(args, step, rank)
        x, y = zc.batch(16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        zc.straggle(args, rank)
        if step % args.ckpt_every == 0:
            opt.consolidate_state_dict(to=0)  # a collective
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()},
                           Path(args.workdir) / "zero.pt")
        zc.step_done(args, step)
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
