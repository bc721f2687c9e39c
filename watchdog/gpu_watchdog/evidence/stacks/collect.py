"""Stack evidence for one job: dump its ranks with py-spy, classify each main thread, bundle the result.

Runs off the sampling path (the launcher and daemon submit it to a worker); the detector receives the
StackEvidence on a later tick.

A rank waiting on its GPU spins in a C device sync (``cudaStreamSynchronize`` under ``loss.item()``): py-spy's
Python-only dump shows it *active* at the caller's line, which reads as compute. Native frames tell (a
``cuStreamSynchronize`` frame: ``device_sync``) but cost ~1.3 s of a paused process per dump instead of ~0.01 s
(measured on an H200), so ``dump_job`` takes them only where they are needed: a rank on a real GPU whose main
thread reads as compute gets one ``--native`` re-dump (``look_closer``). Where that cannot be had (ptrace limits,
a timeout), the line's own source says whether it calls a device sync (classify's ``gpu_line``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any

import psutil

from gpu_watchdog.config.schema import StacksConfig
from gpu_watchdog.evidence.stacks.classify import (
    COMMUNICATION_STATES,
    GPU_LINE,
    classify_threads,
    is_native,
    main_thread,
)
from gpu_watchdog.evidence.stacks.dump import DumpResult, dump_stacks
from gpu_watchdog.evidence.stacks.source_lines import source_line
from gpu_watchdog.model import NodeSample, RankStack, StackEvidence

# What a native re-dump may tell about a rank that read as compute: it waits in communication (a collective, or a
# device sync behind one). Anything else (compute again, a sleep caught a moment later) leaves the first dump.
NATIVE_TELLS_MORE = COMMUNICATION_STATES


def pids_on_gpu(sample: NodeSample | None, pids: Iterable[int]) -> frozenset[int]:
    """Those of ``pids`` that NVML lists on a real GPU of ``sample`` (the proc backend's virtual devices are one
    per process and say nothing about a GPU)."""
    on_gpu = {p.pid for d in (sample.devices if sample is not None else ()) if not d.virtual for p in d.processes}
    return frozenset(p for p in pids if p in on_gpu)


def dump_job(rank_pids: dict[int, int], cfg: StacksConfig,
             gpu_pids: Collection[int] = frozenset()) -> dict[int, DumpResult]:
    """py-spy dumps of every rank, in parallel; rank → result (failures included, never raised). Ranks whose
    pids are in ``gpu_pids`` (they run on a real GPU) and read as compute are looked at closer (``look_closer``);
    with ``cfg.native`` every dump is native already."""
    ranks = sorted(rank_pids)
    results = dump_stacks([rank_pids[r] for r in ranks], timeout_s=cfg.timeout_s, concurrency=cfg.concurrency,
                          native=cfg.native, py_spy=cfg.py_spy or None, nonblocking=cfg.nonblocking)
    first = dict(zip(ranks, results, strict=True))
    return first if cfg.native or not gpu_pids else look_closer(first, cfg, frozenset(gpu_pids))


def _main_state(res: DumpResult) -> str | None:
    rs = classify_threads(res.threads, -1, res.pid) if res.ok else None
    return rs.state if rs is not None else None


def look_closer(results: dict[int, DumpResult], cfg: StacksConfig,
                gpu_pids: frozenset[int]) -> dict[int, DumpResult]:
    """Re-dump with ``--native`` (in parallel, ``cfg.timeout_s`` each) the ranks on a real GPU whose main thread
    reads as compute; a native dump that tells more (``NATIVE_TELLS_MORE``) replaces the first, any other keeps
    it, and where the native dump failed the first gets its ``gpu_line`` (the source of its innermost Python
    line). Each rank's result spans both dumps: its ``wakeups_before``/``io_before`` from the first, its
    ``wakeups_after``/``io_after`` from the native one (its pausing attach is the collection's, not the job's)."""
    todo = [r for r, res in sorted(results.items()) if res.pid in gpu_pids and _main_state(res) == "compute"]
    if not todo:
        return results
    natives = dump_stacks([results[r].pid for r in todo], timeout_s=cfg.timeout_s, concurrency=cfg.concurrency,
                          native=True, py_spy=cfg.py_spy or None)
    out = dict(results)
    for r, nat in zip(todo, natives, strict=True):
        out[r] = merge_native(results[r], nat)
    return out


def merge_native(first: DumpResult, native: DumpResult) -> DumpResult:
    """One result from a rank's first dump and its native re-dump (see ``look_closer``)."""
    told = _main_state(native) in NATIVE_TELLS_MORE
    if told:
        threads, note = native.threads, "native re-dump used"
    elif native.ok:
        threads, note = first.threads, "native re-dump told nothing more"
    else:
        threads, note = with_gpu_line(first.threads, first.pid), f"native re-dump {native.outcome}: {native.detail}"
    return replace(
        first, threads=threads, detail=f"{first.detail}; {note}",
        elapsed_s=round(first.elapsed_s + native.elapsed_s, 4),
        raw=f"{first.raw}\n--- py-spy dump --native ({native.outcome}) ---\n{native.raw}",
        wakeups_after=native.wakeups_after, io_after=native.io_after,
    )


def with_gpu_line(threads: tuple[dict[str, Any], ...], pid: int) -> tuple[dict[str, Any], ...]:
    """The threads, the main one with the source text of its innermost Python line as ``gpu_line`` (classify: a
    device sync there is ``device_sync``); unchanged when that line cannot be read."""
    mt = main_thread(threads, pid)
    py = [f for f in (mt or {}).get("frames") or () if not is_native(f)]
    text = source_line(str(py[0].get("filename") or ""), py[0].get("line") or 0, pid) if py else None
    if mt is None or text is None:
        return threads
    out = []
    done = False
    for th in threads:
        if not done and th.get("thread_name") == mt.get("thread_name") and th.get("os_thread_id") == mt.get(
                "os_thread_id"):
            th, done = {**th, GPU_LINE: text}, True
        out.append(th)
    return tuple(out)


def classify_results(results: dict[int, DumpResult]) -> list[RankStack]:
    """The classified main thread of every rank dumped; a stopped rank (not dumped) is in state "stopped"."""
    out = []
    for rank, res in sorted(results.items()):
        if res.outcome == "stopped":
            out.append(RankStack(rank, res.pid, "stopped", "stopped", False, where="process stopped (state T)"))
        elif res.ok:
            rs = classify_threads(res.threads, rank, res.pid)
            if rs is not None:
                if rs.wakeups_before is None and rs.io_before is None:  # the main thread's (the dump's own)
                    rs = replace(rs, wakeups_before=res.wakeups_before, wakeups_after=res.wakeups_after,
                                 io_before=res.io_before, io_after=res.io_after)
                out.append(rs)
    return out


def collect_stack_evidence(job_id: str, rank_pids: dict[int, int], cfg: StacksConfig,
                           sample_t: float, gpu_pids: Collection[int] = frozenset()) -> list[StackEvidence]:
    """One dump of the job's ranks, stamped with the time of the tick that asked for it: the detector's gaps
    between dumps are then whole tick intervals (a wall-clock stamp taken a few ms later would make a 3 s gap
    read as 2.99 s and cost a tick). ``gpu_pids``: the ranks' pids on a real GPU (``dump_job``)."""
    results = dump_job(rank_pids, cfg, gpu_pids)
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
