"""A checkpoint save stuck in the kernel: at step ``--step-at`` rank 0 writes ``--save-s * --rate-kib`` KiB with ONE
``os.write()`` into a FIFO whose reader (a detached helper process rank 0 starts) drains it at ``--rate-kib``
KiB/s, a stand-in for a saturated NFS mount. Rank 0's main thread sits inside write(2) for about ``--save-s``
seconds (sleeping in the kernel, no CPU, no Python progress); the other ranks wait in ``dist.barrier()``; then
training resumes and the job exits 0.

    torchrun --standalone --nproc-per-node 3 tests/jobs/slow_save.py --workdir /tmp/ss --events /tmp/ev.jsonl \
        --save-s 60 --rate-kib 128

The reader is ``python -c`` with a 16 KiB read / sleep loop (no torch import, ~0 CPU), started in its own
session; it exits at EOF, i.e. when rank 0 closes (or dies holding) the write end.

If write(2) returns early (a signal or a ptrace stop, e.g. a blocking ``py-spy dump``, can cut a pipe write short
once part of it is written), the rest is written with further os.write() calls, each logged as a "short_write"
event; the "pause_end" event reports how many calls it took.

Every rank appends JSON lines to ``--events FILE``: {"rank", "step", "t", "event"}: "start" (with "pid"),
"step", rank 0's "pause_start" (with "bytes", "fifo", "reader_pid") just before the write and "pause_end" (with
"writes") after it, "done".
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from job_events import compute, log_event  # beside this script

READER = r"""
import os, sys, time
path, rate, chunk = sys.argv[1], float(sys.argv[2]) * 1024, 16 * 1024
fd = os.open(path, os.O_RDONLY)
t0, total = time.monotonic(), 0
while True:
    data = os.read(fd, chunk)
    if not data:
        break
    total += len(data)
    delay = t0 + total / rate - time.monotonic()
    if delay > 0:
        time.sleep(delay)
"""


def start_reader(fifo: str, rate_kib: float) -> subprocess.Popen[bytes]:
    """The slow "NFS server": a detached process draining the FIFO at ``rate_kib`` KiB/s."""
    return subprocess.Popen([sys.executable, "-c", READER, fifo, str(rate_kib)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def save_checkpoint(fifo: str, payload: bytes, events: str | None, rank: int, step: int) -> int:
    """Write ``payload`` into the FIFO with one os.write(); returns how many write calls it took."""
    fd = os.open(fifo, os.O_WRONLY)  # the reader has it open (or will have it in a moment)
    try:
        view = memoryview(payload)
        n = os.write(fd, view)  # blocks in the kernel (pipe_write) until the reader has taken it all
        calls = 1
        while n < len(view):  # cut short by a signal / ptrace stop after a partial write
            log_event(events, rank=rank, step=step, event="short_write", written=n, left=len(view) - n)
            view = view[n:]
            n = os.write(fd, view)
            calls += 1
        return calls
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--step-at", type=int, default=4, help="rank 0 saves at this step")
    ap.add_argument("--save-s", type=float, default=60.0, help="how long the save takes (sets the size)")
    ap.add_argument("--rate-kib", type=float, default=128.0, help="reader's drain rate, KiB/s")
    ap.add_argument("--size-kib", type=float, default=None, help="override the size (default save-s * rate-kib)")
    ap.add_argument("--step-s", type=float, default=0.1, help="compute time per step")
    ap.add_argument("--workdir", default=".")
    ap.add_argument("--fifo", default=None, help="FIFO path (default <workdir>/ckpt.fifo; created if missing)")
    ap.add_argument("--pg-timeout-s", type=float, default=1800.0)
    ap.add_argument("--events", default=None)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank = dist.get_rank()
    log_event(args.events, rank=rank, step=0, event="start", pid=os.getpid())

    fifo = args.fifo or os.path.join(args.workdir, "ckpt.fifo")
    size = int((args.size_kib if args.size_kib is not None else args.save_s * args.rate_kib) * 1024)
    t = torch.ones(1024)
    for step in range(1, args.steps + 1):
        compute(args.step_s)
        dist.all_reduce(t)
        if step == args.step_at:
            if rank == 0:
                os.makedirs(os.path.dirname(os.path.abspath(fifo)), exist_ok=True)
                if not os.path.exists(fifo):
                    os.mkfifo(fifo)
                payload = os.urandom(size)
                reader = start_reader(fifo, args.rate_kib)
                log_event(args.events, rank=rank, step=step, event="pause_start", bytes=size, fifo=fifo,
                          reader_pid=reader.pid)
                calls = save_checkpoint(fifo, payload, args.events, rank, step)
                log_event(args.events, rank=rank, step=step, event="pause_end", writes=calls)
                reader.wait()
            dist.barrier()
        log_event(args.events, rank=rank, step=step, event="step")
    dist.barrier()
    log_event(args.events, rank=rank, step=args.steps, event="done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
