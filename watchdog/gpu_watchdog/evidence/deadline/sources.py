"""Where a job's deadline comes from, most authoritative first (pure functions over what was read).

1. **The Flight Recorder**: every entry carries its collective's ``timeout_ms`` and ``time_created_ns``; the
   pending entries of a dump taken during the wait say exactly when the job's backend gives up on each one — the
   job dies at the earliest of them.
2. **The in-job client**: it reports every process group's timeout (``groups-<rank>.json``); which group the ranks
   wait in is not known from it, so the longest one is taken (acting earlier than the job would is the one thing
   the deadline must never cause).
3. **The backend's default**: PyTorch's ``default_pg_timeout`` (30 min: gloo and every non-NCCL backend) and
   ``default_pg_nccl_timeout`` (10 min), for a job that set none of its own — a documented default, said so.

Nothing known: ``unknown`` with what was tried, and the wait keeps ``detect.waiting_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpu_watchdog.evidence.flight_recorder.analysis import RankTrace
from gpu_watchdog.model import Deadline, NodeSample

# torch/distributed/constants.py: default_pg_timeout (_DEFAULT_PG_TIMEOUT, 30 min) for every backend but NCCL, whose
# default_pg_nccl_timeout (_DEFAULT_PG_NCCL_TIMEOUT) is 10 min (torch >= 2.2).
BACKEND_DEFAULT_S = {"gloo": 1800.0, "nccl": 600.0}


def from_flight_recorder(traces: Sequence[RankTrace], since: float | None = None) -> Deadline | None:
    """The earliest moment a pending collective of these dumps times out; None when no dump has a pending
    collective with a timeout (a dump taken before ``since`` — an earlier wait's — is not this wait's)."""
    best: tuple[float, float, float, str, str, int] | None = None  # (due, timeout, created, op, group, rank)
    for tr in traces:
        if since is not None and tr.dumped_at is not None and tr.dumped_at < since:
            continue
        for gv in tr.groups.values():
            for op in gv.pending():
                if op.timeout_s is None or op.created_s is None:
                    continue
                due = op.created_s + op.timeout_s
                if best is None or due < best[0]:
                    group = f"{gv.name} ({gv.desc})" if gv.desc else gv.name
                    best = (due, op.timeout_s, op.created_s, op.op, group, tr.rank)
    if best is None:
        return None
    _, timeout, created, name, group, rank = best
    return Deadline(timeout, "flight_recorder",
                    f"timeout_ms {timeout * 1000:.0f} of {name} in process group {group} (rank {rank}'s dump)",
                    started_at=created, collective=name)


def from_client(groups_by_rank: Mapping[int, Mapping[str, Any]]) -> Deadline | None:
    """The longest process-group timeout the in-job clients reported (``ControlDir.groups``); None: none did."""
    timeouts: dict[str, float] = {}
    for report in groups_by_rank.values():
        for g in report.get("groups") or ():
            t = g.get("timeout_s") if isinstance(g, Mapping) else None
            if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0:
                name = str(g.get("desc") or g.get("name") or "?")
                timeouts[name] = max(timeouts.get(name, 0.0), float(t))
    if not timeouts:
        return None
    longest = max(timeouts.values())
    if len(set(timeouts.values())) == 1:
        detail = f"every process group's timeout, as the in-job client reported ({_fmt_s(longest)})"
    else:
        each = ", ".join(f"{name} {_fmt_s(t)}" for name, t in sorted(timeouts.items(), key=lambda kv: -kv[1]))
        detail = f"the longest process-group timeout the in-job client reported ({each})"
    return Deadline(longest, "client", detail)


def backend_default(backend: str | None) -> Deadline | None:
    """PyTorch's default timeout for ``backend`` ("gloo", "nccl"); None for a backend it has none for."""
    timeout = BACKEND_DEFAULT_S.get(backend or "")
    if timeout is None:
        return None
    return Deadline(timeout, "default",
                    f"PyTorch's default timeout for {backend} ({_fmt_s(timeout)}); the job may have set its own with "
                    "init_process_group(timeout=) — a Flight Recorder dump or the in-job client would tell")


def backend_of(job_id: str, sample: NodeSample) -> str:
    """nccl when a rank of the job runs on a real GPU, else gloo (a CPU job); a job that runs gloo on GPUs is
    taken as NCCL, whose shorter default only makes the agent act sooner, never later than it did without one."""
    pids = {p.pid for p in sample.processes if p.job is not None and p.job.job_id == job_id and p.is_rank}
    return "nccl" if any(not d.virtual and d.pids & pids for d in sample.devices) else "gloo"


def unknown(tried: Iterable[str]) -> Deadline:
    return Deadline(None, "unknown", "unknown: " + "; ".join(tried))


def first_known(*candidates: Deadline | None, tried: Iterable[str] = ()) -> Deadline:
    """The first candidate that knows the deadline, else ``unknown`` with what was tried."""
    for c in candidates:
        if c is not None and c.known:
            return c
    return unknown(tried)


def _fmt_s(seconds: float) -> str:
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
