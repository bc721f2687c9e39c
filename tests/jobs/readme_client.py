"""The README's in-job client pattern, literally, in a small gloo job (run under torchrun).

Rank 0 saves ``{"model", "optimizer", "step"}`` with torch.save (data parallel: every rank holds the same state)
and every run resumes from ``int(state["step"]) + 1`` — a checkpoint written with ``step=None`` would crash every
rank of the next run with TypeError. Rank ``--hang-rank`` hangs in a P2P recv at step ``--hang-at`` of the first
run and, after a restart, at the first step of every later run: before that run's first ``client.step()``.
``--events FILE`` gets JSON lines (start, step, checkpoint).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_watchdog.job import Client


def log_event(path: str, **fields: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), **fields}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hang-at", type=int, default=3)
    ap.add_argument("--hang-rank", type=int, default=1)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 1
    if Path(args.ckpt).exists():
        state = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1  # TypeError on a checkpoint written with step=None
    log_event(args.events, rank=rank, event="start", step=start - 1)

    def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        if rank == 0:
            tmp = args.ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
            Path(tmp).replace(args.ckpt)
            log_event(args.events, rank=rank, event="checkpoint", step=step)

    client = Client.from_env()
    client.on_checkpoint(lambda step: save(model, optimizer, step))
    with client.training():
        for step in range(start, args.steps + 1):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            if rank == args.hang_rank and step == max(args.hang_at, start):
                dist.recv(torch.zeros(1), src=(rank + 1) % world)  # nobody sends: a hung P2P
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
            optimizer.step()
            log_event(args.events, rank=rank, event="step", step=step)
            time.sleep(0.1)
            client.step(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
