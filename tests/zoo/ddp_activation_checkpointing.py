"""DDP over a model with activation checkpointing (``torch.utils.checkpoint``): the backward recomputes each
block's forward before DDP's bucket all-reduce. Variants: zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


class Checkpointed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                          for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def main() -> None:
    args = zc.parse_args(__doc__)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(Checkpointed())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = zc.load_checkpoint(args, model.module, opt)
    zc.event(args, "start", step=start)
    for step in range(start, args.steps):
        zc.slow_phase(args, step, rank)
        x, y = zc.batch(16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        zc.straggle(args, rank)
        if step % args.ckpt_every == 0 and rank == 0:
            zc.save_checkpoint(args, model.module, opt, step)
        zc.step_done(args, step)
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
