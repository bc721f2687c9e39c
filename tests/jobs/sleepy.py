"""A healthy low-CPU loop: every step each rank sleeps ``--sleep-s`` and does one ``dist.all_reduce`` of a small
tensor, nothing else; after ``--steps`` steps it exits 0. Almost no CPU, no I/O, and every stack dump catches the
ranks at the same ``time.sleep`` line — yet healthy: each step wakes the main thread (the sleep and the
collective), so its voluntary context switches keep rising (~10/s).

    torchrun --standalone --nproc-per-node 3 tests/jobs/sleepy.py --events /tmp/ev.jsonl --sleep-s 0.2 --steps 60

Every rank appends JSON lines to ``--events FILE``: {"rank", "step", "t", "event"}: "start" (with "pid"),
"step" (every ``--log-every`` steps; 0: never), "done".
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from job_events import log_event  # beside this script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sleep-s", type=float, default=0.2)
    ap.add_argument("--numel", type=int, default=16, help="all_reduce tensor size")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--events", default=None)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log_event(args.events, rank=rank, step=0, event="start", pid=os.getpid())
    t = torch.ones(args.numel)
    for step in range(1, args.steps + 1):
        time.sleep(args.sleep_s)
        dist.all_reduce(t)
        if args.log_every and step % args.log_every == 0:
            log_event(args.events, rank=rank, step=step, event="step")
    dist.barrier()
    log_event(args.events, rank=rank, step=args.steps, event="done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
