"""One sampling tick, the same for ``launch`` and the daemon.

``Engine.tick()`` samples the node (a failure marks the agent down and skips the tick; it never raises),
attributes processes to jobs, attaches the in-job client's step heartbeats, collects finished stack dumps,
runs the pure detector, schedules new dumps off the sampling path (and, once per suspect streak, the ranks' Flight
Recorder dumps), compares each job's launch settings, samples running jobs' stacks at a low rate for stragglers,
drops a job that stayed healthy long enough back to fallback level 0, and updates metrics and the loop's
health. It returns what the tick saw; what to do about the findings is ``policy.respond``'s and the caller's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_watchdog.config.schema import Config
from gpu_watchdog.detect.consistency import ConfigReport, ConfigWatch, check_nodes, launch_env, run_key
from gpu_watchdog.detect.detector import RUNNING, DetectorState, hold_waiting, step
from gpu_watchdog.detect.stragglers import StragglerWatch
from gpu_watchdog.evidence.deadline.watch import DeadlineWatch
from gpu_watchdog.evidence.flight_recorder.dumps import SuspectDumps
from gpu_watchdog.evidence.flight_recorder.watch import SuspectDumpWatch
from gpu_watchdog.evidence.nccl_ras.poll import RasPoller
from gpu_watchdog.evidence.nccl_ras.watch import RasWatch
from gpu_watchdog.evidence.source import JobWatch
from gpu_watchdog.evidence.stacks.collect import collect_stack_evidence, pids_on_gpu
from gpu_watchdog.evidence.stacks.spawned_ranks import SpawnedRanks
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.model import CommProgress, Finding, JobStatus, NodeSample, StackEvidence
from gpu_watchdog.sample.backends import Backend
from gpu_watchdog.sample.recent import RecentSamples
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.job_runs import JobRuns

log = logging.getLogger("gpu_watchdog.engine")

# A wall clock that moved this much more (or less) than the monotonic clock between two ticks was stepped (NTP, an
# admin): the detector's windows and streak timers, measured in sample time, start again from the next sample.
CLOCK_STEP_S = 2.0

Heartbeats = Callable[[], Mapping[str, Mapping[int, int]]]  # job → rank → last step the in-job client reported


@dataclass(frozen=True)
class Tick:
    """What one tick saw. ``ok`` False: sampling failed (``error``), nothing else ran."""

    ok: bool
    sample: NodeSample | None = None
    jobs: Mapping[str, JobStatus] = field(default_factory=dict)
    findings: tuple[Finding, ...] = ()
    error: str = ""


@dataclass
class WatchedJob:
    """What the engine keeps about one job between ticks: dropped with it when the job ends (work in flight for it,
    a dump or a read of the shared directory, is kept apart and taken when done)."""

    settings: ConfigWatch = field(default_factory=ConfigWatch)  # its ranks' launch settings, checked and compared
    healthy_since: float | None = None  # wall time it has run without a stall since (fallback.healthy_reset_s)
    comm_seen: float = 0.0  # the newest NCCL RAS observation read from the shared directory and handed on
    comm_read_at: float = 0.0  # monotonic: when its shared record is read next


def _no_heartbeats() -> Mapping[str, Mapping[int, int]]:
    return {}


def _as_is(sample: NodeSample) -> NodeSample:
    return sample


class Engine:
    def __init__(self, cfg: Config, backend: Backend, fallback: FallbackStore, pool: Executor, *,
                 health: LoopHealth, metrics: Any = None, heartbeats: Heartbeats = _no_heartbeats,
                 attribute: Callable[[NodeSample], NodeSample] = _as_is,
                 on_dump_done: Callable[[], None] | None = None, say: Callable[[str], None] = log.info) -> None:
        self.cfg = cfg  # replaced on a reload
        self.backend = backend
        self.fallback = fallback
        self.health = health
        self.metrics = metrics
        self._pool = pool
        self._heartbeats = heartbeats
        self._attribute = attribute
        self._on_dump_done = on_dump_done
        self._say = say
        self.state = DetectorState()
        self.last_sample: NodeSample | None = None
        # The last agent.incident_trace_s of what the detector saw: every incident's trace (act.target).
        self.recent = RecentSamples(cfg.agent.incident_trace_s, cfg.agent.interval_s)
        self.ticks_ok = 0
        self.ticks_failed = 0
        self.last_error = ""
        self._last_clock: tuple[float, float] | None = None  # (sample time, monotonic) of the last good sample
        self._jobs: dict[str, WatchedJob] = {}
        self._dumps: dict[str, Future[list[StackEvidence]]] = {}
        self.ras = RasPoller(lambda: self.cfg.ras)  # NCCL RAS: watched jobs, and every suspect or stalled one
        self.fr_dumps = SuspectDumps()  # Flight Recorder dumps asked for at suspect: an incident takes them
        self._holds: list[tuple[str, float, str, tuple[int, ...], str]] = []  # hold() requests for the next tick
        self._shared: ThreadPoolExecutor | None = None  # fallback.shared_dir work (cross-node settings)
        self._cross: dict[str, tuple[JobStatus, Future[ConfigReport | None]]] = {}
        # NCCL RAS observations shared through fallback.shared_dir: reads of the watcher's record in flight.
        self._comm_reads: dict[str, Future[list[CommProgress]]] = {}
        self._fresh: list[str] = []  # restarted_in_place() requests for the next tick
        self._holds_lock = threading.Lock()  # the daemon's acts run on worker threads
        # Ranks handed their rank in code (mp.spawn): the scanner asks for each one's rank, read from its stack.
        self.ranks_in_code = SpawnedRanks(cfg.stacks.py_spy, cfg.stacks.timeout_s)
        self.stragglers = StragglerWatch(lambda: self.cfg)  # observe only: its findings are recorded, never acted on
        self.deadlines = DeadlineWatch(lambda: self.cfg)  # the jobs' own deadlines: the detector's and the warnings
        # The evidence sources that watch a job while it runs or is suspect, after each detector step: a new one
        # is one line here (evidence.source.JobWatch).
        self.watches: tuple[JobWatch, ...] = (
            SuspectDumpWatch(self.fr_dumps, pool, lambda: self.cfg.flight_recorder),
            RasWatch(self.ras, lambda: self.cfg.ras),
            self.stragglers,
            self.deadlines,
        )
        scanner = getattr(backend, "scanner", None)
        if scanner is not None:
            scanner.rank_finder = self.ranks_in_code

    def hold(self, job_id: str, onset: float, why: str, on: tuple[int, ...] = (), doing: str = "") -> None:
        """A confirmed stall that was not acted on (no communication evidence): from the next tick the job waits
        until ``waiting_timeout_s`` after ``onset`` (detector.hold_waiting). Safe from any thread."""
        with self._holds_lock:
            self._holds.append((job_id, onset, why, on, doing))

    def restarted_in_place(self, job_id: str) -> None:
        """The job's own engine restarts its ranks (Ray Train): from the next tick it is watched as a new run. Safe
        from any thread."""
        with self._holds_lock:
            self._fresh.append(job_id)

    def _apply_holds(self) -> None:
        with self._holds_lock:
            holds, self._holds = self._holds, []
            fresh, self._fresh = self._fresh, []
        for job_id in fresh:
            self.new_run(job_id)
        for job_id, onset, why, on, doing in holds:
            self.state = hold_waiting(self.state, job_id, onset, why, on, doing)

    def new_run(self, job_id: str) -> None:
        """The job was restarted: its new ranks start with a clean slate (detector, launch-settings check,
        healthy time)."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.settings.new_run()
            job.healthy_since = None
        for w in self.watches:
            w.forget(job_id)
        self.state = replace(self.state, jobs={j: s for j, s in self.state.jobs.items() if j != job_id},
                             ranks={k: o for k, o in self.state.ranks.items() if k[0] != job_id})

    def tick(self) -> Tick:
        t0 = time.process_time()
        try:
            sample = self.backend.sample()
        except Exception as e:  # NVML wedged or faulted, a psutil hiccup: a bad tick, never a dead agent
            return self._failed(str(e) or type(e).__name__)
        self._check_clock(sample.t)
        try:
            sample = with_heartbeats(self._attribute(sample), self._heartbeats())
            dumps = self._finished_dumps()
            self._apply_holds()
            self.recent.configure(self.cfg.agent.incident_trace_s, self.cfg.agent.interval_s)
            self.recent.add(sample, dumps)
            own = self.ras.take_progress()
            comm = own + self._shared_comm()
            state, findings = step(self.state, sample, self.cfg.detect, dumps, comm, self.deadlines.known())
            self.state, self.last_sample = state, sample
            for w in self.watches:
                findings.extend(w.watch(state.jobs, sample))
            self._schedule_dumps(sample.t)
            self._share_comm(own, state.jobs)
            findings.extend(self._check_configs(sample.t))
            self._note_healthy(state.jobs)
            self._forget_ended(state.jobs)
            if self.metrics is not None:
                self.metrics.sample_duration(time.process_time() - t0)
                self.metrics.nvml_errors(sample.errors)
                self.metrics.update(sample, state.jobs, {j: self.fallback.level(j) for j in state.jobs})
                self.metrics.straggler_scores(self.stragglers.rank_scores())
        except Exception as e:  # a bug past sampling (a malformed sample, a broken collector): this tick is lost
            return self._internal_error(e)
        self.ticks_ok += 1
        self.health.tick_ok()
        return Tick(True, sample, state.jobs, tuple(findings))

    def _internal_error(self, e: Exception) -> Tick:
        cause = f"{type(e).__name__}: {e}"
        error = f"internal error: {cause}"
        if error != self.last_error:  # the traceback once per streak of the same error
            log.exception("%s (the tick is skipped; the agent carries on)", error)
        self.ticks_failed += 1
        self.last_error = error
        self.health.tick_failed(cause, what="internal error")
        count_internal_error(self.metrics, "tick")
        return Tick(False, error=error)

    def _check_clock(self, t: float) -> None:
        """A stepped wall clock: back, and every window reads as too short (a rank's verdict freezes, a hang goes
        unseen until the clock catches up); forward, and a short pause reads as an hour-long streak (a false
        stall). Both: forget the windows and streaks; GPU faults already reported stay reported."""
        mono = time.monotonic()
        last, self._last_clock = self._last_clock, (t, mono)
        if last is None:
            return
        step = (t - last[0]) - (mono - last[1])
        if abs(step) > CLOCK_STEP_S:
            log.warning("the wall clock was stepped by %+.0f s: detection windows start again", step)
            self.state = DetectorState(faulted=self.state.faulted, fault_keys=self.state.fault_keys)

    def _failed(self, cause: str) -> Tick:
        error = f"sampling failed: {cause}"
        if not self.ticks_failed or error != self.last_error:  # once per streak of the same failure
            log.warning("%s", error)
        self.ticks_failed += 1
        self.last_error = error
        self.health.tick_failed(cause)
        if self.metrics is not None:
            self.metrics.set_up(False)
        return Tick(False, error=error)

    def _finished_dumps(self) -> list[StackEvidence]:
        out: list[StackEvidence] = []
        for job_id, fut in list(self._dumps.items()):
            if not fut.done():
                continue
            del self._dumps[job_id]
            try:
                out.extend(fut.result())
            except Exception as e:  # a failed dump is missing evidence, not a crash
                log.warning("stack dump of job %s failed: %s", job_id, e)
        return out

    def _schedule_dumps(self, t: float) -> None:
        if not self.cfg.stacks.enabled:
            return
        wake = self._on_dump_done
        for js in self.state.jobs.values():
            if js.needs_stacks and js.job_id not in self._dumps:
                gpu = pids_on_gpu(self.last_sample, js.rank_pids.values())
                fut = self._pool.submit(self._dump, js.job_id, dict(js.rank_pids), t, gpu)
                if wake is not None:
                    fut.add_done_callback(lambda _f: wake())
                self._dumps[js.job_id] = fut

    def _dump(self, job_id: str, rank_pids: dict[int, int], t: float,
              gpu_pids: frozenset[int] = frozenset()) -> list[StackEvidence]:
        """One dump of the job's ranks (off the sampling path; ``gpu_pids``: those on a real GPU, which may get a
        native re-dump); with ``fallback.shared_dir`` also published for the other nodes' agents (a shared file
        system that hangs delays this worker, never a tick)."""
        evidence = collect_stack_evidence(job_id, rank_pids, self.cfg.stacks, t, gpu_pids)
        runs = JobRuns.from_config(self.cfg)
        if runs is not None:
            for ev in evidence:
                try:
                    runs.publish_stacks(ev)
                except OSError as e:
                    log.warning("cannot publish the stacks of job %s to %s: %s", job_id, runs.root, e)
        return evidence

    def _shared_comm(self) -> list[CommProgress]:
        """What the watcher on rank 0's node published since the last tick for the jobs this node does not watch
        (read off the tick, on the shared-directory worker)."""
        comm: list[CommProgress] = []
        for job_id, fut in list(self._comm_reads.items()):
            if fut.done():
                del self._comm_reads[job_id]
                try:
                    comm += fut.result()
                except Exception as e:  # an unreachable shared directory is missing evidence, not a crash
                    log.debug("job %s: cannot read the shared NCCL RAS record: %s", job_id, e)
        for c in comm:
            job = self._job(c.job_id)
            job.comm_seen = max(job.comm_seen, c.t)
        return comm

    def _share_comm(self, own: list[CommProgress], jobs: Mapping[str, JobStatus]) -> None:
        """With ``fallback.shared_dir``: publish what this node watched, and read the watcher's record for the jobs
        whose rank 0 runs elsewhere, once per ``ras.watch_interval_s`` each."""
        runs = JobRuns.from_config(self.cfg)
        watch = self.cfg.ras.watch_interval_s
        if runs is None or watch <= 0:
            return
        for c in own:
            js = jobs.get(c.job_id)
            if js is not None and 0 in js.rank_pids:
                self._shared_pool().submit(runs.publish_comm, c)
        now = time.monotonic()
        for js in jobs.values():
            job = self._job(js.job_id)
            if 0 in js.rank_pids or js.job_id in self._comm_reads or now < job.comm_read_at:
                continue
            job.comm_read_at = now + watch
            self._comm_reads[js.job_id] = self._shared_pool().submit(runs.peer_comm, js.job_id, job.comm_seen)

    def _check_configs(self, t: float) -> list[Finding]:
        """Every job's ranks on this node must share their launch settings: the digest goes to the metrics
        (an alert compares nodes), a new mismatch becomes a finding."""
        scanner = getattr(self.backend, "scanner", None)
        if scanner is None:
            return []
        out = self._cross_node_findings(t)
        for js in self.state.jobs.values():
            if self.config_watch(js.job_id).due(js.rank_pids, scanner.env_of, t):
                finding = self.check_launch_settings(js, t)
                if finding is not None:
                    out.append(finding)
            if self.cfg.fallback.shared_dir and js.job_id not in self._cross and self.config_watch(
                    js.job_id).cross_due(t):
                envs = {r: dict(launch_env(pid, scanner)) for r, pid in js.rank_pids.items()}
                self._cross[js.job_id] = (js, self._shared_pool().submit(self._compare_nodes, js.job_id, envs))
        return out

    def close(self) -> None:
        """Stop the shared-directory worker: queued comparisons are dropped (one already blocked on a hung shared
        file system still finishes, or not, on its own thread)."""
        if self._shared is not None:
            self._shared.shutdown(wait=False, cancel_futures=True)
        self.ranks_in_code.close()
        self.stragglers.close()
        self.deadlines.close()

    def _shared_pool(self) -> Executor:
        """One worker for the shared directory (a file system that hangs delays it, never a tick)."""
        if self._shared is None:
            self._shared = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-dir")
        return self._shared

    def _compare_nodes(self, job_id: str, envs: dict[int, dict[str, str]]) -> ConfigReport | None:
        """Publish this node's ranks' launch settings for their run and compare them with the other nodes' (None:
        no other node has published yet)."""
        runs = JobRuns.from_config(self.cfg)
        if runs is None:  # the shared directory was configured away (a reload) meanwhile
            return None
        run = run_key(envs.values())
        runs.publish_settings(job_id, run, envs)
        peers = runs.peer_settings(job_id, run)
        if not peers:
            return None
        return check_nodes({runs.host: envs, **peers})

    def _cross_node_findings(self, t: float) -> list[Finding]:
        out = []
        for job_id, (js, fut) in list(self._cross.items()):
            if not fut.done():
                continue
            del self._cross[job_id]
            try:
                report = fut.result()
            except Exception as e:  # an unreachable shared directory is missing evidence, not a crash
                log.warning("job %s: cannot compare launch settings across nodes: %s", job_id, e)
                continue
            finding = self.config_watch(job_id).cross_finding(report, js, t) if report is not None else None
            if finding is not None:
                out.append(finding)
        return out

    def _job(self, job_id: str) -> WatchedJob:
        return self._jobs.setdefault(job_id, WatchedJob())

    def config_watch(self, job_id: str) -> ConfigWatch:
        return self._job(job_id).settings

    def check_launch_settings(self, js: JobStatus, t: float) -> Finding | None:
        """Compare the job's ranks' launch settings now: the digest to the metrics, a finding when a mismatch
        is news (detect.consistency.ConfigWatch)."""
        report, finding = self.config_watch(js.job_id).check(js, getattr(self.backend, "scanner", None), t)
        if self.metrics is not None:
            self.metrics.job_config(js.job_id, report.digest)
        return finding

    def _note_healthy(self, jobs: Mapping[str, JobStatus]) -> None:
        """A job running without a stall for ``fallback.healthy_reset_s`` drops back to fallback level 0."""
        now = time.time()
        for job_id, js in jobs.items():
            job = self._job(job_id)
            if js.state != RUNNING or job.healthy_since is None:
                job.healthy_since = now
            if js.state != RUNNING:
                continue
            if self.fallback.note_healthy(job_id, job.healthy_since, now, self.cfg.fallback):
                self._say(f"job {job_id} healthy for {self.cfg.fallback.healthy_reset_s:.0f}s: "
                          "fallback level back to 0")

    def _forget_ended(self, jobs: Mapping[str, JobStatus]) -> None:
        for job_id in set(self._jobs) - set(jobs):
            del self._jobs[job_id]
            if self.metrics is not None:
                self.metrics.forget_job(job_id)
        for w in self.watches:
            for job_id in w.jobs() - set(jobs):
                w.forget(job_id)


def count_internal_error(metrics: Any, stage: str) -> None:
    """Count an exception caught at a stage boundary; the counting itself never raises."""
    if metrics is None:
        return
    try:
        metrics.internal_error(stage)
    except Exception:
        log.exception("metrics: internal_error failed")


def with_heartbeats(sample: NodeSample, steps: Mapping[str, Mapping[int, int]]) -> NodeSample:
    """Attach each job's in-job client step heartbeats to that job's rank processes."""
    if not any(steps.values()):
        return sample
    procs = tuple(
        replace(p, heartbeat_step=steps[p.job.job_id][p.job.rank])
        if p.is_rank and p.job and p.job.rank is not None and p.job.rank in steps.get(p.job.job_id, {}) else p
        for p in sample.processes
    )
    return replace(sample, processes=procs)
