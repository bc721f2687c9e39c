"""``gpu-watchdog run``: the node daemon.

Wiring only: an apscheduler interval job runs the engine's tick (the same tick as ``launch``: sample, detect,
stack dumps off the sampling path, heartbeats of registered jobs' in-job clients, healthy-time fallback reset);
each finding goes to ``policy.respond`` and is acted on in a worker pool, off the sampling path: recovery of a
registered job (act.recovery, with the job's restart hook as its restart), a drain (act.faults), an incident
only, or the evidence of a stall nobody registered. A second job prunes old incidents. Signal handlers only
enqueue; the main thread acts (SIGTERM/SIGINT: stop, SIGHUP: reload; an invalid new config keeps the old one).
sd_notify: READY=1 after the first good tick, WATCHDOG=1 from a pinger while the loop ticks, STATUS= one line,
STOPPING=1 on shutdown.

The daemon only ever signals processes of the job being acted on (daemon.registry).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from gpu_watchdog.act.checkpoint import request_checkpoint
from gpu_watchdog.act.faults import GpuFaultHandler, record
from gpu_watchdog.act.hooks import run_hook
from gpu_watchdog.act.recovery import Recovery, observe
from gpu_watchdog.act.slurm import cancelled, moved_on, show_job
from gpu_watchdog.act.stopper import JobProcess
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.load import load_config
from gpu_watchdog.config.schema import Config, DaemonSettings
from gpu_watchdog.daemon.housekeeping import prune_incidents
from gpu_watchdog.daemon.registry import Registry
from gpu_watchdog.daemon.resume import resume_incidents
from gpu_watchdog.detect.consistency import CONSISTENCY_ENV
from gpu_watchdog.detect.detector import DetectorState, Finding, JobStatus
from gpu_watchdog.detect.states import STALLED
from gpu_watchdog.engine.loop import Engine, count_internal_error
from gpu_watchdog.errors import ConfigError, NoInputError, UsageError
from gpu_watchdog.evidence import flight_recorder as fr
from gpu_watchdog.export.health import LoopHealth, Pinger
from gpu_watchdog.export.sdnotify import Notifier
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import NodeSample
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.policy.hook_values import placeholder_values, render_argv
from gpu_watchdog.policy.respond import respond
from gpu_watchdog.sample.backends import Backend, choose_backend, gpu_memory_holders
from gpu_watchdog.store.db import Store
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import Incident, IncidentStore
from gpu_watchdog.store.job_runs import JobRuns

log = logging.getLogger("gpu_watchdog.daemon")


class RegisteredJob:
    """A registered job as the act stage sees it (act.target.JobTarget): its processes are the registry's, its
    restart is the restart hook it registered."""

    def __init__(self, daemon: Daemon, job_id: str, reg: dict[str, Any]) -> None:
        self.daemon = daemon
        self.job_id = job_id
        self.reg = reg
        self.control = daemon.control_dir(job_id)
        self.may_signal_checkpoint = bool(reg.get("checkpoint_opt_in"))  # never a signal it did not ask for
        self.run: int | None = reg.get("run")  # Slurm's restart count, from the TaskProlog

    def processes(self) -> list[JobProcess]:
        return self.daemon.job_processes(self.job_id)

    def poll(self) -> int | None:
        return None if self.processes() else 0

    def restart(self, inc: Incident, level: int, shown: str) -> bool:
        return self.daemon.run_restart_hook(inc, self.job_id, self.reg.get("restart_hook"), level, self.run)


class Daemon:
    def __init__(self, cfg: Config, settings: DaemonSettings, state_dir: Path, *, config_path: str | None = None,
                 overrides: dict[str, Any] | None = None, metrics: Any = None, backend: Backend | None = None,
                 notifier: Notifier | None = None, health: LoopHealth | None = None) -> None:
        self.cfg = cfg
        self.settings = settings
        self.state_dir = Path(state_dir)
        self.config_path = config_path
        self.overrides = dict(overrides or {})
        self.metrics = metrics
        self.host = cfg.agent.hostname or socket.gethostname()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.state_dir)
        self.registry = Registry(self.store)
        self.incidents = IncidentStore(self.state_dir, journal=self.store)
        self.fallback = FallbackStore(self.state_dir)
        self.notifier = notifier or Notifier.from_env(unset_environment=True)
        self.health = health or LoopHealth.for_interval(cfg.agent.interval_s)
        self.backend: Backend | None = backend
        self.backend_why = "injected" if backend else ""
        self._stopping = threading.Event()  # set when run() ends: cuts a restart backoff short
        self.ctx = ActContext(cfg, self.host, self.incidents, self.fallback, metrics, self._log_info,
                              runs=JobRuns.from_config(cfg, self.host))
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="watchdog-work")
        self._engine: Engine | None = None
        self._owned: tuple[int, ...] = ()  # registered processes and their descendants, as of this tick
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.RLock()  # busy set, budgets, observed
        self._busy: set[str] = set()  # jobs being acted on
        self._observed: dict[str, float] = {}  # job → onset of the stall already observed (jobs still seen only)
        self._budgets: dict[str, RestartBudget] = {}
        self._work: list[Any] = []  # futures of acts in flight (for wait_idle)
        self._ready = False
        self._status = ""
        self._scheduler: Any = None
        self._control: Any = None

    @staticmethod
    def _log_info(msg: str) -> None:
        log.info("%s", msg)

    # -- the engine ----------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        if self._engine is None:
            if self.backend is None:
                self.backend, self.backend_why = choose_backend(
                    self.cfg.agent.backend, root_pid=None, hostname=self.host,
                    extra_pids=self._registered_pids, env_filter=CONSISTENCY_ENV,
                    faults=self.cfg.faults, min_window_s=self.cfg.detect.progress_min_window_s)
            scanner = getattr(self.backend, "scanner", None)
            if scanner is not None:  # a registered job whose ranks set their rank in code (mp.spawn): its ranks
                scanner.member_pool = lambda: self._owned
            self.ctx.gpu_pids = gpu_memory_holders(self.backend)
            self._engine = Engine(self.cfg, self.backend, self.fallback, self._pool, health=self.health,
                                  metrics=self.metrics, heartbeats=self._heartbeats,
                                  attribute=self.registry.attribute, say=self._log_info)
            self.ctx.ras = self._engine.ras  # an incident reuses the RAS polls made while the job was suspect
            self.ctx.recent = self._engine.recent
            self.ctx.fr_dumps = self._engine.fr_dumps  # dumps asked for at suspect: the incident takes them
        return self._engine

    def _registered_pids(self) -> tuple[int, ...]:
        self._owned = tuple(self.registry.owned_pids())
        return self._owned

    @property
    def state(self) -> DetectorState:
        return self.engine.state

    @state.setter
    def state(self, value: DetectorState) -> None:
        self.engine.state = value

    @property
    def last_sample(self) -> NodeSample | None:
        return self.engine.last_sample

    @property
    def ticks_ok(self) -> int:
        return self.engine.ticks_ok

    @property
    def ticks_failed(self) -> int:
        return self.engine.ticks_failed

    def control_dir(self, job_id: str) -> ControlDir:
        """The job's control directory; with a run (Slurm's restart count) one per run, so that a requeued
        job's clients never read the previous run's checkpoint request."""
        reg = self.registry.get(job_id)
        run = reg.get("run") if reg else None
        base = self.state_dir / "run" / job_id
        return ControlDir(base / f"run-{int(run)}" if run is not None else base)

    def start_reply(self, job_id: str) -> dict[str, Any]:
        """What a registration hands back to the job: its control directory and its fallback overlay — with
        ``fallback.shared_dir`` the job-wide record of its run, so every node exports the same settings."""
        reg = self.registry.get(job_id)
        run = reg.get("run") if reg else None
        data = self.ctx.level_record(job_id, run)
        reply = {"control_dir": str(self.control_dir(job_id).path), "level": int(data.get("level", 0)),
                 "env": dict(data.get("env") or {})}
        frc = self.cfg.flight_recorder
        fr_dir = self.control_dir(job_id).path / fr.RUN_DIR_NAME
        if frc.enabled and fr_dir.is_dir():  # the TaskProlog adds what the job leaves unset (recording_env)
            reply["flight_recorder"] = {"buffer_size": frc.buffer_size, "dir": str(fr_dir)}
        return reply

    def target(self, job_id: str, reg: dict[str, Any]) -> RegisteredJob:
        return RegisteredJob(self, job_id, reg)

    def _heartbeats(self) -> dict[str, dict[int, int]]:
        """The step heartbeats of registered jobs' in-job clients (the control dir registration hands out)."""
        return {job_id: self.control_dir(job_id).steps() for job_id in self.registry.registrations()}

    # -- registrations ---------------------------------------------------------------------------
    def registrations(self) -> dict[str, dict[str, Any]]:
        return self.registry.registrations()

    def register(self, reg: dict[str, Any]) -> None:
        old = self.registry.get(reg["job_id"])
        self.registry.register(reg)
        if old is None or old.get("run") != reg.get("run"):
            self._fresh_control_dir(reg)

    def _fresh_control_dir(self, reg: dict[str, Any]) -> None:
        """A clean control directory for a new run, owned by the registrant (its clients write there)."""
        control = self.control_dir(reg["job_id"])
        control.create()
        uid = int(reg.get("registered_by_uid", 0))
        if uid:
            try:
                os.chown(control.path, uid, -1)
            except OSError as e:
                log.warning("job %s: cannot hand %s to uid %d: %s", reg["job_id"], control.path, uid, e)
        if self.cfg.flight_recorder.enabled and fr.prepare_run_dir(control.path, uid) is None:
            log.warning("job %s: cannot prepare %s: its ranks get no Flight Recorder dump paths", reg["job_id"],
                        control.path / fr.RUN_DIR_NAME)

    def unregister(self, job_id: str) -> bool:
        # The restart budget outlives the registration: a job requeued by its restart hook ends (epilog)
        # and starts again under the same id, and must not come back with a fresh budget (a restart loop).
        return self.registry.unregister(job_id)

    def job_processes(self, job_id: str) -> list[JobProcess]:
        return self.registry.job_processes(job_id, self.last_sample)

    def budget(self, job_id: str) -> RestartBudget:
        """The job's restart budget, kept in the store so that neither a daemon restart nor the job's
        requeue resets it; a budget untouched for ``recovery.restart_window_s`` is forgotten."""
        with self._lock:
            b = self._budgets.get(job_id)
            if b is None or b.cfg is not self.cfg.recovery:  # first use, or the config was reloaded
                b = RestartBudget(self.cfg.recovery, self.store.budget(job_id),
                                  on_change=lambda b: self.store.put_budget(job_id, b.state()))
                self._budgets[job_id] = b
            return b

    # -- the sampling tick (apscheduler job) -----------------------------------------------------------
    def tick(self) -> None:
        self.check_control()
        tick = self.engine.tick()
        if tick.ok:
            assert tick.sample is not None
            for f in tick.findings:
                self._on_finding(f, tick.sample, tick.jobs.get(f.job_id) if f.job_id else None)
            with self._lock:  # observed stalls of jobs no longer seen are forgotten (bounded)
                for job_id in set(self._observed) - set(tick.jobs):
                    del self._observed[job_id]
        if tick.ok and not self._ready:
            self._ready = True
            self._set_status(ready=True)
        else:
            self._set_status()

    def check_control(self) -> None:
        """The control API is reachable (a vanished socket recreated), else /healthz says why not."""
        if self._control is not None:
            self.health.problem("control", self._control.ensure())

    def _on_finding(self, f: Finding, sample: NodeSample, status: JobStatus | None) -> None:
        regs = self.registrations()
        response = respond(f, self.cfg, supervised=f.job_id in regs,
                           stop_unsupervised=self.settings.stop_unregistered)
        if response.action == "record":
            self._submit(None, self._record, f, sample)
        elif response.action == "drain":
            self._submit(None, self._drain, f, sample)
        elif response.action == "recover":
            assert f.job_id is not None
            if self._claim(f.job_id):
                self._submit(f.job_id, self._recover, f.job_id, f, sample, status)
        else:
            with self._lock:
                if f.job_id is not None and self._observed.get(f.job_id) == f.onset:
                    return
                if f.job_id is not None:
                    self._observed[f.job_id] = f.onset
            self._submit(None, self._observe, f, sample, status, response.stop, response.why)

    def _claim(self, job_id: str) -> bool:
        with self._lock:
            if job_id in self._busy:
                return False
            self._busy.add(job_id)
            return True

    def _submit(self, job_id: str | None, fn: Callable[..., Any], *args: Any) -> None:
        def guarded() -> None:
            try:
                fn(*args)
            except Exception:  # the stage boundary: logged with its cause, counted; the daemon carries on
                log.exception("%s failed", getattr(fn, "__name__", fn))
                count_internal_error(self.metrics, "act")
            finally:
                if job_id is not None:
                    with self._lock:
                        self._busy.discard(job_id)

        fut = self._pool.submit(guarded)
        with self._lock:
            self._work = [w for w in self._work if not w.done()] + [fut]

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Wait for the acts in flight (tests, shutdown)."""
        with self._lock:
            work = list(self._work)
        wait(work, timeout=timeout_s)

    # -- acts (worker pool) --------------------------------------------------------------------------------
    def _recover(self, job_id: str, finding: Finding, sample: NodeSample, status: JobStatus | None) -> None:
        reg = self.registrations().get(job_id)
        if reg is None:
            return
        hook = self.settings.give_up_hook
        before_give_up = (lambda inc, level: self.run_hook(inc, job_id, "give_up_hook", hook, level)) if hook else None
        result = Recovery(self.ctx, self.budget(job_id), before_give_up, wait=self._backoff_wait).handle(
            finding, self.target(job_id, reg), sample, status)
        if result.held:  # observed, not acted on: the job waits (Engine.hold) and is watched on
            self.engine.hold(job_id, finding.onset, result.held, result.held_on, result.held_doing)
            return
        result.incident.finish("gave up: restart budget spent (no restart hook run)" if result.give_up
                               else f"restarted by {result.restarted_by}" if result.restarted_by
                               else f"given up by {result.given_up_by}" if result.given_up_by
                               else "restarted by another agent (Slurm)" if result.incident.summary.get("restarted_by")
                               else "restart hook ran" if result.restarted else "restart hook failed or missing")

    def _backoff_wait(self, seconds: float) -> bool:
        """The restart backoff on a worker thread, cut short when the daemon stops: False when cut."""
        return not self._stopping.wait(seconds)

    def _observe(self, finding: Finding, sample: NodeSample, status: JobStatus | None, stop: bool, why: str) -> None:
        target = _UnregisteredRanks(self, finding.job_id or "") if stop else None
        inc = observe(self.ctx, finding, status, sample, target, why)
        log.warning("%s in job %s (%s): %s; incident %s", finding.kind, finding.job_id, finding.detail, why, inc.id)

    def _record(self, finding: Finding, sample: NodeSample) -> None:
        inc = record(self.ctx, self.cfg.hooks, finding, sample)
        if finding.kind != "gpu_fault":  # the fault handler logged its own line
            log.warning("job %s: %s: incident %s", finding.job_id, finding.detail, inc.id)

    def _drain(self, finding: Finding, sample: NodeSample) -> None:
        """Stop the registered jobs on the faulted GPU, drain the node, then run their restart hooks so the
        scheduler places them elsewhere (their fallback levels unchanged: no NCCL setting helps a broken GPU)."""
        regs = self.registrations()
        targets = {j: self.target(j, r) for j, r in regs.items()}
        inc, stopped = GpuFaultHandler(self.ctx, self.cfg.hooks).drain(finding, sample, targets)
        for job_id in stopped:
            self.run_restart_hook(inc, job_id, regs[job_id].get("restart_hook"), self.fallback.level(job_id),
                                  regs[job_id].get("run"))
        inc.finish("node drain requested" if any(a["action"] == "drain" and a["ok"] for a in inc.summary["actions"])
                   else "drain not run")

    def run_restart_hook(self, inc: Incident, job_id: str, hook_name: str | None, level: int,
                         run: int | None = None) -> bool:
        """The restart hook; a Slurm requeue only while the job is still in the run this agent saw hang (another
        node's agent, or a late one, may have requeued it already: never a second requeue, never a failed hook)."""
        spec = self.cfg.hooks.get(hook_name or "")
        if spec is not None and spec.type == "slurm-requeue" and run is not None:
            job = show_job(job_id)
            if cancelled(job):
                inc.record_action("restart_hook", False, "skipped: the job was cancelled in Slurm (JobState=CANCELLED)",
                                  outcome="skipped")
                return False
            why = moved_on(job, run)
            if why:
                inc.record_action("restart_hook", False, f"skipped: {why}; restarted by another agent",
                                  outcome="skipped")
                inc.update(restarted_by={"host": "another agent (Slurm)", "incident": None, "run": run + 1})
                return False
        return self.run_hook(inc, job_id, "restart_hook", hook_name, level)

    def run_hook(self, inc: Incident, job_id: str, action: str, hook_name: str | None, level: int) -> bool:
        """Run a [hooks.NAME] for this job as the incident's ``action`` (restart_hook, give_up_hook)."""
        spec = self.cfg.hooks.get(hook_name or "")
        if spec is None:
            why = (f"{action.replace('_', ' ')} {hook_name!r} is no longer in the config" if hook_name
                   else "the job registered no restart hook")
            inc.record_action(action, False, f"not run: {why}")
            return False
        try:
            values = placeholder_values(job_id, self.host, level, inc.id)
        except UsageError as e:
            inc.record_action(action, False, f"not run: {e}")
            return False
        argv = render_argv(spec.argv, values)
        entry = inc.begin_action(action, f"{spec.name}: {' '.join(argv)} (timeout {spec.timeout_s:g}s)")
        env_file = str(self.fallback.root / f"{job_id}.json")
        res = run_hook(spec, values, extra_env={"GPU_WATCHDOG_FALLBACK_FILE": env_file})
        inc.end_action(entry, res.ok, res.detail())
        inc.update(**{action: res.to_json()})
        self.ctx.metric("action", action, res.ok)
        (log.info if res.ok else log.warning)("job %s: %s %s", job_id, action.replace("_", " "), res.detail())
        return res.ok

    # -- the control API's requests ------------------------------------------------------------------------
    def manual_restart(self, job_id: str) -> bool:
        """``restart``: checkpoint → stop → restart hook at the next fallback level."""
        if not self._claim(job_id):
            return False
        status = self.state.jobs.get(job_id)
        now = time.time()
        f = Finding("restart", "requested", job_id, tuple(status.ranks) if status else (), (), now, now,
                    status.devices if status else (), "restart requested through the control API", "request")
        sample = self.last_sample or NodeSample(t=now, hostname=self.host, backend="none", devices=(), processes=(),
                                                errors=())
        self._submit(job_id, self._recover, job_id, f, sample, status)
        return True

    def preempt(self, job_id: str, timeout_s: float) -> dict[str, Any]:
        """Ask a job to checkpoint now; wait at most ``timeout_s`` for its acknowledgement (or, signalled, its exit)."""
        reg = self.registrations()[job_id]
        allowed = {p.pid: p for p in self.job_processes(job_id)}
        status = self.state.jobs.get(job_id)
        ranks = [allowed[pid] for pid in (status.rank_pids.values() if status else ()) if pid in allowed]

        def running() -> bool:
            live = {q.pid for q in self.job_processes(job_id)}
            return any(p.pid in live for p in ranks)

        res = request_checkpoint(self.control_dir(job_id), f"preempt-{int(time.time() * 1000)}", self.cfg.recovery,
                                 timeout_s=timeout_s, running=running if ranks else lambda: True,
                                 signal_ranks=ranks if reg.get("checkpoint_opt_in") else ())
        if res.how == "client":  # "skipped" (no step completed yet) leaves the resumed-from state: safe to stop
            error = (f"no acknowledgement from ranks {list(res.missing)} within {timeout_s:g}s" if res.missing
                     else f"a rank's save failed: {res.detail}" if res.outcome == "failed" else "")
            return {"ok": not error, "job_id": job_id, "outcome": res.outcome,
                    "acks": {str(r): a.get("outcome") for r, a in res.acks.items()},
                    **({"error": error} if error else {})}
        if res.how == "signal":
            return {"ok": res.ok, "job_id": job_id, "signal": self.cfg.recovery.checkpoint_signal,
                    "sent_to": list(res.sent_to)}
        return {"ok": False, "job_id": job_id,
                "error": "the job has no in-job client and did not opt in to a checkpoint signal "
                         "(checkpoint_opt_in + recovery.checkpoint_signal)"}

    def status_report(self) -> dict[str, Any]:
        return {"status": self.status_line(), "store_problem": self.store.problem,
                "jobs": {j: {"state": s.state, "ranks": list(s.ranks), "signature": s.signature}
                         for j, s in self.state.jobs.items()},
                "registered": sorted(self.registrations()), "hooks": sorted(self.cfg.hooks)}

    def recent_incidents(self, limit: int) -> list[dict[str, Any]]:
        return self.store.incidents(limit)

    # -- status ----------------------------------------------------------------------------------------
    def status_line(self) -> str:
        jobs = self.state.jobs
        stalled = sum(1 for j in jobs.values() if j.state == STALLED)
        line = (f"{len(jobs)} job(s) seen, {len(self.registrations())} registered, {stalled} stalled, "
                f"{len(self._busy)} recovering; {self.backend.name if self.backend else '?'} backend")
        if self.store.problem:
            line += "; STATE STORE DEGRADED"
        if self.engine.last_error and self.engine.ticks_failed:
            line += f"; last error: {self.engine.last_error}"
        return line

    def _set_status(self, ready: bool = False) -> None:
        line = self.status_line()
        if ready:
            self.notifier.ready(line)
        elif line != self._status:
            self.notifier.status(line)
        self._status = line

    # -- crash recovery and housekeeping --------------------------------------------------------------
    def resume(self) -> list[str]:
        """Finish incidents a killed daemon left unfinished (daemon.resume)."""
        def registered(job_id: str) -> RegisteredJob | None:
            reg = self.registrations().get(job_id)
            return self.target(job_id, reg) if reg is not None else None

        return resume_incidents(self.store, self.ctx, registered)

    def housekeeping(self, now: float | None = None) -> list[str]:
        """Prune old incident directories and forget restart budgets untouched for a whole window; returns the
        removed incidents."""
        now = time.time() if now is None else now
        with self._lock:
            for job_id in self.store.prune_budgets(now - self.cfg.recovery.restart_window_s):
                self._budgets.pop(job_id, None)
        return prune_incidents(self.incidents.root, self.store, self.settings, now)

    # -- lifecycle -----------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals.put(signum)  # the main loop acts

    def reload(self) -> bool:
        self.notifier.reloading()
        try:
            cfg = load_config(self.config_path, self.overrides)
        except (ConfigError, NoInputError) as e:  # bad content, or the file is gone or unreadable
            log.error("reload: keeping the old config: %s", e)
            self.notifier.ready(self.status_line())
            return False
        if cfg.daemon.control_socket != self.settings.control_socket:
            log.warning("reload: daemon.control_socket changes only on a restart")
        self.cfg, self.settings = cfg, dataclasses.replace(cfg.daemon, control_socket=self.settings.control_socket)
        self.ctx.cfg = cfg
        self.engine.cfg = cfg
        if self._control is not None:
            self._control.settings = self.settings
        if self._scheduler is not None:
            self._scheduler.reschedule_job("tick", trigger="interval", seconds=cfg.agent.interval_s)
        log.info("reload: config %s loaded", self.config_path or "(defaults)")
        self.notifier.ready(self.status_line())
        return True

    def run(self) -> int:
        from apscheduler.schedulers.background import BackgroundScheduler

        from gpu_watchdog.daemon.control import ControlServer

        logging.getLogger("apscheduler").setLevel(logging.WARNING)  # one line per tick otherwise
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        if self.store.problem:
            log.error("%s", self.store.problem)
        engine = self.engine
        log.info("gpu-watchdog daemon: sampling with the %s every %gs; state in %s", self.backend_why,
                 self.cfg.agent.interval_s, self.state_dir)
        for iid in self.resume():
            log.info("resumed incident %s", iid)
        if self.settings.control_socket:
            self._control = ControlServer(self.settings, self)
            self._control.start()
            log.info("control API on %s", self.settings.control_socket)
        pinger = Pinger(self.health, self.notifier.watchdog, self.notifier.watchdog_interval_s).start() \
            if self.notifier.watchdog_interval_s else None
        sched = BackgroundScheduler(timezone="UTC")
        sched.add_job(self.tick, "interval", id="tick", seconds=self.cfg.agent.interval_s, coalesce=True,
                      max_instances=1, misfire_grace_time=None, next_run_time=_now_utc())
        sched.add_job(self.housekeeping, "interval", id="housekeeping",
                      seconds=self.settings.housekeeping_interval_s, coalesce=True, max_instances=1,
                      next_run_time=_now_utc())
        self._scheduler = sched
        sched.start()
        try:
            while True:
                try:
                    signum = self._signals.get(timeout=1.0)
                except queue.Empty:
                    continue
                if signum == signal.SIGHUP:
                    self.reload()
                    self.check_control()
                    continue
                log.info("received %s: stopping", signal.Signals(signum).name)
                break
        finally:
            self._stopping.set()
            self.notifier.stopping("stopping")
            sched.shutdown(wait=False)
            if self._control is not None:
                self._control.stop()
            if pinger is not None:
                pinger.stop()
            self._pool.shutdown(wait=False, cancel_futures=True)
            engine.backend.close()
            engine.close()
            self.store.close()
        return 0


class _UnregisteredRanks:
    """The ranks of a job nobody registered, for ``daemon.stop_unregistered``: only processes sampled as its
    ranks (never the daemon); there is nothing to restart."""

    may_signal_checkpoint = False

    def __init__(self, daemon: Daemon, job_id: str) -> None:
        self.daemon = daemon
        self.job_id = job_id
        self.control = daemon.control_dir(job_id)

    def processes(self) -> list[JobProcess]:
        import os

        sample = self.daemon.last_sample
        return [JobProcess(p.pid, p.create_time) for p in (sample.processes if sample else ())
                if p.is_rank and p.job and p.job.job_id == self.job_id and p.pid != os.getpid()]

    def poll(self) -> int | None:
        return None

    def restart(self, inc: Incident, level: int, shown: str) -> bool:
        return False


def _now_utc() -> Any:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc)


def main_run(config_path: str | None, overrides: dict[str, Any]) -> int:
    cfg = load_config(config_path, overrides)  # ConfigError → exit 78 naming the key
    from gpu_watchdog.config.schema import resolve_state_dir
    from gpu_watchdog.daemon.control import refuse_if_served
    from gpu_watchdog.export.http import start_metrics

    if cfg.daemon.control_socket:  # one daemon per socket: before anything binds or writes (exit 69)
        refuse_if_served(cfg.daemon.control_socket)

    health = LoopHealth.for_interval(cfg.agent.interval_s)  # one health for /healthz and the systemd pings
    metrics, server = start_metrics(cfg, health, config_path=config_path, overrides=overrides)
    try:
        return Daemon(cfg, cfg.daemon, resolve_state_dir(cfg), config_path=config_path, overrides=overrides,
                      metrics=metrics, health=health).run()
    finally:
        if server is not None:
            server.stop()


__all__ = ["Daemon", "RegisteredJob", "main_run"]
