"""The straggler watch of one agent: every job's ranks watched two ways — the cheap signal every tick (the scheduler
clocks and wait channel of the thread doing each rank's work — its main thread, or the one its stacks showed the
main thread dispatching to, Ray Train's training thread — and its GPU's signature: evidence.straggler.signals) over
a short window, and low-rate stack samples over a long one — and one ``straggler`` finding per rank and run that
either window names (observe only: ``policy.respond`` records it). The finding says which (``evidence``:
``signals`` or ``stacks``).

The cheap signal costs well under 0.1 ms per rank and tick, read on the engine's thread. Stack sampling costs a
nonblocking ``py-spy dump`` per rank (about 10 ms of the agent's CPU each, measured; the job is never paused) every
``straggler.interval_s``, on a worker of its own so it never delays a hang's dumps. A job is
sampled while it has peers (at least two ranks here, or ranks elsewhere: its world size says so) and is not
stalled: a confirmed stall is a hang, and the window starts again after it. A suspect or waiting job is sampled
on: a rank starved of input leaves the whole job looking idle while it crawls. A node with one rank of a job
exports that rank's wait share only: the straggler across nodes is Prometheus' to find (prometheus/alerts.yml,
docs/stragglers.md).
"""

from __future__ import annotations

import logging
import resource
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from gpu_watchdog.config.schema import Config
from gpu_watchdog.detect.detector import device_signature
from gpu_watchdog.detect.states import STALLED
from gpu_watchdog.evidence.stacks.classify import work_thread
from gpu_watchdog.evidence.stacks.collect import classify_results, pids_on_gpu, with_gpu_line
from gpu_watchdog.evidence.stacks.dump import dump_stacks
from gpu_watchdog.evidence.straggler.causes import Cause, HostCounters, contention, find_causes, host_counters, origin
from gpu_watchdog.evidence.straggler.score import Thresholds, Verdict, WaitWindow, as_sampled
from gpu_watchdog.evidence.straggler.signals import ThreadClock, asleep_as, interval_states, read_clock, shares
from gpu_watchdog.model import DeviceSample, Finding, JobStatus, NodeSample, rank_label

log = logging.getLogger("gpu_watchdog.straggler")

# What one rank's nonblocking py-spy dump costs the agent before a round was measured (9.5 ms on this project's
# 2-core box; 16 ms for a Ray Train worker): the first rounds keep to the budget too.
DUMP_CPU_S = 0.010

class Round(NamedTuple):
    """One stack round of a job."""

    t: float
    states: dict[int, str]  # rank → its straggler state
    counters: dict[int, HostCounters]
    cpu_s: float  # the round's CPU: its py-spy processes' and the agent's own (reading every thread's counters)
    work_tids: dict[int, int | None]  # rank → the thread doing its work where not the main one (None: the main)


@dataclass
class _Signals:
    """One job's cheap signal: the last clocks read of each rank, the window of their intervals, and each rank's
    host counters at each slice (for the causes)."""

    clocks: dict[int, ThreadClock] = field(default_factory=dict)
    window: WaitWindow = field(default_factory=WaitWindow)
    counters: deque[tuple[float, dict[int, HostCounters]]] = field(default_factory=deque)
    cpu: dict[int, deque[tuple[float, float, float]]] = field(default_factory=dict)  # rank → (t, running, queued)
    asleep: dict[int, str] = field(default_factory=dict)  # rank → what it was last seen asleep on
    throttled: dict[int, float] = field(default_factory=dict)  # rank → share of the last slice its quota held it
    counted_at: float = 0.0  # monotonic time of the last counters read
    verdict: Verdict | None = None
    judged_at: float = 0.0  # the sample time of the last verdict

    def reset(self) -> None:
        self.clocks.clear()
        self.window.reset()
        self.counters.clear()
        self.cpu.clear()
        self.asleep.clear()
        self.throttled.clear()
        self.verdict = None


