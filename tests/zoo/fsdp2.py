"""FSDP2: every block and the root wrapped with ``fully_shard`` (parameters sharded across the ranks, all-gathered
in forward, gradients reduce-scattered in backward), a DCP-free full-state checkpoint on rank 0. Variants:
zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc
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
        zc.step_done(args, step)
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
