"""Megatron-style process groups by hand: the ranks split into tensor-parallel pairs (``new_group``) and data-
parallel groups across them; each step all-reduces activations in its TP group and gradients in its DP group. Run
with an even number of ranks (``--nproc-per-node 4``). Variants: zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        world = dist.get_world_size()
        tp_size = 2
        tp_groups = [dist.new_group(list(range(i, i + tp_size))) for i in range(0, world, tp_size)]
        dp_groups = [dist.new_group(list(range(j, world, tp_size))) for j in range(tp_size)]
        tp, dp = tp_groups[rank // tp_size], dp_groups[rank % tp_size]
        torch.manual_seed(rank % tp_size)
        shard = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(shard.parameters(), lr=0.01)
        zc.train_loop(args, rank, zc.tp_dp_step(shard, opt, tp, dp))


if __name__ == "__main__":
    main()