@dataclass
class _JobWatch:
    pids: dict[int, int]
    signals: _Signals = field(default_factory=_Signals)
    window: WaitWindow = field(default_factory=WaitWindow)
    counters: deque[tuple[float, dict[int, HostCounters]]] = field(default_factory=deque)
    next_at: float = 0.0  # monotonic
    pending: Future[Round] | None = None
    reported: set[int] = field(default_factory=set)  # ranks named in this run (one finding each)
    verdict: Verdict | None = None
    judged_at: float = 0.0  # the sample time of the last verdict
    round_cpu_s: float | None = None  # what a round costs, smoothed
    stretch: float = 1.0  # how far the budget spaces its rounds beyond interval_s (its window stretches as much)
    gpu_ranks: frozenset[int] = frozenset()  # ranks on a real GPU at the last round
    # rank → the thread its stacks showed doing its work, where the main thread only dispatches (Ray Train's
    # training thread): the one the cheap signal reads
    work_tids: dict[int, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Both windows start again (the job hung: what it did before says nothing of a straggler)."""
        self.window.reset()
        self.counters.clear()
        self.signals.reset()
        self.verdict = None


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
    """One nonblocking stack sample of every rank, classified, with each rank's host counters and the CPU the round
    cost: its py-spy processes' (reaped children of the agent meanwhile: another dump running at the same time counts
    too, which only spaces the rounds further) and the agent's own — each dump's reads of every thread of its rank
    (a Ray worker has dozens) cost about as much again."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    own0 = time.thread_time()
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
    work_tids = {r: _work_tid(res.threads, res.pid) for r, res in by_rank.items() if res.ok}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    own = time.thread_time() - own0 + sum(res.agent_cpu_s for res in results)
    return Round(t, states, counters, max(0.0, cpu) + own, work_tids)


def _work_tid(threads: Sequence[Mapping[str, object]], pid: int) -> int | None:
    th = work_thread(threads, pid)
    tid = th.get("os_thread_id") if th is not None else None
    return tid if isinstance(tid, int) else None


class StragglerWatch:
    def __init__(self, cfg: Callable[[], Config]) -> None:
        self._cfg = cfg  # read each tick: a reload replaces the config
        self._jobs: dict[str, _JobWatch] = {}
        self._pool: ThreadPoolExecutor | None = None

    def rank_scores(self) -> dict[str, dict[int, tuple[float, float, bool]]]:
        """Per watched job, rank → (wait share, score, named the straggler now): the metrics' per-rank series, from
        the cheap signal's window where it has scores (fresher), else the stacks'."""
        out = {}
        for j, w in self._jobs.items():
            v = next((v for v in (w.signals.verdict, w.verdict) if v is not None and v.scores), None)
            if v is not None:
                named = set(v.stragglers) | set(w.verdict.stragglers if w.verdict else ())
                out[j] = {r: (s.wait_share, s.score, r in named) for r, s in v.scores.items()}
        return out

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
        stacks = cfg.stacks.enabled
        if not sc.enabled or not (stacks or sc.signals):
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
            collected = self._collect(w, th.window_s)
            if js.state == STALLED:  # a hang, not a straggler: its windows start again once the job runs
                w.reset()
                continue
            if sc.signals:
                sig_th = Thresholds(sc.signal_window_s, sc.signal_slices, sc.min_peer_wait_share, sc.max_share_ratio)
                _read_signals(w, cfg, sample, devices, sig_th)
                for rank in w.signals.verdict.stragglers if w.signals.verdict else ():
                    if rank not in w.reported:
                        w.reported.add(rank)
                        out.append(_signal_finding(js, w, rank, devices, sample, sig_th))
            if not stacks:
                continue
            if w.pending is None and now >= w.next_at:
                self._start_round(w, cfg, sample, devices, share, now)
            if collected or _judge_due(w.window, w.verdict, w.judged_at, sample.t, th):
                w.verdict, w.judged_at = w.window.verdict(sample.t, th), sample.t
            for rank in w.verdict.stragglers if w.verdict else ():
                if rank not in w.reported:
                    w.reported.add(rank)
                    out.append(_stack_finding(js, w, rank, devices, sample, th))
        return out

    def _start_round(self, w: _JobWatch, cfg: Config, sample: NodeSample, devices: Mapping[int, DeviceSample],
                     share: float, now: float) -> None:
        """Start the job's next stack round, and space the one after it to what this one is expected to cost."""
        sc = cfg.straggler
        cost = w.round_cpu_s if w.round_cpu_s is not None else DUMP_CPU_S * len(w.pids)
        w.stretch = pace(sc.interval_s, cost, share) / sc.interval_s
        w.next_at = now + sc.interval_s * w.stretch
        gpu = pids_on_gpu(sample, w.pids.values())
        w.gpu_ranks = frozenset(r for r, pid in w.pids.items() if pid in gpu)
        w.pending = self._worker().submit(take_round, dict(w.pids), cfg, gpu, devices, sample.t)

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="straggler")
        return self._pool

    @staticmethod
    def _collect(w: _JobWatch, window_s: float) -> bool:
        """Add the job's round to its window once it is done; whether one was added."""
        fut = w.pending
        if fut is None or not fut.done():
            return False
        w.pending = None
        try:
            t, states, counters, cpu, work_tids = fut.result()
        except Exception as e:  # a failed round is a missing sample, never a crash
            log.warning("straggler sample failed: %s", e)
            return False
        for rank, tid in work_tids.items():
            if tid is None:
                w.work_tids.pop(rank, None)
            else:
                w.work_tids[rank] = tid
        w.round_cpu_s = cpu if w.round_cpu_s is None else 0.7 * w.round_cpu_s + 0.3 * cpu
        last = w.counters[-1][1] if w.counters else {}
        states = {r: as_sampled(s, _throttled_since(last.get(r), counters.get(r)), r in w.gpu_ranks)
                  for r, s in states.items()}
        w.window.add(t, states, window_s)
        w.counters.append((t, counters))
        while w.counters and w.counters[0][0] < t - window_s:
            w.counters.popleft()
        return True


