"""An RL-style loop (GRPO-like, as in verl/OpenRLHF on one node): each rank hands its prompts to a generation
worker process over a multiprocessing queue and waits for the rollouts, then all ranks all-gather the rewards
and update the policy with DDP. Extra variant ``dead_worker``: rank ``--rank``'s generation worker dies while
generating; the rank blocks for good in ``Queue.get()``. ``slow_generation``: every worker takes ``--pause-s``
once (a long rollout; healthy). Other variants: zoo_common."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


def generate(prompts: mp.Queue, rollouts: mp.Queue, die_at: int, slow_at: int, slow_s: float) -> None:
    """The generation worker: a rollout per request (a stand-in for vLLM's engine)."""
    while True:
        step = prompts.get()
        if step == die_at:
            os._exit(1)  # CUDA error in the engine, an OOM kill
        if step == slow_at:
            zc.evaluate(slow_s)  # a long rollout: the engine computes (on a GPU node: the GPU does)
        rollouts.put(torch.randn(8, 64))


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        world = dist.get_world_size()
        dies = args.variant == "dead_worker" and rank == args.rank and zc.fault_armed(args)
        ctx = mp.get_context("spawn")
        prompts, rollouts = ctx.Queue(), ctx.Queue()
        worker = ctx.Process(target=generate, daemon=True, args=(
            prompts, rollouts, args.hang_step if dies else -1,
            args.hang_step if args.variant == "slow_generation" else -1, args.pause_s))
        worker.start()
        policy = DDP(zc.small_model())
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)

        def train_step(step: int) -> None:
            if step == args.hang_step and (dies or args.variant == "slow_generation"):
                zc.event(args, "hang_onset", step=step)
            prompts.put(step)
            samples = rollouts.get()  # blocks for good if the worker died
            reward = samples.mean().reshape(1)
            rewards = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(rewards, reward)
            advantage = reward - torch.cat(rewards).mean()
            loss = (policy(samples).mean() * advantage).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()

        zc.train_loop(args, rank, train_step, straggler=False)


if __name__ == "__main__":
    main()
