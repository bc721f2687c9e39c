"""``gpu-watchdog launch -- CMD``: supervise one job on this node and recover it from stalls.

Each run: start CMD in its own session with the job's identity, control directory and fallback overlay in
its environment; sample and detect every tick (stack dumps run off the sampling path); on a confirmed stall
hand over to gpu_watchdog.act.recovery, which records the incident, checkpoints, stops and decides the next run's
settings; then start the next run, until the job exits on its own or the restart budget is spent. A GPU
fault goes to gpu_watchdog.act.faults instead: stop, drain the node, exit 74 (or, for an application Xid,
an incident only).
Signal handlers only set a flag; the loop acts on it at a safe point.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from gpu_watchdog.sample.backends import Backend, choose_backend
from gpu_watchdog.config.schema import Config, resolve_state_dir
from gpu_watchdog.detect.consistency import CONSISTENCY_ENV, ConfigWatch
from gpu_watchdog.detect.detector import DetectorState, Finding, JobStatus, step
from gpu_watchdog.evidence.collect import collect_stack_evidence
from gpu_watchdog.policy.fallback import FallbackStore, validate_job_id
from gpu_watchdog.act.faults import FaultPolicy
from gpu_watchdog.launch.guardian import Guardian
from gpu_watchdog.store.incidents import IncidentStore
from gpu_watchdog.job.protocol import CONTROL_DIR_ENV, FALLBACK_LEVEL_ENV, RESTART_COUNT_ENV, ControlDir
from gpu_watchdog.model import NodeSample, StackEvidence
from gpu_watchdog.sample.processes import JOB_ID_ENV
from gpu_watchdog.act.recovery import EXIT_BUDGET_SPENT, Recovery, RestartBudget
from gpu_watchdog.act.stopper import JobProcess, stop_processes

log = logging.getLogger("gpu_watchdog.launch.launcher")


class Launcher:
    def __init__(self, cfg: Config, cmd: Sequence[str], *, state_dir: Path | None = None,
                 job_id: str | None = None, out: TextIO = sys.stderr, metrics: Any = None,
                 hooks: Any = None) -> None:
        if not cmd:
            from gpu_watchdog.errors import UsageError

            raise UsageError("launch needs a command after --")
        self.cfg = cfg
        self.cmd = list(cmd)
        self.state_dir = state_dir or resolve_state_dir(cfg)
        self.host = cfg.agent.hostname or socket.gethostname()
        self.job_id = validate_job_id(job_id or f"launch-{self.host}-{os.getpid()}-{int(time.time())}")
        self.out = out
        self.metrics = metrics
        self.incidents = IncidentStore(self.state_dir)
        self.fallback = FallbackStore(self.state_dir)
        self.budget = RestartBudget(cfg.recovery)
        self.fault_policy = FaultPolicy(self, hooks)  # hooks: the config's [hooks.NAME] (faults.drain_hook)
        self._stop_signal: int | None = None
        self.config_watch = ConfigWatch()
        self._wake = threading.Event()  # set when a stack dump finishes: feed it to the detector at once
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stacks")
        self.backend: Backend | None = None

    def say(self, msg: str) -> None:
        print(f"gpu-watchdog: {msg}", file=self.out, flush=True)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop_signal = signum  # acted on by the loop
        self._wake.set()

    # -- one run -----------------------------------------------------------------------------------
    def _start(self, attempt: int, extra_env: dict[str, str], control: ControlDir) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.update(extra_env)
        env.update({JOB_ID_ENV: self.job_id, CONTROL_DIR_ENV: str(control.path),
                    RESTART_COUNT_ENV: str(attempt), FALLBACK_LEVEL_ENV: str(self.fallback.level(self.job_id))})
        control.create()
        try:
            return subprocess.Popen(self.cmd, env=env, start_new_session=True)
        except OSError as e:
            from gpu_watchdog.errors import UsageError

            raise UsageError(f"cannot start {self.cmd[0]!r}: {e.strerror}") from None

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        backend, why = choose_backend(self.cfg.agent.backend, root_pid=os.getpid(), hostname=self.host,
                                      env_filter=CONSISTENCY_ENV, faults=self.cfg.faults,
                                      min_window_s=self.cfg.detect.progress_min_window_s)
        self.backend = backend
        self.say(f"job {self.job_id}: sampling with the {why}; state in {self.state_dir}")
        control = ControlDir(self.state_dir / "run" / self.job_id)
        restart_env: dict[str, str] = dict(self.fallback.load(self.job_id).get("env") or {})
        attempt = 0
        try:
            while True:
                if self._stop_signal is not None:  # arrived during a recovery (the job is already stopped)
                    self.say(f"received {signal.Signals(self._stop_signal).name}: not restarting the job")
                    return 128 + self._stop_signal
                child = self._start(attempt, restart_env, control)
                backend.scanner.root_pid = child.pid  # type: ignore[attr-defined]
                # Stops the job if this process dies without ending the run (even SIGKILL); released only
                # when the run ended under our control, so an internal error still takes the job down with us.
                guardian = Guardian(child.pid, self.cfg.recovery.stop_grace_s)
                outcome = self._watch(child, backend, control, attempt)
                guardian.release()
                if outcome.exit_code is not None:
                    return outcome.exit_code
                restart_env = outcome.restart_env
                attempt += 1
        finally:
            backend.close()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _watch(self, child: subprocess.Popen[bytes], backend: Backend, control: ControlDir,
               attempt: int) -> _Outcome:
        exits = ExitWatch()
        try:
            return self._watch_run(child, backend, control, attempt, exits)
        finally:
            exits.close()

    def _watch_run(self, child: subprocess.Popen[bytes], backend: Backend, control: ControlDir,
                   attempt: int, exits: ExitWatch) -> _Outcome:
        cfg = self.cfg
        state = DetectorState()
        pending: list[StackEvidence] = []
        dump: Future[list[StackEvidence]] | None = None
        healthy_since = time.time()
        next_tick = time.monotonic()
        self.config_watch.new_run()
        seen: dict[int, JobProcess] = {}  # every job process sampled in this run (pid + create time)
        last_seen: JobStatus | None = None  # the job as last seen with ranks (they are gone after a crash)
        while True:
            rc = child.poll()
            if rc is not None:
                self.say(f"job exited with code {rc}")
                self._stop_leftovers(seen.values())
                code = 128 - rc if rc < 0 else rc  # killed by signal N: 128+N, as a shell
                if code != 0 and self._stop_signal is None:
                    exits.close()
                    crashed = self._crashed(code, exits.exits, last_seen, attempt)
                    if crashed is not None:
                        return crashed
                return _Outcome(exit_code=code)
            if self._stop_signal is not None:
                signum = self._stop_signal
                self.say(f"received {signal.Signals(signum).name}: stopping the job")
                Recovery(self).stop_only(child)
                return _Outcome(exit_code=128 + signum)
            t0 = time.process_time()
            sample = _with_heartbeats(backend.sample(), control.steps(), self.job_id)
            seen.update((p.pid, JobProcess(p.pid, p.create_time)) for p in sample.processes
                        if p.job is not None and p.job.job_id == self.job_id)
            if dump is not None and dump.done():
                pending.extend(_future_result(dump))
                dump = None
            state, findings = step(state, sample, cfg.detect, pending)
            pending = []
            self._export(sample, state.jobs, time.process_time() - t0)
            ours = state.jobs.get(self.job_id)
            last_seen = ours or last_seen
            if ours is not None:
                exits.watch(dict(ours.rank_pids))
            scanner = backend.scanner  # type: ignore[attr-defined]
            if ours is not None and self.config_watch.due(ours.rank_pids, scanner.env_of, sample.t):
                self._check_config(backend, ours, sample.t)
            if ours is not None and ours.needs_stacks and dump is None and cfg.stacks.enabled:
                dump = self._pool.submit(collect_stack_evidence, ours, cfg.stacks, sample.t)
                dump.add_done_callback(lambda _f: self._wake.set())
            for f in findings:
                if f.kind == "gpu_fault":
                    fault_code = self.fault_policy.handle(f, child, sample)
                    if fault_code is not None:
                        return _Outcome(exit_code=fault_code)
                elif f.job_id == self.job_id:
                    outcome = self._recover(f, child, sample, ours, control, attempt)
                    if outcome is not None:
                        self._stop_leftovers(seen.values())
                        return outcome
            if ours is not None and ours.state in ("running",):
                if self.fallback.note_healthy(self.job_id, healthy_since, time.time(), cfg.fallback):
                    self.say(f"job healthy for {cfg.fallback.healthy_reset_s:.0f}s: fallback level back to 0")
            else:
                healthy_since = time.time()
            next_tick += cfg.agent.interval_s
            if self._wake.wait(max(0.0, next_tick - time.monotonic())):
                self._wake.clear()  # an early tick; the regular schedule resumes after it
                next_tick -= cfg.agent.interval_s

    def _crashed(self, code: int, exits: dict[int, tuple[float, int | None]], status: JobStatus | None,
                 attempt: int) -> _Outcome | None:
        """A rank died and took the job down (torchrun tears every rank down within a second): an incident naming
        the rank, how it ended, its last stack if one was taken and the peers' state; then a restart within the
        budget when ``recovery.restart_on_crash``, else None (``launch`` exits with the job's code)."""
        from gpu_watchdog.sample.processes import describe_exit

        now = time.time()
        ranks = tuple(sorted(status.ranks_seen)) if status else ()
        first = _first_to_exit(exits)
        if len(ranks) > 1 and set(first) >= set(ranks):
            first = ()  # every rank went at once: which one failed is not known
        how = "; ".join(f"rank {r}: {describe_exit(exits[r][1])}" for r in first) or \
            "no rank was seen exiting first (torchrun reaps and tears down within its monitor interval)"
        onset = min((t for t, _ in exits.values()), default=now)
        finding = Finding("rank_exited", "rank_exited", self.job_id, ranks, first, onset, now, status.devices
                          if status else (), f"{how}; the launched command exited {code}", "process")
        inc = self.incidents.create(finding, self.host)
        last = status.evidence[-1] if status and status.evidence else None
        inc.update(exits={str(r): describe_exit(st) for r, (_, st) in sorted(exits.items())},
                   peers={str(r): status.state for r in ranks if r not in first} if status else {},
                   last_stacks=[{"rank": rs.rank, "state": rs.state, "where": rs.where, "stack": rs.signature}
                                for rs in last.ranks] if last else [])
        if self.metrics is not None:
            self.metrics.incident(finding.kind)
        self.say(f"RANK EXITED in job {self.job_id}: {finding.detail}; incident {inc.id}")
        if not self.cfg.recovery.restart_on_crash:
            inc.record_action("restart", False, "not restarted: recovery.restart_on_crash is false (a crash usually "
                                                f"comes back); launch exits {code}")
            return None
        allowed, why_not = self.budget.allow(now, None)
        if not allowed:
            inc.record_action("give_up", True, f"restart budget spent: {why_not}")
            return _Outcome(exit_code=code)
        env = dict(self.fallback.load(self.job_id).get("env") or {})
        inc.record_action("restart", True, f"run {attempt + 1} (recovery.restart_on_crash), fallback level unchanged")
        self.say(f"restarting (run {attempt + 1}) after the crash (recovery.restart_on_crash)")
        return _Outcome(restart_env=env)

    def _stop_leftovers(self, procs: Any) -> None:
        """Ranks that outlived the launched process (torchrun killed, or crashed): orphans re-parented away from
        its tree would train or hang on unsupervised. Only processes sampled as this job's, same create time."""
        from gpu_watchdog.act.stopper import _alive

        left = [p for p in procs if _alive(p)]
        if left:
            res = stop_processes(left, self.cfg.recovery.stop_grace_s)
            self.say(f"stopped {len(left)} job process(es) left behind by the launched command: {res.detail}")

    def _check_config(self, backend: Backend, status: JobStatus, t: float) -> None:
        """Compare the ranks' launch settings as soon as they are seen: a mismatch hangs later."""
        report, finding = self.config_watch.check(status, backend.scanner, t)  # type: ignore[attr-defined]
        if self.metrics is not None:
            self.metrics.job_config(self.job_id, report.digest)
        if finding is None:
            return
        inc = self.incidents.create(finding, self.host)
        if self.metrics is not None:
            self.metrics.incident(finding.kind)
        self.say(f"WARNING: {finding.detail} (incident {inc.id})")

    def _recover(self, finding: Finding, child: subprocess.Popen[bytes], sample: NodeSample,
                 status: JobStatus | None, control: ControlDir, attempt: int) -> _Outcome | None:
        if not self.cfg.recovery.enabled:
            self.say(f"{finding.kind} found ({finding.detail}); recovery disabled, watching on")
            return None
        rc = self.cfg.recovery
        if self.metrics is not None:  # the stack dump, checkpoint grace, stop ladder and GPU memory wait
            self.metrics.recovering(self.cfg.stacks.timeout_s + rc.checkpoint_grace_s + rc.stop_grace_s + 5.0
                                    + rc.memory_release_timeout_s + 10.0)
        try:
            result = Recovery(self).handle(finding, child, sample, status, control, attempt)
        finally:
            if self.metrics is not None:
                self.metrics.recovering(None)
        if result.give_up:
            return _Outcome(exit_code=EXIT_BUDGET_SPENT)
        return _Outcome(restart_env=result.restart_env)

    def _export(self, sample: NodeSample, jobs: dict[str, JobStatus] | Any, cpu_s: float) -> None:
        if self.metrics is None:
            return
        self.metrics.sample_duration(cpu_s)
        self.metrics.nvml_errors(sample.errors)
        self.metrics.update(sample, jobs, {self.job_id: self.fallback.level(self.job_id)})


class _Outcome:
    def __init__(self, exit_code: int | None = None, restart_env: dict[str, str] | None = None) -> None:
        self.exit_code = exit_code
        self.restart_env = restart_env or {}


def _future_result(f: Future[list[StackEvidence]]) -> list[StackEvidence]:
    try:
        return f.result()
    except Exception as e:  # a failed dump is missing evidence, not a crash
        log.warning("stack dump failed: %s", e)
        return []


_TEARDOWN = (signal.SIGTERM, signal.SIGKILL)  # what torchrun sends the surviving workers


def _first_to_exit(exits: dict[int, tuple[float, int | None]]) -> tuple[int, ...]:
    """The rank(s) that failed: of the exits seen within a second of the first, those that did not end by
    torchrun's teardown signals; else the earliest ones seen."""
    if not exits:
        return ()
    first_t = min(t for t, _ in exits.values())
    early = {r: st for r, (t, st) in exits.items() if t - first_t < 1.0}
    own = tuple(sorted(r for r, st in early.items() if st is not None and (st & 0x7F) not in _TEARDOWN))
    return own or tuple(sorted(r for r, (t, _) in exits.items() if t - first_t < 0.01))


class ExitWatch:
    """Which rank died first, and how. torchrun reaps a dead worker within its monitor interval (0.1 s) and then
    tears the others down, all between two sampling ticks. This thread holds a pidfd per rank and sleeps in
    poll(2) until one becomes readable — the rank exited — then reads the zombie's exit status before torchrun
    reaps it: no CPU while the job runs. Without pidfds (Linux < 5.3) it reads /proc/PID/stat every ``poll_s``."""

    def __init__(self, poll_s: float = 0.05) -> None:
        self.poll_s = poll_s
        self.exits: dict[int, tuple[float, int | None]] = {}  # rank → (when seen exited, its exit status if caught)
        self._ranks: dict[int, int] = {}  # rank → pid, set by the sampling loop
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)
        self._thread.start()

    def watch(self, rank_pids: dict[int, int]) -> None:
        with self._lock:
            self._ranks.update(rank_pids)

    def _exited(self, rank: int, pid: int) -> None:
        from gpu_watchdog.sample.processes import read_exit_status

        self.exits.setdefault(rank, (time.time(), read_exit_status(pid)))

    def _run(self) -> None:
        import select

        poller = select.poll() if hasattr(os, "pidfd_open") else None
        fds: dict[int, tuple[int, int]] = {}  # pidfd → (rank, pid)
        known: set[int] = set()
        try:
            while not self._stop.is_set():
                with self._lock:
                    new = [(r, pid) for r, pid in self._ranks.items() if r not in known]
                for rank, pid in new:
                    known.add(rank)
                    if poller is not None:
                        try:
                            fd = os.pidfd_open(pid)
                        except ProcessLookupError:
                            self._exited(rank, pid)
                            continue
                        except OSError:  # no pidfd support here: read /proc instead
                            poller = None
                            continue
                        fds[fd] = (rank, pid)
                        poller.register(fd, select.POLLIN)
                if poller is None:
                    self._read_proc()
                    self._stop.wait(self.poll_s)
                    continue
                for fd, _event in poller.poll(200):  # wakes at once on an exit; 200 ms to pick up new ranks
                    poller.unregister(fd)
                    os.close(fd)
                    self._exited(*fds.pop(fd))
        finally:
            for fd in fds:
                os.close(fd)

    def _read_proc(self) -> None:
        with self._lock:
            ranks = [(r, pid) for r, pid in self._ranks.items() if r not in self.exits]
        for rank, pid in ranks:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
            except OSError:
                self.exits[rank] = (time.time(), None)
                continue
            if zombie:
                self._exited(rank, pid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def _with_heartbeats(sample: NodeSample, steps: dict[int, int], job_id: str) -> NodeSample:
    """Attach the in-job client's step heartbeats to our job's rank processes."""
    if not steps:
        return sample
    procs = tuple(
        replace(p, heartbeat_step=steps.get(p.job.rank))  # type: ignore[arg-type]
        if p.is_rank and p.job and p.job.job_id == job_id and p.job.rank in steps else p
        for p in sample.processes
    )
    return replace(sample, processes=procs)
