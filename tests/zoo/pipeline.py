"""Pipeline parallelism with ``torch.distributed.pipelining``: one stage per rank (a slice of an MLP), a GPipe
schedule over 4 micro-batches, activations and gradients passed rank to rank with p2p send/recv. Variants:
zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        world = dist.get_world_size()
        torch.manual_seed(rank)
        stage_module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        opt = torch.optim.SGD(stage_module.parameters(), lr=0.01)

        def train_step(step: int) -> None:
            torch.manual_seed(step)
            x, y = zc.batch(16)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
            opt.zero_grad()

        zc.train_loop(args, rank, train_step)


if __name__ == "__main__":
    main()
