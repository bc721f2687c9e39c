"""Pipeline parallelism with ``torch.distributed.pipelining``: one stage per rank (a slice of an MLP), a GPipe
schedule over 4 micro-batches, activations and gradients passed rank to rank with p2p send/recv. Its own
``slow_stage`` variant (healthy): at ``--hang-step`` the stage on rank ``--rank`` computes for ``--pause-s`` seconds in
its first micro-batch's forward, its partners waiting in their p2p ops. Other variants: zoo_common."""

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
        slow = {"step": False}
        stage_module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())

        def slow_forward(_module: torch.nn.Module, _inputs: object) -> None:
            if slow["step"]:
                slow["step"] = False
                zc.evaluate(args.pause_s)

        stage_module.register_forward_pre_hook(slow_forward)
        stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        opt = torch.optim.SGD(stage_module.parameters(), lr=0.01)

        def train_step(step: int) -> None:
            if args.variant == "slow_stage" and step == args.hang_step and rank == args.rank:
                zc.event(args, "hang_onset", step=step)
                slow["step"] = True
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

        zc.train_loop(args, rank, train_step, handled=("slow_stage",))


if __name__ == "__main__":
    main()
