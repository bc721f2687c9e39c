"""DDP over a model with activation checkpointing (``torch.utils.checkpoint``): the backward recomputes each
block's forward before DDP's bucket all-reduce. Variants: zoo_common."""

from __future__ import annotations

import torch
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
    with zc.process_group() as rank:
        model = DDP(Checkpointed())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        zc.train_loop(args, rank, zc.plain_step(model, opt), checkpoint=(model.module, opt))


if __name__ == "__main__":
    main()
