"""DDP with gradient accumulation: ``model.no_sync()`` for the first micro-batches of each step, so gradients are
all-reduced only on the last one (the pattern from the DDP docs). Variants: zoo_common."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP

ACCUMULATE = 4


def main() -> None:
    args = zc.parse_args(__doc__)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(zc.small_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = zc.load_checkpoint(args, model.module, opt)
    zc.event(args, "start", step=start)
    for step in range(start, args.steps):
        zc.slow_phase(args, step, rank)
        for micro in range(ACCUMULATE):
            x, y = zc.batch(8)
            sync = micro == ACCUMULATE - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = torch.nn.functional.mse_loss(model(x), y) / ACCUMULATE
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        zc.straggle(args, rank)
        if step % args.ckpt_every == 0 and rank == 0:
            zc.save_checkpoint(args, model.module, opt, step)
        zc.step_done(args, step)
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
