"""``gpu-watchdog run``: the node daemon.

Wiring only (DESIGN "Suggested shape"): an apscheduler interval job samples every process with a job identity
on the node (plus registered pids) and runs the pure detector; stack dumps, recoveries, restart hooks and
checkpoint waits run in a worker pool off the sampling path, each with a timeout from config. A second job
prunes old incident directories. Signal handlers only enqueue; the main thread acts (SIGTERM/SIGINT: stop,
SIGHUP: reload; an invalid new config keeps the old one). sd_notify: READY=1 after the first good tick,
WATCHDOG=1 from a pinger gated on the sampling loop's health, STATUS= one line, STOPPING=1 on shutdown.

Jobs come from the environment of their processes (SLURM_JOB_ID, TORCHELASTIC_RUN_ID, ...) and from
registrations on the control socket (gpu_watchdog.daemon.control). Only registered jobs are stopped and restarted
(through their named restart hook); a stall in a job nobody registered is recorded with its stacks. The
daemon only ever signals processes of the job being recovered: registered pids (checked against the create
time recorded at registration), their descendants, and ranks whose environment names the job — and, for a
job registered by a non-root user, only processes of that user.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from gpu_watchdog.act.faults import drain_reason, drain_spec, drain_values, run_drain
from gpu_watchdog.act.hooks import placeholder_values, render_argv, run_hook
from gpu_watchdog.act.recovery import Recovery, RestartBudget
from gpu_watchdog.act.stopper import JobProcess, stop_processes
from gpu_watchdog.config.load import load_config
from gpu_watchdog.config.schema import Config, DaemonSettings
from gpu_watchdog.detect.consistency import CONSISTENCY_ENV, ConfigWatch
from gpu_watchdog.detect.detector import STALLED, DetectorState, Finding, JobStatus, step
from gpu_watchdog.errors import ConfigError, UsageError, WatchdogError
from gpu_watchdog.evidence.analyze import write_rank_stacks
from gpu_watchdog.evidence.collect import classify_results, collect_stack_evidence, dump_job
from gpu_watchdog.evidence.diagnosis import diagnose
from gpu_watchdog.export.sdnotify import LoopHealth, Notifier, Pinger
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import NodeSample, StackEvidence
from gpu_watchdog.policy.fallback import FallbackDecision, FallbackStore, validate_job_id
from gpu_watchdog.sample.backends import Backend, choose_backend
from gpu_watchdog.sample.xid import is_draining
from gpu_watchdog.store.db import Store
from gpu_watchdog.store.incidents import Incident, IncidentStore

log = logging.getLogger("gpu_watchdog.daemon.service")


# -- incidents mirrored into SQLite ---------------------------------------------------------------------
class StoredIncident(Incident):
    """An incident whose actions are also logged in the SQLite store, before and after they run."""

    def __init__(self, d: Path, summary: dict[str, Any], store: Store) -> None:
        super().__init__(d, summary)
        self._store = store
        self._seqs: dict[int, int] = {}

    def begin_action(self, action: str, detail: str = "") -> dict[str, Any]:
        seq = self._store.begin_action(self.id, action, detail)  # the durable record comes first
        entry = super().begin_action(action, detail)
        self._seqs[id(entry)] = seq
        return entry

    def end_action(self, entry: dict[str, Any], ok: bool, detail: str) -> None:
        super().end_action(entry, ok, detail)
        seq = self._seqs.pop(id(entry), None)
        if seq is not None:
            self._store.end_action(seq, ok, detail)


class StoredIncidentStore(IncidentStore):
    def __init__(self, state_dir: Path, store: Store) -> None:
        super().__init__(state_dir)
        self.store = store
        self._local = threading.local()

    def create(self, finding: Finding, host: str, now: float | None = None) -> Incident:
        inc = super().create(finding, host, now)
        self.store.add_incident(inc.id, finding.job_id, finding.kind, str(inc.dir))
        stored = StoredIncident(inc.dir, inc.summary, self.store)
        self._local.last = stored  # the recovery running in this thread
        return stored

    def last(self) -> StoredIncident | None:
        return getattr(self._local, "last", None)

    def open(self, incident_id: str) -> StoredIncident | None:
        try:
            inc = self.get(incident_id)
        except UsageError:
            return None
        return StoredIncident(inc.dir, inc.summary, self.store)


class StoredFallback(FallbackStore):
    """The overlay file for ``gpu-watchdog env --job`` plus a row in the SQLite store."""

    def __init__(self, state_dir: Path, store: Store) -> None:
        super().__init__(state_dir)
        self.store = store

    def save(self, job_id: str, decision: FallbackDecision, restart_env: dict[str, str],
             now: float | None = None) -> None:
        super().save(job_id, decision, restart_env, now)
        self.store.put_fallback(job_id, decision.level, decision.name, restart_env)


# -- a registered job, as Recovery sees it -------------------------------------------------------------
class JobHandle:
    """The seam Recovery stops and waits on (see recovery.job_processes): ``processes()`` and ``poll()``."""

    def __init__(self, daemon: Daemon, job_id: str) -> None:
        self.daemon = daemon
        self.job_id = job_id

    def processes(self) -> list[JobProcess]:
        return self.daemon.job_processes(self.job_id)

    def poll(self) -> int | None:
        return None if self.processes() else 0


class _JobContext:
    """What Recovery needs from its caller (the launcher has the same attributes)."""

    def __init__(self, daemon: Daemon, job_id: str, reg: dict[str, Any]) -> None:
        cfg = daemon.cfg
        if not reg.get("checkpoint_opt_in"):  # never a checkpoint signal the job did not ask for
            cfg = replace(cfg, recovery=replace(cfg.recovery, checkpoint_signal=""))
        self.cfg = cfg
        self.job_id = job_id
        self.host = daemon.host
        self.incidents = daemon.incidents
        self.fallback = daemon.fallback
        self.budget = daemon.budget(job_id)
        self.metrics = daemon.metrics
        self.backend = daemon.backend

    def say(self, msg: str) -> None:
        log.info("job %s: %s", self.job_id, msg)


# -- the daemon ------------------------------------------------------------------------------------------
class Daemon:
    def __init__(self, cfg: Config, settings: DaemonSettings, state_dir: Path, *, config_path: str | None = None,
                 overrides: dict[str, Any] | None = None, metrics: Any = None, backend: Backend | None = None,
                 notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.settings = settings
        self.state_dir = Path(state_dir)
        self.config_path = config_path
        self.overrides = dict(overrides or {})
        self.metrics = metrics
        self.host = cfg.agent.hostname or socket.gethostname()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.state_dir)
        self.incidents = StoredIncidentStore(self.state_dir, self.store)
        self.fallback = StoredFallback(self.state_dir, self.store)
        self.notifier = notifier or Notifier.from_env(unset_environment=True)
        self.health = LoopHealth(self.notifier.watchdog, max_age_s=max(10.0, 5 * cfg.agent.interval_s))
        self.backend: Backend | None = backend
        self.backend_why = "injected" if backend else ""
        self.state = DetectorState()
        self.last_sample: NodeSample | None = None
        self.ticks_ok = 0
        self.ticks_failed = 0
        self.last_error = ""
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.RLock()  # registrations, busy set, budgets
        self._jobs: dict[str, dict[str, Any]] = self.store.jobs()
        self._busy: set[str] = set()  # jobs being recovered
        self._drained: set[str] = set()  # "gpu/kind" faults whose drain hook already ran
        self._budgets: dict[str, RestartBudget] = {}
        self._config_watches: dict[str, ConfigWatch] = {}  # job → its launch-settings check (tick thread only)
        self._dumps: dict[str, Future[list[StackEvidence]]] = {}
        self._observed: set[tuple[str | None, float]] = set()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="watchdog-work")
        self._ready = False
        self._status = ""
        self._scheduler: Any = None
        self._control: Any = None
        self._stopping = threading.Event()

    # -- registrations ---------------------------------------------------------------------------
    def registrations(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self._jobs.items()}

    def register(self, reg: dict[str, Any]) -> None:
        with self._lock:
            self.store.put_job(reg["job_id"], reg["pids"], reg.get("cgroup"), reg.get("restart_hook"),
                               bool(reg.get("checkpoint_opt_in")), int(reg["registered_by_uid"]))
            self._jobs[reg["job_id"]] = dict(reg, registered_at=time.time())

    def unregister(self, job_id: str) -> bool:
        with self._lock:
            self._jobs.pop(job_id, None)
            # The restart budget outlives the registration: a job requeued by its restart hook ends (epilog)
            # and starts again under the same id, and must not come back with a fresh budget (a restart loop).
            return self.store.delete_job(job_id)

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

    def _registered_pids(self) -> dict[int, str]:
        """pid → registered job, for live registered pids (create time checked), their descendants and
        the processes of the job's cgroup."""
        from gpu_watchdog.daemon.control import cgroup_pids

        out: dict[int, str] = {}
        for job_id, reg in self.registrations().items():
            roots = []
            for rp in reg.get("pids") or []:
                try:
                    p = psutil.Process(rp["pid"])
                    if p.create_time() == rp["create_time"]:
                        roots.append(p)
                except psutil.Error:
                    continue
            if reg.get("cgroup"):
                for pid in cgroup_pids(reg["cgroup"]):
                    try:
                        roots.append(psutil.Process(pid))
                    except psutil.Error:
                        continue
            for p in roots:
                out[p.pid] = job_id
                try:
                    for c in p.children(recursive=True):
                        out[c.pid] = job_id
                except psutil.Error:
                    continue
        return out

    def job_processes(self, job_id: str) -> list[JobProcess]:
        """Every process the daemon may signal for this job: registered pids (same create time), their
        descendants, the job's cgroup, and ranks whose environment names the job; for a job registered
        by a non-root user, only that user's processes. Never the daemon itself."""
        reg = self.registrations().get(job_id)
        if reg is None:
            return []
        pids = {pid for pid, j in self._registered_pids().items() if j == job_id}
        sample = self.last_sample
        if sample is not None:
            pids |= {p.pid for p in sample.processes if p.is_rank and p.job and p.job.job_id == job_id}
        owner = int(reg.get("registered_by_uid", 0))
        out = []
        for pid in sorted(pids):
            if pid == os.getpid():
                continue
            try:
                p = psutil.Process(pid)
                if owner != 0 and p.uids().real != owner:
                    continue
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                out.append(JobProcess(pid, p.create_time()))
            except psutil.Error:
                continue
        return out

    def _attribute(self, sample: NodeSample) -> NodeSample:
        """Ranks under a registered job's pids belong to that job, whatever their environment says."""
        owned = self._registered_pids()
        if not owned:
            return sample
        # A job registered by a non-root user may not adopt other users' processes that merely claim its id
        # in their environment: those become a job of their own ("<id>@uid<uid>").
        nonroot = {j: int(r.get("registered_by_uid", 0)) for j, r in self.registrations().items()
                   if int(r.get("registered_by_uid", 0)) != 0}
        procs = []
        for p in sample.processes:
            if p.job is not None and p.pid in owned and p.job.job_id != owned[p.pid]:
                p = replace(p, job=replace(p.job, job_id=owned[p.pid]))
            elif p.job is not None and p.job.job_id in nonroot and p.pid not in owned:
                uid = _uid_of(p.pid)
                if uid != nonroot[p.job.job_id]:
                    p = replace(p, job=replace(p.job, job_id=f"{p.job.job_id}@uid{uid}"))
            procs.append(p)
        return replace(sample, processes=tuple(procs))

    # -- the sampling tick (apscheduler job) -----------------------------------------------------------
    def tick(self) -> None:
        t0 = time.process_time()
        backend = self.backend
        assert backend is not None
        try:
            sample = self._attribute(backend.sample())
        except Exception as e:  # NVML wedged/faulted, psutil hiccup: a bad tick, never a dead daemon
            self.ticks_failed += 1
            self.last_error = f"sampling failed: {e}"
            log.warning("%s", self.last_error)
            self._set_status()
            return
        try:
            pending: list[StackEvidence] = []
            for job_id, fut in list(self._dumps.items()):
                if fut.done():
                    del self._dumps[job_id]
                    try:
                        pending.extend(fut.result())
                    except Exception as e:
                        log.warning("stack dump of job %s failed: %s", job_id, e)
            self.state, findings = step(self.state, sample, self.cfg.detect, pending)
            self.last_sample = sample
            if self.cfg.stacks.enabled:
                for js in self.state.jobs.values():
                    if js.needs_stacks and js.job_id not in self._dumps:
                        self._dumps[js.job_id] = self._pool.submit(collect_stack_evidence, js, self.cfg.stacks,
                                                                   sample.t)
            for f in findings:
                self._on_finding(f, sample)
            self._check_configs(sample.t)
            if self.metrics is not None:
                self.metrics.sample_duration(time.process_time() - t0)
                self.metrics.nvml_errors(sample.errors)
                self.metrics.update(sample, self.state.jobs, {j: self.fallback.level(j) for j in self.state.jobs})
        except Exception as e:
            self.ticks_failed += 1
            self.last_error = f"tick failed: {e}"
            log.exception("tick failed")
            self._set_status()
            return
        self.ticks_ok += 1
        self.health.tick_ok(time.monotonic())
        if not self._ready:
            self._ready = True
            self._set_status(ready=True)
        else:
            self._set_status()

    def status_line(self) -> str:
        jobs = self.state.jobs
        stalled = sum(1 for j in jobs.values() if j.state == STALLED)
        line = (f"{len(jobs)} job(s) seen, {len(self.registrations())} registered, {stalled} stalled, "
                f"{len(self._busy)} recovering; {self.backend.name if self.backend else '?'} backend")
        if self.store.problem:
            line += "; STATE STORE DEGRADED"
        if self.last_error and self.ticks_failed:
            line += f"; last error: {self.last_error}"
        return line

    def _set_status(self, ready: bool = False) -> None:
        line = self.status_line()
        if ready:
            self.notifier.ready(line)
        elif line != self._status:
            self.notifier.status(line)
        self._status = line

    def _check_configs(self, t: float) -> None:
        """Every job's ranks on this node must share their launch settings (consistency.ConfigWatch): the
        digest goes to the metrics (an alert compares nodes), a new mismatch becomes an incident."""
        scanner = getattr(self.backend, "scanner", None)
        if scanner is None:
            return
        for job_id in set(self._config_watches) - set(self.state.jobs):  # the job ended
            del self._config_watches[job_id]
            if self.metrics is not None:
                self.metrics.forget_job(job_id)
        for js in self.state.jobs.values():
            watch = self._config_watches.setdefault(js.job_id, ConfigWatch())
            if not watch.due(js.rank_pids, scanner.env_of, t):
                continue
            report, finding = watch.check(js, scanner, t)
            if self.metrics is not None:
                self.metrics.job_config(js.job_id, report.digest)
            if finding is not None:
                self._pool.submit(self._guarded, None, self._report_config, finding)

    def _report_config(self, finding: Finding) -> None:
        inc = self.incidents.create(finding, self.host)
        if self.metrics is not None:
            self.metrics.incident(finding.kind)
        log.warning("job %s: %s: incident %s", finding.job_id, finding.detail, inc.id)
        self._finish(inc, "reported (ranks launched with different settings)")

    def _on_finding(self, f: Finding, sample: NodeSample) -> None:
        job_id = f.job_id
        if f.kind == "gpu_fault":
            if self.metrics is not None:
                self.metrics.gpu_fault(f.devices[0] if f.devices else "", f.signature)
            if not is_draining(f.signature):  # an application Xid: the job's own error, not the node's
                self._pool.submit(self._guarded, None, self._observe, f, None)
                return
            self._pool.submit(self._guarded, None, self._drain_node, f, sample)
            return
        regs = self.registrations()
        status = self.state.jobs.get(job_id) if job_id else None
        if job_id in regs and self.cfg.recovery.enabled:
            with self._lock:
                if job_id in self._busy:
                    return
                self._busy.add(job_id)
            self._pool.submit(self._guarded, job_id, self._recover, job_id, f, sample, status)
        else:
            key = (job_id, f.onset)
            if key in self._observed:
                return
            self._observed.add(key)
            self._pool.submit(self._guarded, None, self._observe, f, status)

    def _guarded(self, job_id: str | None, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("%s failed", getattr(fn, "__name__", fn))
        finally:
            if job_id is not None:
                with self._lock:
                    self._busy.discard(job_id)

    # -- recovery (worker pool) ------------------------------------------------------------------------
    def _recover(self, job_id: str, finding: Finding, sample: NodeSample, status: JobStatus | None) -> None:
        reg = self.registrations().get(job_id)
        if reg is None:
            return
        ctx = _JobContext(self, job_id, reg)
        handle = JobHandle(self, job_id)
        control = ControlDir(self.state_dir / "run" / job_id)
        attempt = len(ctx.budget.restarts)
        try:
            result = Recovery(ctx).handle(finding, handle, sample, status, control, attempt)  # type: ignore[arg-type]
        except Exception as e:
            inc = self.incidents.last()
            if inc is not None:
                inc.record_action("recovery", False, f"recovery failed: {e}")
                self._finish(inc, f"failed: {e}")
            raise
        inc = self.incidents.last()
        if inc is None:
            return
        if result.give_up:
            self._finish(inc, "gave up: restart budget spent (no restart hook run)")
            return
        level = self.fallback.level(job_id)
        ok = self._run_restart_hook(inc, job_id, reg.get("restart_hook"), level)
        self._finish(inc, "restart hook ran" if ok else "restart hook failed or missing")

    def _run_restart_hook(self, inc: Incident, job_id: str, hook_name: str | None, level: int) -> bool:
        spec = self.cfg.hooks.get(hook_name or "")
        if spec is None:
            why = (f"restart hook {hook_name!r} is no longer in the config" if hook_name
                   else "the job registered no restart hook")
            inc.record_action("restart_hook", False, f"not run: {why}")
            return False
        try:
            values = placeholder_values(job_id, self.host, level, inc.id)
        except UsageError as e:
            inc.record_action("restart_hook", False, f"not run: {e}")
            return False
        argv = render_argv(spec.argv, values)
        entry = inc.begin_action("restart_hook", f"{spec.name}: {' '.join(argv)} (timeout {spec.timeout_s:g}s)")
        env_file = str(self.fallback.root / f"{job_id}.json")
        res = run_hook(spec, values, extra_env={"GPU_WATCHDOG_FALLBACK_FILE": env_file})
        inc.end_action(entry, res.ok, res.detail())
        inc.update(restart_hook=res.to_json())
        if self.metrics is not None:
            self.metrics.action("restart_hook", res.ok)
        (log.info if res.ok else log.warning)("job %s: restart hook %s", job_id, res.detail())
        return res.ok

    def _finish(self, inc: Incident, outcome: str) -> None:
        inc.update(outcome=outcome, finished_at=time.time())
        self.store.finish_incident(inc.id, outcome)

    def _drain_node(self, finding: Finding, sample: NodeSample) -> None:
        """A GPU fault that a restart on this node cannot fix (once per GPU and kind): stop the registered jobs
        on that GPU, run the drain hook, then their restart hooks so the scheduler places them elsewhere. The
        fallback level is left alone: no NCCL setting helps a broken GPU."""
        key = f"{finding.devices[0] if finding.devices else ''}/{finding.signature}"
        with self._lock:
            if key in self._drained:
                return
            self._drained.add(key)
        spec = drain_spec(self.cfg.faults, self.cfg.hooks)
        inc = self.incidents.create(replace(finding, kind="gpu_fault"), self.host)
        gpu = finding.devices[0] if finding.devices else ""
        dev = next((d for d in sample.devices if d.uuid == gpu), None)
        xid = dev.fault.xid if dev is not None and dev.fault is not None else None
        inc.update(gpu=gpu, xid=xid, drain=True, fallback=None,
                   advice="GPU fault: no NCCL change helps; drain the node and run the job elsewhere")
        on_gpu = {p for d in sample.devices if d.uuid == gpu for p in d.pids}
        regs = self.registrations()
        hit = sorted({p.job.job_id for p in sample.processes if p.job and p.pid in on_gpu and p.job.job_id in regs}
                     | ({finding.job_id} & set(regs) if finding.job_id else set()))
        inc.update(jobs=hit)
        if self.cfg.recovery.enabled:
            for job_id in hit:
                procs = self.job_processes(job_id)
                entry = inc.begin_action("stop", f"job {job_id}: SIGTERM to {len(procs)} processes")
                stopped = stop_processes(procs, self.cfg.recovery.stop_grace_s)
                inc.end_action(entry, stopped.ok, stopped.detail)
        if spec is None:
            inc.record_action("drain", False, "not run: no faults.drain_hook or faults.drain_command configured")
        else:
            entry = inc.begin_action("drain", " ".join(spec.argv))
            try:
                res = run_drain(spec, drain_values(finding.job_id or "node", self.host, 0, inc.id,
                                                   drain_reason(finding.signature, xid, gpu), gpu, xid))
                inc.end_action(entry, res.ok, res.detail())
            except WatchdogError as e:
                inc.end_action(entry, False, str(e))
        if self.cfg.recovery.enabled:
            for job_id in hit:
                self._run_restart_hook(inc, job_id, regs[job_id].get("restart_hook"), self.fallback.level(job_id))
        self._finish(inc, "node drain requested" if spec is not None else "drain not configured")

    def _observe(self, finding: Finding, status: JobStatus | None) -> None:
        """A stall in a job nobody registered: evidence only; nothing is stopped or restarted."""
        inc = self.incidents.create(finding, self.host)
        if status is not None and status.rank_pids and self.cfg.stacks.enabled:
            entry = inc.begin_action("dump_stacks")
            results = dump_job(dict(status.rank_pids), self.cfg.stacks)
            for rank, res in results.items():
                write_rank_stacks(inc.dir, rank, self.host, res, job_id=finding.job_id)
            diag = diagnose(classify_results(results), None, set(finding.ranks) - set(status.rank_pids))
            inc.end_action(entry, any(r.ok for r in results.values()),
                           f"{sum(r.ok for r in results.values())}/{len(results)} ranks dumped")
            inc.update(culprit_ranks=list(diag.culprit_ranks) or list(finding.culprit_ranks),
                       collective=diag.collective, reason=diag.reason)
        if self.settings.stop_unregistered and self.cfg.recovery.enabled and finding.job_id:
            sample = self.last_sample
            procs = [JobProcess(p.pid, p.create_time) for p in (sample.processes if sample else ())
                     if p.is_rank and p.job and p.job.job_id == finding.job_id and p.pid != os.getpid()]
            entry = inc.begin_action("stop", f"daemon.stop_unregistered: SIGTERM to {len(procs)} rank(s)")
            stopped = stop_processes(procs, self.cfg.recovery.stop_grace_s)
            inc.end_action(entry, stopped.ok, stopped.detail)
            inc.record_action("observe", True, "job not registered with the daemon: stopped, no restart hook")
        else:
            inc.record_action("observe", True, "job not registered with the daemon: not stopped, no restart hook")
        log.warning("%s in unregistered job %s (%s): incident %s", finding.kind, finding.job_id, finding.detail,
                    inc.id)
        self._finish(inc, "observed (job not registered)")

    def manual_restart(self, job_id: str) -> bool:
        """The control API's ``restart``: checkpoint → stop → restart hook at the next fallback level."""
        with self._lock:
            if job_id in self._busy:
                return False
            self._busy.add(job_id)
        status = self.state.jobs.get(job_id)
        now = time.time()
        ranks = tuple(status.ranks) if status else ()
        f = Finding("restart", "requested", job_id, ranks, (), now, now, status.devices if status else (),
                    "restart requested through the control API", "request")
        sample = self.last_sample or NodeSample(t=now, hostname=self.host, backend="none", devices=(),
                                                processes=(), errors=())
        self._pool.submit(self._guarded, job_id, self._recover, job_id, f, sample, status)
        return True

    # -- crash recovery --------------------------------------------------------------------------------
    def resume(self) -> list[str]:
        """Finish incidents a killed daemon left unfinished. Rule (store.py): an interrupted restart hook
        is never re-run; interrupted idempotent steps are closed; a stop that did not complete is done
        again; a restart hook that never started runs once if the job is still registered."""
        done = []
        for row in self.store.unfinished_incidents():
            inc = self.incidents.open(row["id"])
            actions = self.store.actions(row["id"])
            hook_started = False
            for a in actions:
                if a["action"] == "restart_hook":
                    hook_started = True
                if a["finished_at"] is None:
                    note = ("interrupted by a daemon restart; not re-run (it may have taken effect)"
                            if a["action"] == "restart_hook" else "interrupted by a daemon restart")
                    self.store.end_action(a["seq"], None, f"{a['detail']}; {note}".lstrip("; "))
                    if inc is not None:
                        for e in inc.summary.get("actions", []):
                            if e.get("action") == a["action"] and e.get("ok") is None and "done_at" not in e:
                                e.update(ok=False, detail=f"{e.get('detail') or ''}; {note}".lstrip("; "),
                                         done_at=time.time(), interrupted=True)
                        inc.save()
            if inc is None:
                self.store.finish_incident(row["id"], "incident directory missing after a restart")
                continue
            gave_up = any(a["action"] == "give_up" for a in actions)
            reg = self.registrations().get(row["job_id"] or "")
            if hook_started:
                outcome = "resumed after a daemon restart: restart hook interrupted, not re-run"
            elif gave_up or row["kind"] not in ("stall", "gpu_fault", "restart") or reg is None:
                outcome = "resumed after a daemon restart: nothing left to do"
            else:
                procs = self.job_processes(row["job_id"])
                entry = inc.begin_action("stop", f"resumed: SIGTERM to {len(procs)} job processes")
                res = stop_processes(procs, self.cfg.recovery.stop_grace_s)
                inc.end_action(entry, res.ok, res.detail)
                ok = self._run_restart_hook(inc, row["job_id"], reg.get("restart_hook"),
                                            self.fallback.level(row["job_id"]))
                outcome = f"resumed after a daemon restart: restart hook {'ran' if ok else 'failed or missing'}"
            self._finish(inc, outcome)
            log.info("incident %s: %s", row["id"], outcome)
            done.append(row["id"])
        return done

    # -- housekeeping --------------------------------------------------------------------------------
    def housekeeping(self, now: float | None = None) -> list[str]:
        """Prune old incident directories and forget restart budgets untouched for a whole window; returns
        the removed incidents."""
        now = time.time() if now is None else now
        with self._lock:
            for job_id in self.store.prune_budgets(now - self.cfg.recovery.restart_window_s):
                self._budgets.pop(job_id, None)
        return self._prune_incidents(now)

    def _prune_incidents(self, now: float) -> list[str]:
        """Remove finished incident directories older than the age limit, then the oldest until the rest
        fit in the size limit. Unfinished incidents are never removed."""
        root = self.incidents.root
        if not root.is_dir():
            return []
        active = {r["id"] for r in self.store.unfinished_incidents()}
        entries = []
        for d in root.iterdir():
            if not d.is_dir() or d.name in active or d.is_symlink():
                continue
            try:
                mtime = (d / "summary.json").stat().st_mtime
            except OSError:
                mtime = d.stat().st_mtime
            entries.append((mtime, d, _du(d)))
        entries.sort()
        removed = []
        max_age = self.settings.incident_max_age_days * 86400
        budget = self.settings.incident_max_total_mb * (1 << 20)
        total = sum(e[2] for e in entries)
        for mtime, d, size in entries:
            if now - mtime > max_age or total > budget:
                shutil.rmtree(d, ignore_errors=True)
                self.store.forget_incident(d.name)
                total -= size
                removed.append(d.name)
        if removed:
            log.info("housekeeping: removed %d old incident(s)", len(removed))
        return removed

    # -- lifecycle -----------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals.put(signum)  # the main loop acts

    def reload(self) -> bool:
        self.notifier.reloading()
        try:
            cfg = load_config(self.config_path, self.overrides)
        except ConfigError as e:
            log.error("reload: keeping the old config: %s", e)
            self.notifier.ready(self.status_line())
            return False
        if cfg.daemon.control_socket != self.settings.control_socket:
            log.warning("reload: daemon.control_socket changes only on a restart")
        self.cfg, self.settings = cfg, dataclasses.replace(cfg.daemon, control_socket=self.settings.control_socket)
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
        if self.backend is None:
            self.backend, self.backend_why = choose_backend(
                self.cfg.agent.backend, root_pid=None, hostname=self.host,
                extra_pids=lambda: tuple(self._registered_pids()), env_filter=CONSISTENCY_ENV,
                faults=self.cfg.faults,
                min_window_s=self.cfg.detect.progress_min_window_s)
        log.info("gpu-watchdog daemon: sampling with the %s every %gs; state in %s", self.backend_why,
                 self.cfg.agent.interval_s, self.state_dir)
        for iid in self.resume():
            log.info("resumed incident %s", iid)
        if self.settings.control_socket:
            self._control = ControlServer(self.settings, self)
            self._control.start()
            log.info("control API on %s", self.settings.control_socket)
        pinger = Pinger(self.health, self.notifier.watchdog_interval_s).start() \
            if self.notifier.watchdog_interval_s else None
        sched = BackgroundScheduler(timezone="UTC")
        sched.add_job(self.tick, "interval", id="tick", seconds=self.cfg.agent.interval_s, coalesce=True,
                      max_instances=1, misfire_grace_time=None, next_run_time=_now_utc())
        sched.add_job(self.housekeeping, "interval", id="housekeeping",
                      seconds=self.settings.housekeeping_interval_s, coalesce=True, max_instances=1,
                      next_run_time=_now_utc())
        self._scheduler = sched
        sched.start()
        code = 0
        try:
            while True:
                try:
                    signum = self._signals.get(timeout=1.0)
                except queue.Empty:
                    continue
                if signum == signal.SIGHUP:
                    self.reload()
                    continue
                log.info("received %s: stopping", signal.Signals(signum).name)
                break
        finally:
            self.notifier.stopping("stopping")
            sched.shutdown(wait=False)
            if self._control is not None:
                self._control.stop()
            if pinger is not None:
                pinger.stop()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.backend.close()
            self.store.close()
        return code


def _uid_of(pid: int) -> int:
    try:
        return int(psutil.Process(pid).uids().real)
    except psutil.Error:
        return -1


def _now_utc() -> Any:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc)


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def validate_pids_live(pids: list[int]) -> list[dict[str, Any]]:
    """pid → {pid, create_time, uid} for live, non-zombie processes; UsageError names the first bad one."""
    out = []
    for pid in pids:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise UsageError(f"not a pid: {pid!r}")
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                raise UsageError(f"pid {pid} is not a live process")
            out.append({"pid": pid, "create_time": p.create_time(), "uid": p.uids().real})
        except psutil.NoSuchProcess:
            raise UsageError(f"pid {pid} is not a live process") from None
        except psutil.AccessDenied:
            raise UsageError(f"pid {pid}: access denied") from None
    return out


def main_run(config_path: str | None, overrides: dict[str, Any]) -> int:
    cfg = load_config(config_path, overrides)  # ConfigError → exit 78 naming the key
    from gpu_watchdog.cli.main import _start_metrics
    from gpu_watchdog.config.schema import resolve_state_dir

    metrics, server = _start_metrics(cfg)
    try:
        return Daemon(cfg, cfg.daemon, resolve_state_dir(cfg), config_path=config_path, overrides=overrides,
                      metrics=metrics).run()
    finally:
        if server is not None:
            server.stop()


__all__ = ["Daemon", "JobHandle", "main_run", "validate_job_id", "validate_pids_live"]
