"""FSDP2: every block and the root wrapped with ``fully_shard`` (parameters sharded across the ranks, all-gathered
in forward, gradients reduce-scattered in backward); no checkpoint (fsdp2_dcp.py saves one with DCP). Variants:
zoo_common."""

from __future__ import annotations

import torch
import zoo_common as zc
from torch.distributed.fsdp import fully_shard


def sharded_model() -> torch.nn.Module:
    """Four blocks, each and then the root wrapped with ``fully_shard`` (the same initial weights on every rank)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(4)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        model = sharded_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zc.train_loop(args, rank, zc.plain_step(model, opt, zero_grad_last=True))


if __name__ == "__main__":
    main()
