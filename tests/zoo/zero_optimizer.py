"""DDP with ``ZeroRedundancyOptimizer`` (optimizer state sharded across ranks, parameters broadcast after each
step) and ``consolidate_state_dict`` to rank 0 for checkpoints. Variants: zoo_common."""

from __future__ import annotations

from pathlib import Path

import torch
import zoo_common as zc
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        model = DDP(zc.small_model())
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)

        def save(step: int) -> None:
            opt.consolidate_state_dict(to=0)  # a collective
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()},
                           Path(args.workdir) / "zero.pt")

        zc.train_loop(args, rank, zc.plain_step(model, opt), save=save)


if __name__ == "__main__":
    main()
