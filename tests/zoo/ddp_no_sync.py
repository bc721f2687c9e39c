"""DDP with gradient accumulation: ``model.no_sync()`` for the first micro-batches of each step, so gradients are
all-reduced only on the last one (the pattern from the DDP docs). Variants: zoo_common."""

from __future__ import annotations

import contextlib

import torch
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP

ACCUMULATE = 4


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        model = DDP(zc.small_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def train_step(step: int) -> None:
            for micro in range(ACCUMULATE):
                x, y = zc.batch(8)
                sync = micro == ACCUMULATE - 1
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = torch.nn.functional.mse_loss(model(x), y) / ACCUMULATE
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        zc.train_loop(args, rank, train_step, checkpoint=(model.module, opt))


if __name__ == "__main__":
    main()
