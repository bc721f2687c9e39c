"""The straggler watch of one agent: low-rate stack samples of every job's ranks, their scores, and one
``straggler`` finding per rank and run that the window names (observe only: ``policy.respond`` records it).

Sampling costs a nonblocking ``py-spy dump`` per rank (about 10 ms of the agent's CPU each, measured; the job is
never paused) every ``straggler.interval_s``, on a worker of its own so it never delays a hang's dumps. A job is
sampled while it has peers (at least two ranks here, or ranks elsewhere: its world size says so) and is not
stalled: a confirmed stall is a hang, and the window starts again after it. A suspect or waiting job is sampled
on: a rank starved of input leaves the whole job looking idle while it crawls. A node with one rank of a job
exports that rank's wait share only: the straggler across nodes is Prometheus' to find (prometheus/alerts.yml,
docs/stragglers.md).
"""

from __future__ import annotations

import logging
import resource
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from gpu_watchdog.config.schema import Config
from gpu_watchdog.detect.states import STALLED
from gpu_watchdog.evidence.stacks.collect import classify_results, pids_on_gpu, with_gpu_line
from gpu_watchdog.evidence.stacks.dump import dump_stacks
from gpu_watchdog.evidence.straggler.causes import Cause, HostCounters, find_causes, host_counters
from gpu_watchdog.evidence.straggler.score import Thresholds, Verdict, WaitWindow, as_sampled
from gpu_watchdog.model import DeviceSample, Finding, JobStatus, NodeSample, rank_label

log = logging.getLogger("gpu_watchdog.straggler")

# What one rank's nonblocking py-spy dump costs the agent before a round was measured (9.5 ms on this project's
# 2-core box; 16 ms for a Ray Train worker): the first rounds keep to the budget too.
DUMP_CPU_S = 0.010

# (t, rank → state, rank → counters, the round's CPU: its py-spy processes')
Round = tuple[float, dict[int, str], dict[int, HostCounters], float]


@dataclass
class _JobWatch:
    pids: dict[int, int]
    window: WaitWindow = field(default_factory=WaitWindow)
    counters: deque[tuple[float, dict[int, HostCounters]]] = field(default_factory=deque)
    next_at: float = 0.0  # monotonic
    pending: Future[Round] | None = None
    reported: set[int] = field(default_factory=set)  # ranks named in this run (one finding each)
    verdict: Verdict | None = None
    round_cpu_s: float | None = None  # what a round costs, smoothed
    stretch: float = 1.0  # how far the budget spaces its rounds beyond interval_s (its window stretches as much)
    gpu_ranks: frozenset[int] = frozenset()  # ranks on a real GPU at the last round


def _throttled_since(before: HostCounters | None, now: HostCounters | None) -> float:
    if before is None or now is None or before.throttled_s is None or now.throttled_s is None:
        return 0.0
    return max(0.0, now.throttled_s - before.throttled_s)


def pace(interval_s: float, round_cpu_s: float | None, budget: float) -> float:
    """Seconds between a job's rounds: ``interval_s``, or longer where its rounds would cost more than ``budget``
    (a share of one core)."""
    if not round_cpu_s or budget <= 0:
        return interval_s
    return max(interval_s, round_cpu_s / budget)


def _world_sizes(sample: NodeSample) -> dict[str, int]:
    """job → the largest world size its ranks here declare (0: none does)."""
    out: dict[str, int] = {}
    for p in sample.processes:
        if p.is_rank and p.job is not None and p.job.world_size:
            out[p.job.job_id] = max(out.get(p.job.job_id, 0), p.job.world_size)
    return out


def _devices_by_pid(sample: NodeSample) -> dict[int, DeviceSample]:
    return {p.pid: d for d in sample.devices if not d.virtual for p in d.processes}


