"""DDP with mixed precision: forward under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (on GPUs users write
``"cuda"``), gradient clipping, a cosine learning-rate schedule. Variants: zoo_common."""

from __future__ import annotations

import torch
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        model = DDP(zc.small_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

        def train_step(step: int) -> None:
            x, y = zc.batch(16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        zc.train_loop(args, rank, train_step)


if __name__ == "__main__":
    main()