def _judge_due(window: WaitWindow, verdict: Verdict | None, judged_at: float, t: float, th: Thresholds) -> bool:
    """Whether a window's verdict is due at sample time ``t`` between its new samples: none yet, a slice's width since
    the last (old samples leave the window a slice at a time), the clock went back, or the window just became whole.
    Judging it every tick cost a Ray node's daemon more than reading its ranks."""
    whole_at = window.started + th.window_s if window.started is not None else None
    return verdict is None or t - judged_at >= th.window_s / th.slices or t < judged_at \
        or (whole_at is not None and judged_at < whole_at <= t)


def _read_signals(w: _JobWatch, cfg: Config, sample: NodeSample, devices: Mapping[int, DeviceSample],
                  th: Thresholds) -> None:
    """One tick of the cheap signal: every rank's interval since the last read, its host counters once a slice."""
    sig = w.signals
    t = time.monotonic()
    on_device = Counter(devices[pid].uuid for pid in w.pids.values() if pid in devices)
    job_pids = frozenset(w.pids.values())
    states: dict[int, dict[str, float]] = {}
    for rank, pid in w.pids.items():
        clock, before = read_clock(pid, t, w.work_tids.get(rank)), sig.clocks.get(rank)
        if clock is None:
            sig.clocks.pop(rank, None)
            continue
        sig.clocks[rank] = clock
        if before is not None and before.tid != clock.tid:  # now its work thread: what the main one slept on is moot
            sig.asleep.pop(rank, None)
        sh = shares(before, clock) if before is not None else None
        if sh is None:
            sig.asleep[rank] = asleep_as(clock, sig.asleep.get(rank, "unknown"))
            continue
        dev = devices.get(pid)
        # a GPU that several of the job's ranks share says nothing about one of them
        device = device_signature(dev, cfg.detect, None, job_pids) \
            if dev is not None and on_device[dev.uuid] == 1 else None
        asleep = sig.asleep[rank] = asleep_as(clock, sig.asleep.get(rank, "unknown"))
        # a GPU of its own decides (device); on a GPU it shares, NCCL's work is still the GPU's, not its threads'
        on_gpu = dev is not None
        states[rank] = interval_states(sh, asleep, device, 0.0 if on_gpu else sig.throttled.get(rank, 0.0))
        sig.cpu.setdefault(rank, deque()).append((sample.t, sh.running, sh.queued))
    if states:
        sig.window.add(sample.t, states, th.window_s)
    if not sig.counters or sample.t - sig.counters[-1][0] >= th.window_s / th.slices:
        _count_slice(sig, w.pids, devices, sample.t, t)
    start = sample.t - th.window_s
    while len(sig.counters) > 1 and sig.counters[1][0] <= start:
        sig.counters.popleft()
    for shares_of in sig.cpu.values():
        while shares_of and shares_of[0][0] < start:
            shares_of.popleft()
    if _judge_due(sig.window, sig.verdict, sig.judged_at, sample.t, th):
        sig.verdict, sig.judged_at = sig.window.verdict(sample.t, th), sample.t


def _count_slice(sig: _Signals, pids: Mapping[int, int], devices: Mapping[int, DeviceSample], sample_t: float,
                 t: float) -> None:
    """Each rank's host counters at a slice, and the share of the last slice its CPU quota held it."""
    now_counters = {r: host_counters(pid, devices.get(pid)) for r, pid in pids.items()}
    if sig.counters and t > sig.counted_at:  # the quota's seconds against the wall clock's
        last = sig.counters[-1][1]
        sig.throttled = {r: min(1.0, _throttled_since(last.get(r), c) / (t - sig.counted_at))
                         for r, c in now_counters.items()}
    sig.counters.append((sample_t, now_counters))
    sig.counted_at = t