def take_round(rank_pids: Mapping[int, int], cfg: Config, gpu_pids: frozenset[int],
               devices: Mapping[int, DeviceSample], t: float) -> Round:
    """One nonblocking stack sample of every rank, classified, with each rank's host counters and the CPU the
    round's py-spy processes used (reaped children of the agent meanwhile: another dump running at the same time
    counts too, which only spaces the rounds further)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    ranks = sorted(rank_pids)
    results = dump_stacks([rank_pids[r] for r in ranks], timeout_s=cfg.stacks.timeout_s,
                          concurrency=cfg.stacks.concurrency, py_spy=cfg.stacks.py_spy or None, nonblocking=True)
    by_rank = {}
    for r, res in zip(ranks, results, strict=True):
        # a device sync spins, active, at its caller's line (evidence.stacks.collect)
        if res.ok and res.pid in gpu_pids:
            res = replace(res, threads=with_gpu_line(res.threads, res.pid))
        by_rank[r] = res
    states = {s.rank: s.state for s in classify_results(by_rank)}
    counters = {r: host_counters(pid, devices.get(pid)) for r, pid in rank_pids.items()}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return t, states, counters, max(0.0, cpu)


class StragglerWatch:
    def __init__(self, cfg: Callable[[], Config]) -> None:
        self._cfg = cfg  # read each tick: a reload replaces the config
        self._jobs: dict[str, _JobWatch] = {}
        self._pool: ThreadPoolExecutor | None = None

    def rank_scores(self) -> dict[str, dict[int, tuple[float, float, bool]]]:
        """Per watched job, rank → (wait share, score, named the straggler now): the metrics' per-rank series."""
        return {j: {r: (s.wait_share, s.score, r in w.verdict.stragglers) for r, s in w.verdict.scores.items()}
                for j, w in self._jobs.items() if w.verdict is not None and w.verdict.scores}

    def forget(self, job_id: str) -> None:
        """The job ended or was restarted: its window starts again."""
        self._jobs.pop(job_id, None)

    def jobs(self) -> set[str]:
        return set(self._jobs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def watch(self, jobs: Mapping[str, JobStatus], sample: NodeSample) -> list[Finding]:
        cfg = self._cfg()
        sc = cfg.straggler
        if not sc.enabled or not cfg.stacks.enabled:
            self._jobs.clear()
            return []
        now = time.monotonic()
        out = []
        for job_id in set(self._jobs) - set(jobs):
            del self._jobs[job_id]
        devices = _devices_by_pid(sample)
        worlds = _world_sizes(sample)
        share = sc.cpu_budget_percent / 100.0 / max(1, len(self._jobs))  # of a core, per sampled job
        for js in jobs.values():
            if len(js.rank_pids) < 2 and worlds.get(js.job_id, 0) < 2:
                self._jobs.pop(js.job_id, None)
                continue
            w = self._jobs.get(js.job_id)
            if w is None or w.pids != dict(js.rank_pids):  # a new run, or a rank replaced: a new window
                w = self._jobs[js.job_id] = _JobWatch(dict(js.rank_pids))
            th = Thresholds(sc.window_s * w.stretch, sc.slices, sc.min_peer_wait_share, sc.max_share_ratio)
            self._collect(w, th.window_s)
            if js.state == STALLED:  # a hang, not a straggler: its window starts again once the job runs
                w.window.reset()
                w.counters.clear()
                continue
            if w.pending is None and now >= w.next_at:
                cost = w.round_cpu_s if w.round_cpu_s is not None else DUMP_CPU_S * len(w.pids)
                w.stretch = pace(sc.interval_s, cost, share) / sc.interval_s
                w.next_at = now + sc.interval_s * w.stretch
                gpu = pids_on_gpu(sample, w.pids.values())
                w.gpu_ranks = frozenset(r for r, pid in w.pids.items() if pid in gpu)
                w.pending = self._worker().submit(take_round, dict(w.pids), cfg, gpu, devices, sample.t)
            w.verdict = w.window.verdict(sample.t, th)
            for rank in w.verdict.stragglers:
                if rank not in w.reported:
                    w.reported.add(rank)
                    out.append(_finding(js, w, rank, devices, sample, th))
        return out

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="straggler")
        return self._pool

    @staticmethod
    def _collect(w: _JobWatch, window_s: float) -> None:
        fut = w.pending
        if fut is None or not fut.done():
            return
        w.pending = None
        try:
            t, states, counters, cpu = fut.result()
        except Exception as e:  # a failed round is a missing sample, never a crash
            log.warning("straggler sample failed: %s", e)
            return
        w.round_cpu_s = cpu if w.round_cpu_s is None else 0.7 * w.round_cpu_s + 0.3 * cpu
        last = w.counters[-1][1] if w.counters else {}
        states = {r: as_sampled(s, _throttled_since(last.get(r), counters.get(r)), r in w.gpu_ranks)
                  for r, s in states.items()}
        w.window.add(t, states, window_s)
        w.counters.append((t, counters))
        while w.counters and w.counters[0][0] < t - window_s:
            w.counters.popleft()


def _finding(js: JobStatus, w: _JobWatch, rank: int, devices: Mapping[int, DeviceSample], sample: NodeSample,
             th: Thresholds) -> Finding:
    """The straggler finding for ``rank``, its causes read now (the incident's ``straggler`` section)."""
    verdict = w.verdict
    assert verdict is not None
    score = verdict.scores[rank]
    pid = w.pids[rank]
    dev = devices.get(pid)
    first = w.counters[0] if w.counters else None
    last = w.counters[-1] if w.counters else None
    causes = find_causes(pid, score.input_share, dev, first[1].get(rank) if first else None,
                         last[1].get(rank) if last else None, (last[0] - first[0]) if first and last else 0.0)
    peers = verdict.peer_wait_share(rank)
    detail = (f"{rank_label(rank)} is the straggler of job {js.job_id}: its peers waited in {peers:.0%} of their "
              f"stack samples over the last {th.window_s:.0f} s, it in {score.wait_share:.0%} (score "
              f"{score.score:.2f}); cause: {_causes_text(causes)}")
    facts: dict[str, object] = {
        "rank": rank, "host": sample.hostname, "pid": pid, "score": round(score.score, 3),
        "wait_share": round(score.wait_share, 3), "peer_wait_share": round(peers, 3),
        "window_s": th.window_s, "since": verdict.since, "samples": score.samples,
        "gpu": {"index": dev.index, "uuid": dev.uuid} if dev is not None else None,
        "causes": [c.to_json() for c in causes],
        "scores": {str(r): s.to_json() for r, s in sorted(verdict.scores.items())},
    }
    return Finding("straggler", "slow_rank", js.job_id, tuple(sorted(js.rank_pids)), (rank,),
                   verdict.since if verdict.since is not None else sample.t, sample.t,
                   (dev.uuid,) if dev is not None else (), detail, "stacks", facts)


def _causes_text(causes: list[Cause]) -> str:
    return "; ".join(c.detail for c in causes) if causes else "none visible on this node"
