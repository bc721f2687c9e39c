"""``gpu-watchdog run``: the node daemon.

Wiring only: the agent (agent.build: backend, engine, act context, as for ``launch``) on the processes of the
registered jobs; an apscheduler interval job runs the engine's tick (sample, detect, stack dumps off the sampling
path, heartbeats of registered jobs' in-job clients, healthy-time fallback reset); each finding goes through
agent.dispatch to daemon.acts, which acts in a worker pool, off the sampling path (recovery of a registered job
with its restart hook as its restart, a drain, an incident only, or the evidence of a stall nobody registered).
A second job prunes old incidents and forgotten budgets. Signal handlers only
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpu_watchdog.act.checkpoint import request_checkpoint
from gpu_watchdog.act.stopper import JobProcess
from gpu_watchdog.agent.build import Watched, build_agent
from gpu_watchdog.agent.dispatch import Dispatcher
from gpu_watchdog.config.load import load_config
from gpu_watchdog.config.schema import Config, DaemonSettings
from gpu_watchdog.daemon.acts import DaemonActs
from gpu_watchdog.daemon.housekeeping import prune_incidents
from gpu_watchdog.daemon.registry import Registry
from gpu_watchdog.daemon.restart_hooks import RestartHooks
from gpu_watchdog.daemon.resume import resume_incidents
from gpu_watchdog.daemon.targets import RegisteredJob
from gpu_watchdog.detect.detector import DetectorState
from gpu_watchdog.detect.states import STALLED
from gpu_watchdog.errors import ConfigError, NoInputError
from gpu_watchdog.evidence.flight_recorder import dumps as fr
from gpu_watchdog.export.health import LoopHealth, Pinger
from gpu_watchdog.export.sdnotify import Notifier
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import Finding, NodeSample, Registration
from gpu_watchdog.sample.backends import Backend
from gpu_watchdog.store.db import Store
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore
from gpu_watchdog.store.job_runs import JobRuns

log = logging.getLogger("gpu_watchdog.daemon")


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
        self._owned: tuple[int, ...] = ()  # registered processes and their descendants, as of this tick
        self._stopping = threading.Event()  # set when run() ends: cuts a restart backoff short
        self._stacks_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="stacks")  # one dump per job
        watched = Watched(extra_pids=self._registered_pids, member_pool=lambda: self._owned,
                          attribute=self.registry.attribute)
        self.agent = build_agent(cfg, self.host, watched, incidents=self.incidents, fallback=self.fallback,
                                 pool=self._stacks_pool, health=self.health, heartbeats=self._heartbeats,
                                 say=self._log_info, metrics=metrics, backend=backend,
                                 runs=JobRuns.from_config(cfg, self.host))
        self.engine, self.backend, self.ctx = self.agent.engine, self.agent.backend, self.agent.ctx
        self.hooks = RestartHooks(self.ctx)
        self.acts = DaemonActs(self.ctx, self.store, self.registry, self.engine, self.hooks, self.control_dir,
                               lambda: self.settings, self._stopping)
        self.dispatcher: Dispatcher[None] = Dispatcher(lambda: self.cfg, self.acts,
                                                       supervised=lambda job_id: job_id in self.registrations(),
                                                       stop_unsupervised=lambda: self.settings.stop_unregistered)
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._ready = False
        self._status = ""
        self._scheduler: Any = None
        self._control: Any = None

    @staticmethod
    def _log_info(msg: str) -> None:
        log.info("%s", msg)

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
        run = reg.run if reg else None
        base = self.state_dir / "run" / job_id
        return ControlDir(base / f"run-{int(run)}" if run is not None else base)

    def start_reply(self, job_id: str) -> dict[str, Any]:
        """What a registration hands back to the job: its control directory and its fallback overlay — with
        ``fallback.shared_dir`` the job-wide record of its run, so every node exports the same settings."""
        reg = self.registry.get(job_id)
        run = reg.run if reg else None
        data = self.ctx.level_record(job_id, run)
        reply = {"control_dir": str(self.control_dir(job_id).path), "level": int(data.get("level", 0)),
                 "env": dict(data.get("env") or {})}
        frc = self.cfg.flight_recorder
        fr_dir = self.control_dir(job_id).path / fr.RUN_DIR_NAME
        if frc.enabled and fr_dir.is_dir():  # the TaskProlog adds what the job leaves unset (recording_env)
            reply["flight_recorder"] = {"buffer_size": frc.buffer_size, "dir": str(fr_dir)}
        return reply

    def _heartbeats(self) -> dict[str, dict[int, int]]:
        """The step heartbeats of registered jobs' in-job clients (the control dir registration hands out)."""
        return {job_id: self.control_dir(job_id).steps() for job_id in self.registry.registrations()}

    # -- registrations ---------------------------------------------------------------------------
    def registrations(self) -> dict[str, Registration]:
        return self.registry.registrations()

    def register(self, reg: Registration) -> None:
        old = self.registry.get(reg.job_id)
        self.registry.register(reg)
        if old is None or old.run != reg.run:
            self._fresh_control_dir(reg)

    def _fresh_control_dir(self, reg: Registration) -> None:
        """A clean control directory for a new run, owned by the registrant (its clients write there)."""
        control = self.control_dir(reg.job_id)
        control.create()
        uid = reg.registered_by_uid
        if uid:
            try:
                os.chown(control.path, uid, -1)
            except OSError as e:
                log.warning("job %s: cannot hand %s to uid %d: %s", reg.job_id, control.path, uid, e)
        if self.cfg.flight_recorder.enabled and fr.prepare_run_dir(control.path, uid) is None:
            log.warning("job %s: cannot prepare %s: its ranks get no Flight Recorder dump paths", reg.job_id,
                        control.path / fr.RUN_DIR_NAME)

    def unregister(self, job_id: str) -> bool:
        # The restart budget outlives the registration: a job requeued by its restart hook ends (epilog)
        # and starts again under the same id, and must not come back with a fresh budget (a restart loop).
        return self.registry.unregister(job_id)

    def job_processes(self, job_id: str) -> list[JobProcess]:
        return self.registry.job_processes(job_id, self.last_sample)

    # -- the sampling tick (apscheduler job) -----------------------------------------------------------
    def tick(self) -> None:
        self.check_control()
        tick = self.engine.tick()
        if tick.ok:
            assert tick.sample is not None
            self.dispatcher.dispatch(tick.findings, tick.sample, tick.jobs)
            self.acts.forget_unseen(tick.jobs)
        if tick.ok and not self._ready:
            self._ready = True
            self._set_status(ready=True)
        else:
            self._set_status()

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Wait for the acts in flight (tests, shutdown)."""
        self.acts.wait_idle(timeout_s)

    def check_control(self) -> None:
        """The control API is reachable (a vanished socket recreated), else /healthz says why not."""
        if self._control is not None:
            self.health.problem("control", self._control.ensure())

    # -- the control API's requests ------------------------------------------------------------------------
    def manual_restart(self, job_id: str) -> bool:
        """``restart``: checkpoint → stop → restart hook at the next fallback level."""
        status = self.state.jobs.get(job_id)
        now = time.time()
        f = Finding("restart", "requested", job_id, tuple(status.ranks) if status else (), (), now, now,
                    status.devices if status else (), "restart requested through the control API", "request")
        sample = self.last_sample or NodeSample(t=now, hostname=self.host, backend="none", devices=(), processes=(),
                                                errors=())
        return self.acts.request_restart(f, sample, status)

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
                                 signal_ranks=ranks if reg.checkpoint_opt_in else ())
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
                f"{self.acts.busy()} recovering; {self.backend.name if self.backend else '?'} backend")
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
            return self.acts.target(job_id, reg) if reg is not None else None

        return resume_incidents(self.store, self.ctx, registered)

    def housekeeping(self, now: float | None = None) -> list[str]:
        """Prune old incident directories and forget restart budgets untouched for a whole window; returns the
        removed incidents."""
        now = time.time() if now is None else now
        self.acts.forget_budgets(now - self.cfg.recovery.restart_window_s)
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
        log.info("gpu-watchdog daemon: sampling with the %s every %gs; state in %s", self.agent.backend_why,
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
            self.acts.shutdown()
            self._stacks_pool.shutdown(wait=False, cancel_futures=True)
            self.agent.close()
            self.store.close()
        return 0


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


__all__ = ["Daemon", "main_run"]
