"""FSDP2 with sharded checkpoints: the model sharded with ``fully_shard``, saved every ``--ckpt-every`` steps with
``torch.distributed.checkpoint`` from ``get_model_state_dict`` (every rank writes its own shards: a collective
save). Variants: zoo_common."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import zoo_common as zc
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard


def main() -> None:
    args = zc.parse_args(__doc__)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(4)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zc.event(args, "start", step=0)
    for step in range(args.steps):
        zc.slow_phase(args, step, rank)
        x, y = zc.batch(16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        zc.straggle(args, rank)
        if step % args.ckpt_every == 0:
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(Path(args.workdir) / f"step-{step}"))
        zc.step_done(args, step)
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
