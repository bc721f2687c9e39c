"""The node's recent past: the last ``agent.incident_trace_s`` of samples and stack dumps, as the detector saw them,
so that every incident can carry a trace (docs/trace-format.md) of what led to it and ``replay`` can run on it.

Bounded twice: by time (records older than the window are dropped on every add) and by count (a deque whose
length follows from the window and the sampling period, with room for early ticks), so neither a stuck clock
nor a burst of ticks can make it grow. Samples are kept as the frozen objects the tick already built (no work
per tick beyond an append); they become JSON only when an incident asks for them.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from typing import Any

from gpu_watchdog.model import NodeSample, StackEvidence
from gpu_watchdog.sample.record import only_job
from gpu_watchdog.sample.trace import DIR_TRACE, header, sample_record, stacks_record

TRACE_NAME = DIR_TRACE  # the file an incident directory keeps it in; ``replay DIR`` reads it

# Ticks may come early (a finished stack dump wakes the loop at once), and stack dumps share the deque:
# twice the nominal count plus a margin keeps the whole window in practice; the count cap is the hard bound.
_SLACK = 2
_EXTRA = 32


def max_records(window_s: float, interval_s: float) -> int:
    return _SLACK * math.ceil(window_s / interval_s) + _EXTRA if window_s > 0 else 0


class RecentSamples:
    """A ring of the last ``window_s`` seconds of samples and stack dumps (thread-safe: the daemon's recoveries
    read it from worker threads while the tick appends)."""

    def __init__(self, window_s: float, interval_s: float) -> None:
        self._lock = threading.Lock()
        self._records: deque[NodeSample | StackEvidence] = deque(maxlen=max_records(window_s, interval_s))
        self.window_s = window_s
        self.interval_s = interval_s
        self._backend = ""
        self._last_t: float | None = None

    def configure(self, window_s: float, interval_s: float) -> None:
        """Follow a reloaded config (cheap when nothing changed)."""
        if (window_s, interval_s) == (self.window_s, self.interval_s):
            return
        with self._lock:
            self.window_s, self.interval_s = window_s, interval_s
            self._records = deque(self._records, maxlen=max_records(window_s, interval_s))

    def __len__(self) -> int:
        return len(self._records)

    def add(self, sample: NodeSample, stacks: list[StackEvidence] | tuple[StackEvidence, ...] = ()) -> None:
        """One tick: the stack dumps fed to the detector with this sample, then the sample (replay's order)."""
        if self.window_s <= 0:
            return
        with self._lock:
            if self._last_t is not None and sample.t < self._last_t:
                self._records.clear()  # the wall clock went back: a trace's samples must not
            self._last_t = sample.t
            self._backend = sample.backend
            self._records.extend(stacks)
            self._records.append(sample)
            horizon = sample.t - self.window_s
            while self._records and self._records[0].t < horizon:
                self._records.popleft()

    def trace(self, until: float, job_id: str | None = None, events: tuple[dict[str, Any], ...] = ()) -> str | None:
        """The window that ends at ``until`` (an incident's confirmation) as trace text; with ``job_id`` only that
        job's processes and devices (a node runs other people's jobs) and its stack dumps. None when empty."""
        with self._lock:
            recs = [r for r in self._records if until - self.window_s <= r.t <= until]
            backend, interval = self._backend, self.interval_s
        samples = [r for r in recs if isinstance(r, NodeSample)]
        if not samples:
            return None
        lines = [header(backend, samples[0].hostname, interval, samples[0].t)]
        for r in recs:
            if isinstance(r, NodeSample):
                lines.append(sample_record(r if job_id is None else only_job(r, job_id)))
            elif job_id is None or r.job_id == job_id:
                lines.append(stacks_record(r))
        lines.extend({"type": "event", **e} for e in events)
        return "".join(json.dumps(rec, separators=(",", ":")) + "\n" for rec in lines)
