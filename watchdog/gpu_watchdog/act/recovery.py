"""What happens after a confirmed stall, for ``launch`` and the daemon alike: evidence → incident → checkpoint →
stop → next run's settings → restart (the target's: a new run for ``launch``, the restart hook for the daemon).

Every step is logged in the incident (before and after it runs) and on the console. The restart budget
stops a job that keeps hanging: at most ``max_restarts`` per ``restart_window_s``, and at most
``max_no_progress_restarts`` runs in a row that hang again without getting past the previous hang's step
(that one needs the in-job client's step heartbeats).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_watchdog.act.checkpoint import request_checkpoint
from gpu_watchdog.act.engine_restart import engine_restart
from gpu_watchdog.act.events import ActionDone, JobRestarted, StallConfirmed, TimeSaved
from gpu_watchdog.act.gather import EvidenceGatherer, Gathered
from gpu_watchdog.act.steps import Phase
from gpu_watchdog.act.stopper import JobProcess, stop_processes, wait_memory_released
from gpu_watchdog.act.target import ActContext, JobTarget
from gpu_watchdog.act.transcript import Transcript
from gpu_watchdog.evidence.deadline.saved import deadline_at_incident, time_saved
from gpu_watchdog.evidence.deadline.sources import backend_of
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import FallbackSection, Finding, GivenUpBy, JobStatus, LevelRecord, NodeSample, RestartedBy
from gpu_watchdog.policy.budget import BudgetVerdict, RestartBudget
from gpu_watchdog.policy.ladder import WAITED_ADVICE, FallbackDecision, diagnostics_env
from gpu_watchdog.policy.plan import GIVE_UP, HOLD, RESTART, STAND_DOWN, Plan, StallFacts, judge
from gpu_watchdog.store.incidents import Incident
from gpu_watchdog.store.job_runs import JobRuns

# What a recovery ended in (its last step, act.steps): the one value the hosts read.
HELD, RESTARTED, NOT_RESTARTED = Phase.HELD, Phase.RESTARTED, Phase.NOT_RESTARTED
RESTARTED_ELSEWHERE, BY_ENGINE, GAVE_UP = Phase.RESTARTED_ELSEWHERE, Phase.BY_ENGINE, Phase.GAVE_UP
STOOD_DOWN, GIVEN_UP_ELSEWHERE = Phase.STOOD_DOWN, Phase.GIVEN_UP_ELSEWHERE


@dataclass(frozen=True)
class Hold:
    """Why a job is held waiting, the ranks it waits on and what they do (Engine.hold's arguments)."""

    why: str
    on: tuple[int, ...] = ()
    doing: str = ""


@dataclass
class RecoveryResult:
    transcript: Transcript  # the host finishes the incident through it (unless HELD: finished as observed)
    outcome: Phase  # one of act.steps.OUTCOMES
    restart_env: dict[str, str] = field(default_factory=dict)
    level: int = 0
    by: str = ""  # BY_ENGINE: the engine's restart; STOOD_DOWN, GIVEN_UP_ELSEWHERE: the node that decided
    hold: Hold | None = None  # HELD only

    @property
    def incident(self) -> Incident:
        return self.transcript.incident


def stall_facts(gathered: Gathered, status: JobStatus | None, on_gpus: bool = False,
                engine: str = "") -> StallFacts:
    """What the gathered evidence says, as the judgement (policy.plan) reads it; ``on_gpus``: the job's ranks use
    real GPUs (``_on_gpus``); ``engine``: the restart the job's own engine offers (act.engine_restart)."""
    culprit = gathered.culprit
    stopped = sorted({*(status.stopped if status else ()), *(s.rank for s in gathered.stacks if s.state == "stopped")})
    return StallFacts(gathered.communication, culprit.state if culprit else None, culprit.where if culprit else "",
                      bool(gathered.diagnosis and gathered.diagnosis.desync), tuple(stopped), gathered.alive_elsewhere,
                      on_gpus, engine)


def job_rank_processes(sample: NodeSample, job_id: str, rank_pids: dict[int, int]) -> list[JobProcess]:
    return [JobProcess(p.pid, p.create_time) for p in sample.processes
            if p.is_rank and p.job and p.job.job_id == job_id and p.pid in rank_pids.values()]


def _run_of(target: JobTarget) -> int | None:
    """The scheduler's run of the job (Slurm's restart count) when the target has one; launch numbers its own."""
    run = getattr(target, "run", None)
    return None if run is None else int(run)


def _decision(runs: JobRuns, job_id: str, run: int) -> LevelRecord | None:
    """The job-wide record of run ``run`` when one was decided."""
    rec = runs.get(job_id, run)
    return None if rec is None else LevelRecord.from_json(rec)


def _on_gpus(finding: Finding, sample: NodeSample) -> bool:
    """Whether the job's ranks use real GPUs (NCCL), not the proc backend's virtual devices (a CPU/gloo job)."""
    return any(not d.virtual for d in sample.devices if d.uuid in finding.devices)


class Recovery:
    def __init__(self, ctx: ActContext, budget: RestartBudget,
                 before_give_up: Callable[[Transcript, int], object] | None = None,
                 wait: Callable[[float], bool] | None = None) -> None:
        self.ctx = ctx
        self.budget = budget
        self.before_give_up = before_give_up  # runs while the job still runs (Slurm refuses to update an ended job)
        self.wait = wait or _sleep  # the restart backoff; returns False when the caller is stopping

    def handle(self, finding: Finding, target: JobTarget, sample: NodeSample,
               status: JobStatus | None) -> RecoveryResult:
        """Returns the result with its incident, which the caller finishes with the outcome in its own words
        (unless ``held``: then it is finished as observed); a recovery that raises finishes its incident as failed
        and re-raises."""
        inc = self.ctx.open_incident(finding)
        t = self.ctx.transcript(inc)
        try:
            return self._handle(t, finding, target, sample, status)
        except Exception as e:  # the incident says so; the caller's stage guard logs the traceback
            t.record_action("recovery", False, f"recovery failed: {type(e).__name__}: {e}")
            t.finish(f"failed: {e}")
            raise

    def _handle(self, t: Transcript, finding: Finding, target: JobTarget, sample: NodeSample,
                status: JobStatus | None) -> RecoveryResult:
        """Decide (policy.plan.judge: the evidence, the level record read once, the budget's verdict), then carry
        the plan out."""
        self._announce(t, finding, target)
        elsewhere = self._decided_elsewhere(target)  # a late agent: the next run is decided (its ranks dying)
        gathered = Gathered() if elsewhere is not None else EvidenceGatherer(self.ctx).gather(t, finding, status,
                                                                                           sample)
        previous = LevelRecord.from_json(self.ctx.level_record(target.job_id, _run_of(target)))
        budget = self._budget_verdict(sample, target)
        engine = engine_restart(status.rank_pids) if status and finding.kind == "stall" else ""
        plan = judge(self.ctx.cfg.fallback, finding, stall_facts(gathered, status, _on_gpus(finding, sample), engine),
                     previous, budget, elsewhere)
        if plan.action == STAND_DOWN:
            assert plan.decided_elsewhere is not None
            return self._stand_down(t, target, sample, status, plan.decided_elsewhere, gathered)
        if plan.action == HOLD:
            return self._hold_waiting(t, finding, gathered)
        t.update(action_evidence=plan.proof)
        if plan.charges_budget:
            self.budget.commit(budget)
        claimed = self._claim_next_run(t, target, plan, status)
        if claimed is not None:
            t.enter(Phase.CLAIMED)
        if claimed is not None and not claimed[0]:
            if plan.action == RESTART:
                self.budget.refund()  # the job's next run is another agent's decision: nothing spent here
            return self._stand_down(t, target, sample, status, claimed[1], gathered)
        return self._carry_out(t, plan, finding, target, sample, status, gathered,
                               claimed[1] if claimed else None)

    def _result(self, t: Transcript, outcome: Phase, restart_env: dict[str, str] | None = None, level: int = 0,
                by: str = "", hold: Hold | None = None) -> RecoveryResult:
        t.enter(outcome)
        return RecoveryResult(t, outcome, dict(restart_env or {}), level, by, hold)

    def _announce(self, t: Transcript, finding: Finding, target: JobTarget) -> None:
        t.count(StallConfirmed(finding.confirmed_at - finding.onset))
        t.say(f"{finding.kind.upper()} confirmed in job {finding.job_id} ({finding.signature}): "
              f"{finding.detail}; onset {time.strftime('%H:%M:%S', time.localtime(finding.onset))}, "
              f"confirmed after {finding.confirmed_at - finding.onset:.1f}s; incident {t.id}")
        run = _run_of(target)
        if run is not None:
            t.update(run=run)  # (job, run): every node's incident of one hang names the same run

    def _budget_verdict(self, sample: NodeSample, target: JobTarget) -> BudgetVerdict:
        """The budget's verdict on this hang, nothing charged yet: the step it hung at, and for a multi-node job the
        job-wide restart history (one budget for every node of the job)."""
        hang_step = max((p.heartbeat_step for p in sample.processes
                         if p.job and p.job.job_id == target.job_id and p.heartbeat_step is not None), default=None)
        job_wide = (self.ctx.runs.restart_times(target.job_id)
                    if self.ctx.runs is not None and _run_of(target) is not None else None)
        return self.budget.verdict(time.time(), hang_step, job_wide)

    def _carry_out(self, t: Transcript, plan: Plan, finding: Finding, target: JobTarget, sample: NodeSample,
                   status: JobStatus | None, gathered: Gathered, claimed: LevelRecord | None) -> RecoveryResult:
        """Checkpoint and stop the job, then give up or restart it as planned. The next run's settings are stored
        before the stop: a daemon killed before its restart hook resumes at this level."""
        ctx, decision = self.ctx, plan.decision
        assert decision is not None
        restart_env: dict[str, str] = {}
        if plan.action == RESTART:
            restart_env = dict(decision.env)
            restart_env.update(claimed.env if claimed is not None else
                               diagnostics_env(ctx.cfg.fallback, t.dir, restart_env))
            ctx.fallback.save(target.job_id, decision, restart_env)
            t.update(fallback=FallbackSection(decision.level, decision.name, decision.env, decision.reason).to_json())
        elif self.before_give_up is not None:
            self.before_give_up(t, decision.level)
        self._checkpoint(t, target, sample, status)
        t.enter(Phase.CHECKPOINTED)
        if plan.by_engine:
            return self._restart_by_engine(t, plan, finding, target, sample, status, gathered, restart_env)
        self._stop(t, target)
        record_time_saved(t, finding, target.control, sample, gathered)
        t.enter(Phase.STOPPED)
        t.update(advice=decision.advice or None)  # with or without a next run, the advice stands
        if plan.action == GIVE_UP:
            if decision.advice:
                t.say(f"advice: {decision.advice}")
            t.record_action("give_up", True, plan.why_not)
            t.report(gathered.stacks)
            t.say(f"giving up: {plan.why_not}")
            return self._result(t, GAVE_UP, level=decision.level)
        t.say(f"fallback level {decision.level}: {decision.reason}")
        if decision.advice:
            t.say(f"advice: {decision.advice}")
        restarted = self._restart(t, target, decision)
        t.report(gathered.stacks)
        outcome = (RESTARTED if restarted else RESTARTED_ELSEWHERE if t.noted("restarted_by")
                   else NOT_RESTARTED)
        return self._result(t, outcome, restart_env, decision.level)

    def _restart_by_engine(self, t: Transcript, plan: Plan, finding: Finding, target: JobTarget,
                           sample: NodeSample, status: JobStatus | None, gathered: Gathered,
                           restart_env: dict[str, str]) -> RecoveryResult:
        """Only the hung ranks are ended; the job's own engine (``plan.by_engine``) restarts them from its latest
        checkpoint, the driver and the cluster running on. No backoff: the engine has its own."""
        ctx, decision = self.ctx, plan.decision
        assert decision is not None
        ranks = job_rank_processes(sample, target.job_id, dict(status.rank_pids) if status else {})
        stop_job(ctx, t, target, "the hung ranks: ", procs=ranks)
        record_time_saved(t, finding, target.control, sample, gathered)
        t.enter(Phase.STOPPED)
        t.update(advice=decision.advice or None)
        if decision.advice:
            t.say(f"advice: {decision.advice}")
        t.record_action("restart", True, f"by the job's engine: {plan.by_engine}; it restarts the worker group from "
                                         "its latest checkpoint, the driver and the Ray cluster kept "
                                         f"(fallback level {decision.level} unchanged)")
        t.say(f"restart by the job's engine: {plan.by_engine}")
        t.count(JobRestarted(target.job_id))
        t.count(ActionDone("restart", True))
        t.report(gathered.stacks)
        return self._result(t, BY_ENGINE, restart_env, decision.level, by=plan.by_engine)

    def _restart(self, t: Transcript, target: JobTarget, decision: FallbackDecision) -> bool:
        """The backoff (restarts in a row are spaced), then the target's restart at the decision's level."""
        ctx = self.ctx
        delay = self.budget.backoff_s(time.time(), ctx.cfg.fallback.healthy_reset_s)
        if delay > 0:
            with t.step("backoff", f"{delay:.0f}s before the next run (restarts in a row are spaced by "
                                   "recovery.restart_backoff_s, doubling)") as step:
                t.say(f"restart backoff: waiting {delay:.0f}s before the next run")
                waited = self.wait(delay)
                step.end(waited, "waited" if waited else "cut short: the agent is stopping")
        shown = " ".join(f"{k}={v}" for k, v in sorted(decision.env.items())) or "(no NCCL change)"
        restarted = target.restart(t, decision.level, f"fallback level {decision.level} ({decision.name}): {shown}")
        if not restarted and t.noted("restarted_by"):
            self.budget.refund()  # another agent restarted the job: nothing was spent here
        if restarted:
            t.count(JobRestarted(target.job_id))
        t.count(ActionDone("restart", restarted))
        return restarted

    def _decided_elsewhere(self, target: JobTarget) -> LevelRecord | None:
        """The job-wide record of the run after the one this agent watches, when one exists already."""
        runs, run = self.ctx.runs, _run_of(target)
        return _decision(runs, target.job_id, run + 1) if runs is not None and run is not None else None

    def _claim_next_run(self, t: Transcript, target: JobTarget, plan: Plan,
                        status: JobStatus | None) -> tuple[bool, LevelRecord] | None:
        """With ``fallback.shared_dir``, decide the job's next run job-wide — a restart at the decision's level, or
        (``give_up`` says why) none: first writer wins (store.job_runs). The record carries the level's settings
        and diagnostics on the shared directory (the same path on every node). The agent of the node that runs
        global rank 0 decides at once; another node's agent first waits ``fallback.actor_grace_s`` for that
        decision. None when there is no shared directory or no run number, or it cannot be written (this node then
        acts on its own, as without one, and says so)."""
        runs, run = self.ctx.runs, _run_of(target)
        if runs is None or run is None:
            return None
        nxt = run + 1
        grace = self.ctx.cfg.fallback.actor_grace_s
        if status is not None and status.ranks and 0 not in status.ranks and grace > 0:
            rec = self._await_decision(runs, target.job_id, nxt, grace)
            if rec is not None:
                t.record_action("claim_run", True, f"run {nxt} decided by {rec.decided_by} (rank 0's "
                                                   f"node; level {rec.level})")
                return False, rec
        decision = plan.decision
        assert decision is not None
        env = dict(decision.env)
        env.update(diagnostics_env(self.ctx.cfg.fallback, runs.run_dir(target.job_id, nxt), env))
        record = {"level": decision.level, "name": decision.name, "env": env, "reason": decision.reason,
                  "advice": decision.advice, "hang_place": decision.hang_place, "incident": t.id}
        if plan.action == GIVE_UP:
            record.update(give_up=plan.why_not, level=plan.current_level)
        try:
            won, written = runs.claim(target.job_id, nxt, record)
        except OSError as e:
            t.record_action("claim_run", False, f"cannot write the job-wide record of run {nxt} in {runs.root}: "
                                                f"{e}; acting on this node's decision alone")
            return None
        rec = LevelRecord.from_json(written)
        what = "no restart" if plan.action == GIVE_UP else f"level {record['level']}"
        t.record_action("claim_run", True, f"run {nxt} decided here ({what})" if won else
                        f"run {nxt} already decided by {rec.decided_by} (level {rec.level})")
        return won, rec

    def _await_decision(self, runs: JobRuns, job_id: str, run: int, grace_s: float) -> LevelRecord | None:
        """Rank 0's node's agent decides first: wait up to ``grace_s`` for its record of run ``run``."""
        deadline = time.monotonic() + grace_s
        while True:
            rec = _decision(runs, job_id, run)
            if rec is not None or time.monotonic() >= deadline:
                return rec
            if not self.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                return _decision(runs, job_id, run)

    def _stand_down(self, t: Transcript, target: JobTarget, sample: NodeSample, status: JobStatus | None,
                    rec: LevelRecord, gathered: Gathered) -> RecoveryResult:
        """Another node's agent decided the next run (and restarts the job, or gave it up): this node's ranks of
        the old run checkpoint and stop — every node's ranks must save, only this agent reaches these — never a
        second restart, never a failed hook; the incident points at the deciding node's."""
        who, level = rec.decided_by, rec.level
        if rec.give_up:
            t.update(given_up_by=GivenUpBy(who, rec.incident, rec.give_up).to_json())
        else:
            t.update(fallback=FallbackSection(level, rec.name, rec.env, f"decided by {who}: {rec.reason}").to_json(),
                     restarted_by=RestartedBy(who, rec.incident, rec.run).to_json())
        self._checkpoint(t, target, sample, status)
        t.enter(Phase.CHECKPOINTED)
        self._stop(t, target)
        t.enter(Phase.STOPPED)
        if rec.give_up:
            t.record_action("give_up", True, f"given up by {who} (incident {rec.incident}): {rec.give_up}")
            say = f"job {target.job_id}: given up by {who}: {rec.give_up}"
        else:
            t.record_action("restart", False, f"skipped: restarted by {who} (run {rec.run} at level "
                                              f"{level}, incident {rec.incident})", outcome="skipped")
            say = f"job {target.job_id}: restarted by {who} (run {rec.run}, level {level}): standing down"
        t.report(gathered.stacks)
        t.say(say)
        return self._result(t, GIVEN_UP_ELSEWHERE if rec.give_up else STOOD_DOWN, level=level, by=who)

    def _hold_waiting(self, t: Transcript, finding: Finding, gathered: Gathered) -> RecoveryResult:
        """No proof the hang is in communication: the job is waiting (every rank asleep, polling, reading, in its
        own code). An observed incident; nothing is interrupted before ``waiting_timeout_s`` after the onset."""
        cfg = self.ctx.cfg
        diag = gathered.diagnosis
        states = ", ".join(sorted({s.state for s in gathered.stacks})) or "no stacks"
        elsewhere = gathered.alive_elsewhere
        why = (f"waiting on another node's rank(s), alive there ({elsewhere})" if elsewhere
               else f"no communication evidence (ranks: {states})")
        until = finding.onset + cfg.detect.waiting_timeout_s
        detail = (f"waiting, not hung in communication: {why}; no action before detect.waiting_timeout_s "
                  f"({cfg.detect.waiting_timeout_s:.0f}s after the onset, at "
                  f"{time.strftime('%H:%M:%S', time.localtime(until))})")
        t.update(verdict="waiting", advice=WAITED_ADVICE)
        t.record_action("observe", True, detail)
        t.report(gathered.stacks)
        t.finish("observed: waiting (no communication evidence)")
        t.say(detail)
        t.count(ActionDone("observe", True))
        return self._result(t, HELD, hold=Hold(why, tuple(diag.culprit_ranks) if diag else (),
                                                   diag.reason if diag else ""))

    def _checkpoint(self, t: Transcript, target: JobTarget, sample: NodeSample, status: JobStatus | None) -> None:
        rc = self.ctx.cfg.recovery
        rank_pids = dict(status.rank_pids) if status else {}
        # Stopped ranks (SIGSTOP) cannot answer until continued: not waited for.
        stopped = {p.job.rank for p in sample.processes if p.status == "stopped" and p.is_rank and p.job
                   and p.job.job_id == target.job_id and p.job.rank is not None}
        clients = target.control.clients()
        what = (f"requested from ranks {sorted(clients)}" if clients
                else f"{rc.checkpoint_signal} to ranks" if target.may_signal_checkpoint and rc.checkpoint_signal
                else "")
        with t.step("checkpoint", what) as step:
            res = request_checkpoint(target.control, t.id, rc, timeout_s=rc.checkpoint_grace_s,
                                     running=lambda: target.poll() is None,
                                     signal_ranks=job_rank_processes(sample, target.job_id, rank_pids)
                                     if target.may_signal_checkpoint else (), unanswerable=stopped)
            if res.how == "none":  # not asked: neither done nor failed
                step.end(False, f"skipped: {res.detail}", outcome="skipped")
                return
            step.end(res.ok, res.detail, outcome=res.outcome or None)
        t.count(ActionDone("checkpoint", res.ok))
        t.say(f"checkpoint: {res.detail}")

    def _stop(self, t: Transcript, target: JobTarget) -> None:
        stop_job(self.ctx, t, target, "")


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return True


def stop_job(ctx: ActContext, t: Transcript, target: JobTarget, why: str, *, wait_memory: bool = True,
             procs: list[JobProcess] | None = None) -> bool:
    """The stop ladder on every process of the job (``procs``: only those), then (on GPUs, ``wait_memory``) the wait
    until its memory is free: the next run needs it. Logged in the incident and counted."""
    procs = target.processes() if procs is None else procs
    if not procs and target.poll() is not None:
        t.record_action("stop", True, f"{why}the job had already exited")
        return True
    grace = ctx.cfg.recovery.stop_grace_s
    with t.step("stop", f"{why}SIGTERM to {len(procs)} job processes, SIGKILL after {grace:.0f}s") as step:
        res = stop_processes(procs, grace, reap=target.poll)
        target.poll()
        ok, detail = res.ok, res.detail
        if ok and wait_memory and ctx.gpu_pids is not None:
            released = wait_memory_released({p.pid for p in procs}, ctx.gpu_pids,
                                            ctx.cfg.recovery.memory_release_timeout_s)
            ok = released
            detail += "; GPU memory released" if released else "; GPU memory NOT released"
        step.end(ok, detail)
    t.count(ActionDone("stop", ok))
    t.say(f"stopped the job: {detail}" if not why else f"stopped {why}{detail}")
    return ok


def record_time_saved(t: Transcript, finding: Finding, control: ControlDir | None, sample: NodeSample,
                      gathered: Gathered) -> None:
    """After a stall's stop: the incident's ``deadline`` section (the job's own deadline, where it came from, how
    much earlier the stop ended the job, in GPU- or rank-seconds), one console line, the counter. Counted only for
    a hang in communication: the job's own timeout ends nothing else."""
    if finding.kind != "stall" or not finding.job_id:
        return
    deadline = deadline_at_incident(t.dir, control.groups() if control is not None else {},
                                    backend_of(finding.job_id, sample))
    in_comm = bool(gathered.communication) or finding.signature == "spin"  # the NCCL spin: a collective hangs
    rec = time_saved(deadline, finding.onset, time.time(), finding.job_id, sample, in_comm)
    t.update(deadline=rec.to_json())
    t.say(rec.line())
    if rec.saved_s is not None and rec.gpu_seconds is not None:
        t.count(TimeSaved(rec.saved_s, rec.gpu_seconds))


def observe(ctx: ActContext, finding: Finding, status: JobStatus | None, sample: NodeSample,
            stop: JobTarget | None, why: str) -> Incident:
    """A stall nobody will restart: the same evidence as a recovery; the job is stopped only when ``stop`` is
    given (``daemon.stop_unregistered``)."""
    t = ctx.transcript(ctx.open_incident(finding))
    gathered: Gathered = EvidenceGatherer(ctx).gather(t, finding, status, sample)
    if stop is not None:
        stop_job(ctx, t, stop, "")
        record_time_saved(t, finding, stop.control, sample, gathered)
    t.record_action("observe", True, why)
    t.report(gathered.stacks)
    t.finish(f"observed: {why}")
    return t.incident

