"""DDP with ``torch.distributed.checkpoint``: every ``--ckpt-every`` steps all ranks save the model and optimizer
with DCP, alternating ``dcp.save`` and ``dcp.async_save`` (the upload runs in a background thread while training
goes on). Variants: zoo_common."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = zc.parse_args(__doc__)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(zc.small_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pending = None
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
            state = {"model": model.module.state_dict(), "step": step}
            where = str(Path(args.workdir) / f"dcp-{step}")
            if pending is not None:
                pending.result()  # one async save in flight at a time
            if (step // args.ckpt_every) % 2:
                pending = dcp.async_save(state, checkpoint_id=where)
            else:
                dcp.save(state, checkpoint_id=where)
        zc.step_done(args, step)
    if pending is not None:
        pending.result()
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
