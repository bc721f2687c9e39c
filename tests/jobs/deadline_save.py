"""A DDP job whose checkpoint save runs into (or stays within) the job's own collective timeout: the Open-R1 shape.

    torchrun --nproc-per-node 4 tests/jobs/deadline_save.py --timeout-s 900 --save-at 20 --save-s 720 --client

Each step is a real DDP step (forward, ``loss.backward()`` with DDP's gradient all-reduce, optimizer step). At step
``--save-at`` rank 0 writes its checkpoint steadily to ``<workdir>/model.safetensors`` for ``--save-s`` seconds
(64 KiB chunks, each fsync'd, paced to ``--rate-kib`` KiB/s: slow storage) while the other ranks wait in the
``all_gather`` that follows the save; the group's timeout is ``--timeout-s`` (``init_process_group(timeout=)``).
A save shorter than the timeout finishes and training goes on; a longer one makes gloo raise in the waiting ranks
("Timed out waiting …"): the job dies of its own timeout, as NCCL's watchdog ends it on a GPU.

``--client`` trains inside the in-job client (gpu_watchdog.job), which reports the groups' timeouts.

Events (``--events``): "start" (pid), "step", rank 0's "save_start"/"save_end" (bytes), "timed_out" (the error's
first line) on a rank whose collective timed out, "done".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist
from gpu_watchdog.job import Client
from job_events import log_event  # beside this script
from torch.nn.parallel import DistributedDataParallel as DDP


def paced_save(path: str, seconds: float, rate_kib: float) -> int:
    """Write for ``seconds`` at ``rate_kib`` KiB/s in fsync'd 64 KiB chunks; returns the bytes written."""
    chunk = os.urandom(64 << 10)
    t0 = time.monotonic()
    written = 0
    with open(path, "wb") as f:
        while time.monotonic() - t0 < seconds:
            f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            written += len(chunk)
            delay = t0 + written / (rate_kib * 1024) - time.monotonic()
            if delay > 0:
                time.sleep(min(delay, max(0.0, seconds - (time.monotonic() - t0))))
    return written


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-at", type=int, default=20)
    ap.add_argument("--save-s", type=float, default=720.0)
    ap.add_argument("--rate-kib", type=float, default=512.0)
    ap.add_argument("--micro-steps", type=int, default=20, help="forward/backward passes per step")
    ap.add_argument("--client", action="store_true")
    ap.add_argument("--events", default=None)
    ap.add_argument("--workdir", default=".")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    log_event(args.events, rank=rank, step=0, event="start", pid=os.getpid())
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    client = Client.from_env() if args.client else None
    with client.training() if client is not None else contextlib.nullcontext():
        for step in range(1, args.steps + 1):
            for _ in range(args.micro_steps):  # the same count on every rank: each backward is a collective
                loss = model(torch.randn(32, 64)).pow(2).mean()
                opt.zero_grad()
                loss.backward()  # DDP's gradient all-reduce
                opt.step()
            if step == args.save_at:
                if rank == 0:
                    log_event(args.events, rank=rank, step=step, event="save_start")
                    n = paced_save(os.path.join(args.workdir, "model.safetensors"), args.save_s, args.rate_kib)
                    log_event(args.events, rank=rank, step=step, event="save_end", bytes=n)
                gathered = [torch.zeros(1) for _ in range(world)]
                try:
                    dist.all_gather(gathered, torch.ones(1))  # the ranks wait here while rank 0 saves
                except RuntimeError as e:
                    log_event(args.events, rank=rank, step=step, event="timed_out", error=str(e).splitlines()[0])
                    raise
            log_event(args.events, rank=rank, step=step, event="step")
            if client is not None:
                client.step(step)
    log_event(args.events, rank=rank, step=args.steps, event="done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
