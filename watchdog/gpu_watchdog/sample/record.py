"""``gpu-watchdog record``: sample the node for a while and write a trace (written aside, renamed at the end)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from gpu_watchdog.errors import UsageError
from gpu_watchdog.model import NodeSample
from gpu_watchdog.sample.backends import Backend
from gpu_watchdog.sample.trace import TraceWriter


def only_job(sample: NodeSample, job_id: str) -> NodeSample:
    """The part of a node sample that belongs to one job: its processes (the ranks and whatever else
    carries its identity) and the devices they use. A shared GPU is kept whole: its counters are the
    device's, not the job's."""
    procs = tuple(p for p in sample.processes if p.job is not None and p.job.job_id == job_id)
    pids = {p.pid for p in procs}
    devices = tuple(d for d in sample.devices if d.pids & pids)
    return replace(sample, processes=procs, devices=devices)


def record(backend: Backend, output: str | Path, duration_s: float, interval_s: float,
           clock=time.monotonic, sleep=time.sleep, job_id: str | None = None) -> int:
    """Record ``duration_s`` of samples to ``output``; returns the number of samples written. With
    ``job_id`` only that job's processes and devices are kept (a shared node holds other people's jobs).

    The trace is written to ``output.partial`` and renamed when complete, so ``output`` never holds half a
    trace; an interrupted recording keeps its valid prefix under the ``.partial`` name.
    """
    out = Path(output)
    partial = out.with_name(out.name + ".partial")
    n = 0
    try:
        f = partial.open("w")
    except OSError as e:  # a user error: one line naming the option, no traceback
        raise UsageError(f"--output: cannot write {out}: {e.strerror}") from None
    def take() -> NodeSample:
        sample = backend.sample()
        return sample if job_id is None else only_job(sample, job_id)

    with f:
        first = take()
        writer = TraceWriter(f, backend.name, first.hostname, interval_s, first.t)
        writer.sample(first)
        n += 1
        start = clock()
        next_tick = start + interval_s
        while clock() - start < duration_s:
            sleep(max(0.0, next_tick - clock()))
            next_tick += interval_s
            writer.sample(take())
            n += 1
        os.fsync(f.fileno())
    partial.replace(out)
    return n
