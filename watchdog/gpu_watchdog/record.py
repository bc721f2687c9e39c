"""``gpu-watchdog record``: sample the node for a while and write a trace (written aside, renamed at the end)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpu_watchdog.backends import Backend
from gpu_watchdog.errors import UsageError
from gpu_watchdog.trace import TraceWriter


def record(backend: Backend, output: str | Path, duration_s: float, interval_s: float,
           clock=time.monotonic, sleep=time.sleep) -> int:
    """Record ``duration_s`` of samples to ``output``; returns the number of samples written.

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
    with f:
        first = backend.sample()
        writer = TraceWriter(f, backend.name, first.hostname, interval_s, first.t)
        writer.sample(first)
        n += 1
        start = clock()
        next_tick = start + interval_s
        while clock() - start < duration_s:
            sleep(max(0.0, next_tick - clock()))
            next_tick += interval_s
            writer.sample(backend.sample())
            n += 1
        os.fsync(f.fileno())
    partial.replace(out)
    return n
