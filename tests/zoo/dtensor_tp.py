"""Tensor parallelism with DTensor: an MLP split column-wise then row-wise across the ranks with
``parallelize_module`` on a 1-D CPU device mesh (every forward and backward all-reduces the row-parallel output).
Variants: zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 384)  # 384: split evenly across 2, 3, 4 or 6 ranks
        self.down = torch.nn.Linear(384, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        plain = zc.plain_step(model, opt, zero_grad_last=True)

        def train_step(step: int) -> None:
            torch.manual_seed(step)  # every TP rank sees the same batch
            plain(step)

        zc.train_loop(args, rank, train_step)


if __name__ == "__main__":
    main()
