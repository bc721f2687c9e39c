"""What the daemon does with each finding (agent.dispatch's handlers), off the sampling path in a worker pool:
recover a registered job (act.recovery, with its restart hook as its restart), drain the node for a GPU fault,
record, or observe a stall nobody registered. At most one act runs per job; a job's restart budget lives in the
store, so that neither a daemon restart nor the job's requeue resets it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from gpu_watchdog.act.faults import GpuFaultHandler
from gpu_watchdog.act.recovery import (
    BY_ENGINE,
    GAVE_UP,
    GIVEN_UP_ELSEWHERE,
    NOT_RESTARTED,
    RESTARTED,
    RESTARTED_ELSEWHERE,
    STOOD_DOWN,
    Recovery,
    observe,
)
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.agent.dispatch import record_finding
from gpu_watchdog.config.schema import DaemonSettings
from gpu_watchdog.daemon.registry import Registry
from gpu_watchdog.daemon.restart_hooks import RestartHooks
from gpu_watchdog.daemon.targets import RegisteredJob, UnregisteredRanks
from gpu_watchdog.engine.loop import Engine, count_internal_error
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import Finding, JobStatus, NodeSample, Registration
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.policy.respond import Response
from gpu_watchdog.store.db import Store

log = logging.getLogger("gpu_watchdog.daemon")

# How the daemon finishes an incident, by the recovery's outcome ({by}: the engine's restart or the deciding node).
_FINISHED = {
    GAVE_UP: "gave up: restart budget spent (no restart hook run)",
    BY_ENGINE: "restarted by the job's engine ({by})",
    STOOD_DOWN: "restarted by {by}",
    GIVEN_UP_ELSEWHERE: "given up by {by}",
    RESTARTED_ELSEWHERE: "restarted by another agent (Slurm)",
    RESTARTED: "restart hook ran",
    NOT_RESTARTED: "restart hook failed or missing",
}


class DaemonActs:
    def __init__(self, ctx: ActContext, store: Store, registry: Registry, engine: Engine, hooks: RestartHooks,
                 control_dir: Callable[[str], ControlDir], settings: Callable[[], DaemonSettings],
                 stopping: threading.Event) -> None:
        self.ctx = ctx
        self.store = store
        self.registry = registry
        self.engine = engine
        self.hooks = hooks
        self._control_dir = control_dir
        self._settings = settings
        self._stopping = stopping  # set when the daemon stops: cuts a restart backoff short
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="watchdog-work")
        self._lock = threading.RLock()  # busy set, budgets, observed
        self._busy: set[str] = set()  # jobs being acted on
        self._observed: dict[str, float] = {}  # job → onset of the stall already observed (jobs still seen only)
        self._budgets: dict[str, RestartBudget] = {}
        self._work: list[Future[None]] = []  # acts in flight (for wait_idle)

    # -- agent.dispatch's handlers (the sampling thread): each hands its act to the pool --------------------------
    def recover(self, finding: Finding, sample: NodeSample, status: JobStatus | None) -> None:
        assert finding.job_id is not None
        if self._claim(finding.job_id):
            self._submit(finding.job_id, self._recover, finding.job_id, finding, sample, status)

    def drain(self, finding: Finding, sample: NodeSample) -> None:
        self._submit(None, self._drain, finding, sample)

    def record(self, finding: Finding, sample: NodeSample) -> None:
        def warn(line: str) -> None:
            log.warning("job %s: %s", finding.job_id, line)

        self._submit(None, record_finding, self.ctx, self.ctx.cfg.hooks, finding, sample, warn)

    def observe(self, finding: Finding, sample: NodeSample, status: JobStatus | None, response: Response) -> None:
        with self._lock:  # one incident per stall, not one per tick
            if finding.job_id is not None and self._observed.get(finding.job_id) == finding.onset:
                return
            if finding.job_id is not None:
                self._observed[finding.job_id] = finding.onset
        self._submit(None, self._observe, finding, sample, status, response)

    def forget_unseen(self, seen: Iterable[str]) -> None:
        """Observed stalls of jobs no longer seen are forgotten (bounded)."""
        with self._lock:
            for job_id in set(self._observed) - set(seen):
                del self._observed[job_id]

    def request_restart(self, finding: Finding, sample: NodeSample, status: JobStatus | None) -> bool:
        """A restart asked for through the control API: False while the job is already being acted on."""
        assert finding.job_id is not None
        if not self._claim(finding.job_id):
            return False
        self._submit(finding.job_id, self._recover, finding.job_id, finding, sample, status)
        return True

    # -- the pool ---------------------------------------------------------------------------------------------
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
                count_internal_error(self.ctx.metrics, "act")
            finally:
                if job_id is not None:
                    with self._lock:
                        self._busy.discard(job_id)

        fut = self._pool.submit(guarded)
        with self._lock:
            self._work = [w for w in self._work if not w.done()] + [fut]

    def busy(self) -> int:
        """How many jobs are being acted on now."""
        with self._lock:
            return len(self._busy)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Wait for the acts in flight (tests, shutdown)."""
        with self._lock:
            work = list(self._work)
        wait(work, timeout=timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- budgets ------------------------------------------------------------------------------------------------
    def budget(self, job_id: str) -> RestartBudget:
        """The job's restart budget, kept in the store; a budget untouched for ``recovery.restart_window_s`` is
        forgotten (``forget_budgets``)."""
        with self._lock:
            b = self._budgets.get(job_id)
            if b is None or b.cfg is not self.ctx.cfg.recovery:  # first use, or the config was reloaded
                b = RestartBudget(self.ctx.cfg.recovery, self.store.budget(job_id),
                                  on_change=lambda b: self.store.put_budget(job_id, b.state()))
                self._budgets[job_id] = b
            return b

    def forget_budgets(self, untouched_since: float) -> None:
        with self._lock:
            for job_id in self.store.prune_budgets(untouched_since):
                self._budgets.pop(job_id, None)

    # -- targets --------------------------------------------------------------------------------------------------
    def target(self, job_id: str, reg: Registration) -> RegisteredJob:
        return RegisteredJob(job_id, reg, self._control_dir(job_id),
                             lambda: self.registry.job_processes(job_id, self.engine.last_sample), self.hooks)

    # -- acts (worker pool) ---------------------------------------------------------------------------------------
    def _recover(self, job_id: str, finding: Finding, sample: NodeSample, status: JobStatus | None) -> None:
        reg = self.registry.get(job_id)
        if reg is None:
            return
        hook = self._settings().give_up_hook
        before_give_up = (lambda inc, level: self.hooks.run(inc, job_id, "give_up_hook", hook, level)) if hook \
            else None
        result = Recovery(self.ctx, self.budget(job_id), before_give_up, wait=self._backoff_wait).handle(
            finding, self.target(job_id, reg), sample, status)
        if result.hold is not None:  # observed, not acted on: the job waits (Engine.hold) and is watched on
            self.engine.hold(job_id, finding.onset, result.hold.why, result.hold.on, result.hold.doing)
            return
        if result.outcome == BY_ENGINE:  # its ranks are restarted by the job's own engine: watched afresh
            self.engine.restarted_in_place(job_id)
        result.transcript.finish(_FINISHED[result.outcome].format(by=result.by))

    def _backoff_wait(self, seconds: float) -> bool:
        """The restart backoff on a worker thread, cut short when the daemon stops: False when cut."""
        return not self._stopping.wait(seconds)

    def _observe(self, finding: Finding, sample: NodeSample, status: JobStatus | None, response: Response) -> None:
        job_id = finding.job_id or ""
        target = UnregisteredRanks(job_id, self._control_dir(job_id), lambda: self.engine.last_sample) \
            if response.stop else None
        inc = observe(self.ctx, finding, status, sample, target, response.why)
        log.warning("%s in job %s (%s): %s; incident %s", finding.kind, finding.job_id, finding.detail, response.why,
                    inc.id)

    def _drain(self, finding: Finding, sample: NodeSample) -> None:
        """Stop the registered jobs on the faulted GPU, drain the node, then run their restart hooks so the
        scheduler places them elsewhere (their fallback levels unchanged: no NCCL setting helps a broken GPU)."""
        regs = self.registry.registrations()
        targets = {j: self.target(j, r) for j, r in regs.items()}
        inc, stopped = GpuFaultHandler(self.ctx, self.ctx.cfg.hooks).drain(finding, sample, targets)
        for job_id in stopped:
            self.hooks.restart(inc, job_id, regs[job_id].restart_hook, self.ctx.fallback.level(job_id),
                               regs[job_id].run)
        drained = any(a["action"] == "drain" and a["ok"] for a in inc.incident.summary["actions"])
        inc.finish("node drain requested" if drained else "drain not run")
