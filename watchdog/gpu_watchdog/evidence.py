"""Stack evidence for one job: dump its ranks with py-spy, classify each main thread, bundle the result.

Runs off the sampling path (the launcher and daemon submit it to a worker); the detector receives the
StackEvidence on a later tick.
"""

from __future__ import annotations

from gpu_watchdog.classify import classify_threads
from gpu_watchdog.config import StacksConfig
from gpu_watchdog.detector import JobStatus
from gpu_watchdog.model import RankStack, StackEvidence
from gpu_watchdog.stacks import DumpResult, dump_stacks


def dump_job(rank_pids: dict[int, int], cfg: StacksConfig) -> dict[int, DumpResult]:
    """py-spy dumps of every rank, in parallel; rank → result (failures included, never raised)."""
    ranks = sorted(rank_pids)
    results = dump_stacks([rank_pids[r] for r in ranks], timeout_s=cfg.timeout_s, concurrency=cfg.concurrency,
                          native=cfg.native, py_spy=cfg.py_spy or None)
    return dict(zip(ranks, results, strict=True))


def classify_results(results: dict[int, DumpResult]) -> list[RankStack]:
    out = []
    for rank, res in sorted(results.items()):
        if res.ok:
            rs = classify_threads(res.threads, rank, res.pid)
            if rs is not None:
                out.append(rs)
    return out


def collect_stack_evidence(status: JobStatus, cfg: StacksConfig, sample_t: float) -> list[StackEvidence]:
    """One dump of the job's ranks, stamped with the time of the tick that asked for it: the detector's gaps
    between dumps are then whole tick intervals (a wall-clock stamp taken a few ms later would make a 3 s gap
    read as 2.99 s and cost a tick)."""
    results = dump_job(dict(status.rank_pids), cfg)
    return [StackEvidence(status.job_id, sample_t, tuple(classify_results(results)))]