def _cpu_shares(sig: _Signals, rank: int) -> tuple[float, float]:
    """(its mean share on a CPU, its mean share queued for one) over the window."""
    rows = sig.cpu.get(rank) or deque()
    if not rows:
        return 0.0, 0.0
    return sum(r for _, r, _ in rows) / len(rows), sum(q for _, _, q in rows) / len(rows)


def _signal_finding(js: JobStatus, w: _JobWatch, rank: int, devices: Mapping[int, DeviceSample],
                    sample: NodeSample, th: Thresholds) -> Finding:
    sig = w.signals
    assert sig.verdict is not None
    running, queued = _cpu_shares(sig, rank)
    peers = [_cpu_shares(sig, r) for r in sig.verdict.scores if r != rank]
    peer_running = statistics.median(p[0] for p in peers) if peers else 0.0
    peer_queued = statistics.median(p[1] for p in peers) if peers else 0.0
    cpu = {"running_share": round(running, 3), "queued_share": round(queued, 3),
           "peer_running_share": round(peer_running, 3), "peer_queued_share": round(peer_queued, 3)}
    extra = contention(running, queued, peer_running, peer_queued)
    clock = sig.clocks.get(rank)
    return _finding(js, w.pids[rank], rank, sig.verdict, sig.counters, devices, sample, th, "signals",
                    extra=[extra] if extra else [], origin_hint=(running, peer_running),
                    facts={"cpu": cpu, "tid": clock.tid if clock is not None else w.pids[rank]})


def _stack_finding(js: JobStatus, w: _JobWatch, rank: int, devices: Mapping[int, DeviceSample], sample: NodeSample,
                   th: Thresholds) -> Finding:
    assert w.verdict is not None
    return _finding(js, w.pids[rank], rank, w.verdict, w.counters, devices, sample, th, "stacks")


def _finding(js: JobStatus, pid: int, rank: int, verdict: Verdict,
             counters: deque[tuple[float, dict[int, HostCounters]]], devices: Mapping[int, DeviceSample],
             sample: NodeSample, th: Thresholds, basis: str, *, extra: list[Cause] | None = None,
             origin_hint: tuple[float, float] | None = None, facts: Mapping[str, object] | None = None) -> Finding:
    """The straggler finding for ``rank``, its causes read now (the incident's ``straggler`` section)."""
    score = verdict.scores[rank]
    dev = devices.get(pid)
    first = counters[0] if counters else None
    last = counters[-1] if counters else None
    causes = find_causes(pid, score.input_share, dev, first[1].get(rank) if first else None,
                         last[1].get(rank) if last else None, (last[0] - first[0]) if first and last else 0.0)
    if not any(c.kind == "cpu_throttled" for c in causes):  # a quota queues it too: say the quota, once
        causes.extend(extra or [])
    why = origin(causes, *(origin_hint or (0.0, 0.0)))
    peers = verdict.peer_wait_share(rank)
    what = "stack samples" if basis == "stacks" else "time"
    because = f"; slow because of its {why}" if why != "unknown" else ""
    detail = (f"{rank_label(rank)} is the straggler of job {js.job_id}: its peers waited in {peers:.0%} of their "
              f"{what} over the last {th.window_s:.0f} s, it in {score.wait_share:.0%} (score {score.score:.2f})"
              f"{because}; cause: {_causes_text(causes)}")
    section: dict[str, object] = {
        "rank": rank, "host": sample.hostname, "pid": pid, "score": round(score.score, 3),
        "wait_share": round(score.wait_share, 3), "peer_wait_share": round(peers, 3),
        "window_s": th.window_s, "since": verdict.since, "samples": score.samples, "evidence": basis,
        "origin": why,
        "gpu": {"index": dev.index, "uuid": dev.uuid} if dev is not None else None,
        "causes": [c.to_json() for c in causes],
        "scores": {str(r): s.to_json() for r, s in sorted(verdict.scores.items())},
        **(facts or {}),
    }
    return Finding("straggler", "slow_rank", js.job_id, tuple(sorted(js.rank_pids)), (rank,),
                   verdict.since if verdict.since is not None else sample.t, sample.t,
                   (dev.uuid,) if dev is not None else (), detail, basis, section)


def _causes_text(causes: list[Cause]) -> str:
    return "; ".join(c.detail for c in causes) if causes else "none visible on this node"
