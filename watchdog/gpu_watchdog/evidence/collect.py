"""Stack evidence for one job: dump its ranks with py-spy, classify each main thread, bundle the result.

Runs off the sampling path (the launcher and daemon submit it to a worker); the detector receives the
StackEvidence on a later tick.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import psutil

from gpu_watchdog.config.schema import StacksConfig
from gpu_watchdog.evidence.classify import classify_threads
from gpu_watchdog.evidence.stacks import DumpResult, dump_stacks
from gpu_watchdog.model import RankStack, StackEvidence


def dump_job(rank_pids: dict[int, int], cfg: StacksConfig) -> dict[int, DumpResult]:
    """py-spy dumps of every rank, in parallel; rank → result (failures included, never raised)."""
    ranks = sorted(rank_pids)
    results = dump_stacks([rank_pids[r] for r in ranks], timeout_s=cfg.timeout_s, concurrency=cfg.concurrency,
                          native=cfg.native, py_spy=cfg.py_spy or None, nonblocking=cfg.nonblocking)
    return dict(zip(ranks, results, strict=True))


def classify_results(results: dict[int, DumpResult]) -> list[RankStack]:
    """The classified main thread of every rank dumped; a stopped rank (not dumped) is in state "stopped"."""
    out = []
    for rank, res in sorted(results.items()):
        if res.outcome == "stopped":
            out.append(RankStack(rank, res.pid, "stopped", "stopped", False, where="process stopped (state T)"))
        elif res.ok:
            rs = classify_threads(res.threads, rank, res.pid)
            if rs is not None:
                out.append(replace(rs, wakeups_before=res.wakeups_before, wakeups_after=res.wakeups_after,
                                   io_before=res.io_before, io_after=res.io_after))
    return out


def collect_stack_evidence(job_id: str, rank_pids: dict[int, int], cfg: StacksConfig,
                           sample_t: float) -> list[StackEvidence]:
    """One dump of the job's ranks, stamped with the time of the tick that asked for it: the detector's gaps
    between dumps are then whole tick intervals (a wall-clock stamp taken a few ms later would make a 3 s gap
    read as 2.99 s and cost a tick)."""
    results = dump_job(rank_pids, cfg)
    return [StackEvidence(job_id, sample_t, tuple(classify_results(results)))]


# States of a rank's main thread that may be waiting on its own worker processes (a queue, a pipe, an RPC poll).
WAITS_ON_WORKERS = ("data_wait", "sleep", "unknown")
MAX_WORKERS_PER_RANK = 16


@dataclass(frozen=True)
class WorkerStack:
    """One worker process of a rank (a child in its tree: vLLM/Ray workers, multiprocessing), dumped and classified."""

    rank: int
    pid: int
    stack: RankStack
    result: DumpResult


def rank_workers(pid: int) -> list[int]:
    """The rank's descendants (at most MAX_WORKERS_PER_RANK), oldest first."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for k in kids:
        try:
            out.append((k.create_time(), k.pid))
        except psutil.Error:
            continue
    return [p for _, p in sorted(out)[:MAX_WORKERS_PER_RANK]]


def dump_workers(rank_pids: dict[int, int], cfg: StacksConfig) -> list[WorkerStack]:
    """py-spy dumps of the given ranks' worker processes, classified (failures left out: a worker may be no
    Python process at all)."""
    owners = [(rank, w) for rank, pid in sorted(rank_pids.items()) for w in rank_workers(pid)]
    if not owners:
        return []
    results = dump_stacks([w for _, w in owners], timeout_s=cfg.timeout_s, concurrency=cfg.concurrency,
                          native=cfg.native, py_spy=cfg.py_spy or None, nonblocking=cfg.nonblocking)
    out = []
    for (rank, _), res in zip(owners, results, strict=True):
        stack = classify_threads(res.threads, rank, res.pid) if res.ok else None
        if stack is not None:
            out.append(WorkerStack(rank, res.pid, stack, res))
    return out


def blocked_workers(workers: list[WorkerStack]) -> list[WorkerStack]:
    """Workers whose main thread sits in a collective or a device sync: the hang behind the process boundary."""
    return [w for w in workers if w.stack.state in ("collective", "device_sync")]
