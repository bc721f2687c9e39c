"""What happens after a confirmed stall: evidence → incident → checkpoint → stop → next run's settings.

Every step is logged in the incident (before and after it runs) and on the console. The restart budget
stops a job that keeps hanging: at most ``max_restarts`` per ``restart_window_s``, and at most
``max_no_progress_restarts`` runs in a row that hang again without getting past the previous hang's step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpu_watchdog.evidence.analyze import write_rank_stacks
from gpu_watchdog.atomic import note_write_error
from gpu_watchdog.config.schema import RecoveryConfig
from gpu_watchdog.detect.detector import Finding, JobStatus
from gpu_watchdog.evidence.diagnosis import Diagnosis, diagnose, format_ranks
from gpu_watchdog.evidence.collect import (
    WAITS_ON_WORKERS,
    blocked_workers,
    classify_results,
    dump_job,
    dump_workers,
    rank_workers,
)
from gpu_watchdog.policy.fallback import decide, diagnostics_env, hang_place
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import NodeSample, RankStack
from gpu_watchdog.evidence.report import render_report
from gpu_watchdog.act.stopper import JobProcess, job_tree, send_signal, stop_processes, wait_memory_released

if TYPE_CHECKING:
    import subprocess

    from gpu_watchdog.launch.launcher import Launcher

EXIT_BUDGET_SPENT = 75  # launch: the job kept hanging and the restart budget is spent (do not requeue blindly)
EXIT_GPU_FAULT = 74  # launch: a GPU of the job faulted (lost, reset required, critical Xid); run it elsewhere


class RestartBudget:
    """How many restarts a job may still get: ``max_restarts`` per ``restart_window_s``, and at most
    ``max_no_progress_restarts`` in a row that hang again without passing the step that hung before.

    ``state`` restores a saved budget (``state()``'s output) and ``on_change`` is called after every
    accounting, so the daemon can keep budgets across its own restarts and the job's requeues."""

    def __init__(self, cfg: RecoveryConfig, state: Mapping[str, Any] | None = None,
                 on_change: Callable[[RestartBudget], None] | None = None) -> None:
        self.cfg = cfg
        self.restarts: list[float] = [float(t) for t in (state or {}).get("restarts", [])]
        self.no_progress = int((state or {}).get("no_progress", 0))
        step = (state or {}).get("last_hang_step")
        self.last_hang_step: int | None = None if step is None else int(step)
        self._on_change = on_change

    def state(self) -> dict[str, Any]:
        return {"restarts": list(self.restarts), "no_progress": self.no_progress,
                "last_hang_step": self.last_hang_step}

    def allow(self, now: float, hang_step: int | None) -> tuple[bool, str]:
        """Account for one more hang; returns whether a restart is allowed and why not."""
        verdict = self._account(now, hang_step)
        if self._on_change is not None:
            self._on_change(self)
        return verdict

    def _account(self, now: float, hang_step: int | None) -> tuple[bool, str]:
        if self.last_hang_step is not None and (hang_step is None or hang_step <= self.last_hang_step):
            self.no_progress += 1
        else:
            self.no_progress = 0
        if hang_step is not None:
            self.last_hang_step = hang_step if self.last_hang_step is None else max(self.last_hang_step, hang_step)
        recent = [t for t in self.restarts if now - t < self.cfg.restart_window_s]
        if len(recent) >= self.cfg.max_restarts:
            return False, (f"{len(recent)} restarts in the last {self.cfg.restart_window_s:.0f}s "
                           f"(recovery.max_restarts = {self.cfg.max_restarts})")
        if self.no_progress >= self.cfg.max_no_progress_restarts:
            return False, (f"{self.no_progress} restarts in a row hung again without passing step "
                           f"{self.last_hang_step} (recovery.max_no_progress_restarts)")
        self.restarts.append(now)
        return True, ""


@dataclass
class RecoveryResult:
    give_up: bool
    restart_env: dict[str, str] = field(default_factory=dict)


def job_processes(job: Any) -> list[JobProcess]:
    """The seam between Recovery and whoever runs the job: the launcher passes its ``subprocess.Popen``
    (the child and its descendants), the daemon a handle with ``processes()`` (the registered and
    discovered pids of the job, each with the create time it was identified with). Both have ``poll()``:
    None while the job still runs."""
    procs = getattr(job, "processes", None)
    return list(procs()) if callable(procs) else job_tree(job.pid)


def _culprit_stack(diag: Diagnosis, stacks: list[RankStack]) -> RankStack | None:
    by_rank = {s.rank: s for s in stacks}
    return next((by_rank[r] for r in diag.culprit_ranks if r in by_rank), None)


class Recovery:
    def __init__(self, launcher: Launcher) -> None:
        self.lc = launcher
        self.cfg = launcher.cfg

    def _metric(self, name: str, *args: Any) -> None:
        if self.lc.metrics is not None:
            getattr(self.lc.metrics, name)(*args)

    def handle(self, finding: Finding, child: subprocess.Popen[bytes], sample: NodeSample,
               status: JobStatus | None, control: ControlDir, attempt: int) -> RecoveryResult:
        lc, cfg = self.lc, self.cfg
        inc = lc.incidents.create(finding, lc.host)
        self._metric("incident", finding.kind)
        self._metric("detection_latency", finding.confirmed_at - finding.onset)
        lc.say(f"{finding.kind.upper()} confirmed in job {finding.job_id} ({finding.signature}): {finding.detail}; "
              f"onset {time.strftime('%H:%M:%S', time.localtime(finding.onset))}, "
              f"confirmed after {finding.confirmed_at - finding.onset:.1f}s; incident {inc.id}")

        # Evidence: a fresh dump of every rank, kept raw in the incident.
        rank_pids = dict(status.rank_pids) if status else {}
        stacks: list[RankStack] = []
        diag = None
        if rank_pids and cfg.stacks.enabled:
            entry = inc.begin_action("dump_stacks")
            t0 = time.monotonic()
            results = dump_job(rank_pids, cfg.stacks)
            world = max((p.job.world_size or 0 for p in sample.processes
                         if p.job and p.job.job_id == lc.job_id), default=0) or None
            for rank, res in results.items():
                write_rank_stacks(inc.dir, rank, lc.host, res, world_size=world, job_id=lc.job_id)
                self._metric("pyspy_dump", res.outcome)
            stacks = classify_results(results)
            ok = sum(r.ok for r in results.values())
            inc.end_action(entry, ok > 0, f"{ok}/{len(results)} ranks dumped in {time.monotonic() - t0:.2f}s"
                           + "".join(f"; rank {r}: {res.detail}" for r, res in results.items() if not res.ok))
            missing = set(finding.ranks) - set(rank_pids)
            diag = diagnose(stacks, None, missing)
            culprits = list(diag.culprit_ranks) or list(finding.culprit_ranks)
            inc.update(culprit_ranks=culprits, collective=diag.collective, reason=diag.reason,
                       desync=diag.desync, groups=[[k, list(v)] for k, v in diag.groups])
            lc.say(f"culprit: {diag.reason}")
            culprit = _culprit_stack(diag, stacks)
            if culprit is not None:
                lc.say(f"culprit rank {culprit.rank} stack: {culprit.signature}")
        behind = self._workers(inc, diag, stacks, rank_pids) if diag else None
        self._flight_recorder(inc, sample, rank_pids)
        inc.write_report(render_report(inc.summary, stacks))

        # The next run's settings, from the evidence: a worker blocked in a collective is the real culprit.
        culprit = behind or (_culprit_stack(diag, stacks) if diag else None)
        previous = lc.fallback.load(lc.job_id)
        decision = decide(cfg.fallback, int(previous.get("level", 0)), finding.kind,
                          culprit.state if culprit else None, desync=bool(diag and diag.desync),
                          place=hang_place(culprit.state if culprit else None, culprit.where if culprit else "",
                                           finding.signature),
                          last_place=str(previous.get("hang_place") or ""))
        hang_step = max((p.heartbeat_step for p in sample.processes
                         if p.job and p.job.job_id == lc.job_id and p.heartbeat_step is not None), default=None)
        allowed, why_not = lc.budget.allow(time.time(), hang_step)

        self._checkpoint(inc, child, control, rank_pids, sample)
        self._stop(inc, child)
        if not allowed:
            inc.update(advice=decision.advice or None)  # no next run, but the advice stands
            if decision.advice:
                lc.say(f"advice: {decision.advice}")
            inc.record_action("give_up", True, f"restart budget spent: {why_not}")
            inc.write_report(render_report(inc.summary, stacks))
            lc.say(f"giving up: restart budget spent: {why_not} (exit {EXIT_BUDGET_SPENT})")
            return RecoveryResult(give_up=True)

        restart_env = dict(decision.env)
        restart_env.update(diagnostics_env(cfg.fallback, inc.dir, restart_env))
        lc.fallback.save(lc.job_id, decision, restart_env)
        inc.update(fallback={"level": decision.level, "name": decision.name, "env": decision.env,
                             "reason": decision.reason}, advice=decision.advice or None)
        lc.say(f"fallback level {decision.level}: {decision.reason}")
        if decision.advice:
            lc.say(f"advice: {decision.advice}")
        shown = " ".join(f"{k}={v}" for k, v in sorted(decision.env.items())) or "(no NCCL change)"
        stop_signal = getattr(lc, "_stop_signal", None)  # the daemon's job context has none
        if stop_signal is not None:  # SIGINT/SIGTERM arrived while we recovered: the launcher exits next
            import signal as _signal

            inc.record_action("restart", False, f"skipped: the launcher received "
                                                f"{_signal.Signals(stop_signal).name}; the next launch of "
                                                f"job {lc.job_id} starts at fallback level {decision.level}: {shown}")
            inc.write_report(render_report(inc.summary, stacks))
            return RecoveryResult(give_up=False, restart_env=restart_env)
        inc.record_action("restart", True, f"run {attempt + 1} at fallback level {decision.level} "
                                           f"({decision.name}): {shown}")
        self._metric("restart", lc.job_id)
        self._metric("action", "restart", True)
        inc.write_report(render_report(inc.summary, stacks))
        lc.say(f"restarting (run {attempt + 1}) at fallback level {decision.level} ({decision.name}): {shown}")
        return RecoveryResult(give_up=False, restart_env=restart_env)

    def _workers(self, inc: Any, diag: Diagnosis, stacks: list[RankStack],
                 rank_pids: dict[int, int]) -> RankStack | None:
        """A culprit whose main thread waits on a queue, a pipe or a poll may be waiting on its own workers (vLLM's
        generate(), Ray, multiprocessing): dump them; one blocked in a collective or a device sync is the hang
        behind the process boundary, named in the incident with its pid and stack. Returns its stack."""
        lc = self.lc
        waiting = {s.rank: rank_pids[s.rank] for s in stacks
                   if s.rank in diag.culprit_ranks and s.state in WAITS_ON_WORKERS and s.rank in rank_pids}
        owners = {rank: pid for rank, pid in waiting.items() if rank_workers(pid)}
        if not owners:
            return None
        entry = inc.begin_action("dump_workers", f"worker processes of {format_ranks(owners)}")
        workers = dump_workers(owners, self.cfg.stacks)
        for w in workers:
            write_rank_stacks(inc.dir, w.rank, lc.host, w.result, job_id=lc.job_id, worker=True)
        blocked = blocked_workers(workers)
        inc.end_action(entry, True, f"{len(workers)} worker(s) dumped, {len(blocked)} blocked in a collective "
                                    "or device sync")
        if not blocked:
            return None
        inc.update(workers=[{"rank": w.rank, "pid": w.pid, "state": w.stack.state, "op": w.stack.op,
                             "where": w.stack.where, "stack": w.stack.signature} for w in blocked])
        first = blocked[0]
        what = first.stack.op or first.stack.state
        reason = (f"{diag.reason}; rank {first.rank} waits on its worker pid {first.pid}, blocked in {what} at "
                  f"{first.stack.where}")
        inc.update(reason=reason, collective=diag.collective or first.stack.op)
        lc.say(f"culprit: {reason}")
        return first.stack

    def _flight_recorder(self, inc: Any, sample: NodeSample, rank_pids: dict[int, int]) -> None:
        from gpu_watchdog.evidence import flight_recorder as fr
        env: dict[str, str] = {}
        for pid in rank_pids.values():
            try:
                import psutil

                env = psutil.Process(pid).environ()
                break
            except Exception:
                continue
        settings = fr.fr_settings(env)
        if settings is None:
            return
        entry = inc.begin_action("flight_recorder")
        try:
            triggered = fr.trigger_dumps(settings, sorted(rank_pids))
            time.sleep(1.0 if triggered else 0.0)
            files = fr.collect_dumps(settings, inc.dir / "flight-recorder")
            inc.end_action(entry, bool(files), f"{len(files)} dump(s) collected, {len(triggered)} triggered")
        except Exception as e:  # diagnostics must never block recovery
            inc.end_action(entry, False, f"flight recorder: {e}")

    def _checkpoint(self, inc: Any, child: subprocess.Popen[bytes], control: ControlDir,
                    rank_pids: dict[int, int], sample: NodeSample) -> None:
        """Ask the job to save — only if it opted in; never a signal it did not ask for."""
        lc, rc = self.lc, self.cfg.recovery
        clients = control.clients()
        if clients:
            entry = inc.begin_action("checkpoint", f"requested from ranks {sorted(clients)}")
            try:
                control.request_checkpoint(inc.id, rc.client_boundary_s, rc.checkpoint_grace_s)
            except OSError as e:  # the request travels through the state dir: full or read-only
                note_write_error(f"the checkpoint request in {control.path}", e)
                inc.end_action(entry, False, f"could not ask the job to save: {e.strerror or e}")
                return
            deadline = time.monotonic() + rc.checkpoint_grace_s
            acks: dict[int, dict[str, Any]] = {}
            stopped = {p.job.rank for p in sample.processes if p.status == "stopped" and p.is_rank and p.job
                       and p.job.job_id == lc.job_id}  # cannot answer until continued: not waited for
            while time.monotonic() < deadline and child.poll() is None:
                acks = control.acks(inc.id)
                if set(acks) >= set(clients) - stopped:
                    break
                time.sleep(0.2)
            acks = control.acks(inc.id)
            saved = {r: a for r, a in acks.items() if a.get("outcome") in ("saved", "aborted_saved")}
            detail = ", ".join(f"rank {r}: {a.get('outcome')} at step {a.get('step')}" for r, a in sorted(acks.items()))
            missing = sorted(set(clients) - set(acks))
            if missing:
                detail += f"{'; ' if detail else ''}no answer from ranks {missing}"
            inc.end_action(entry, bool(saved), detail)
            self._metric("action", "checkpoint", bool(saved))
            lc.say(f"checkpoint: {detail}")
        elif rc.checkpoint_signal:
            import signal as _signal

            sig = getattr(_signal, rc.checkpoint_signal)
            procs = [JobProcess(p.pid, p.create_time) for p in sample.processes
                     if p.is_rank and p.job and p.job.job_id == lc.job_id and p.pid in rank_pids.values()]
            entry = inc.begin_action("checkpoint", f"{rc.checkpoint_signal} to ranks")
            sent = [p.pid for p in procs if send_signal(p, sig)]
            deadline = time.monotonic() + rc.checkpoint_grace_s
            while time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.2)
            inc.end_action(entry, bool(sent), f"{rc.checkpoint_signal} sent to pids {sent}; waited for the job")
            lc.say(f"checkpoint: sent {rc.checkpoint_signal} to {len(sent)} rank(s)")
        else:
            inc.record_action("checkpoint", True, "skipped: the job did not opt in (no in-job client, no "
                                                  "recovery.checkpoint_signal)")

    def _stop(self, inc: Any, child: subprocess.Popen[bytes]) -> None:
        lc = self.lc
        procs = job_processes(child)
        entry = inc.begin_action("stop", f"SIGTERM to {len(procs)} job processes, SIGKILL after "
                                         f"{self.cfg.recovery.stop_grace_s:.0f}s")
        res = stop_processes(procs, self.cfg.recovery.stop_grace_s, reap=child.poll)
        child.poll()
        ok = res.ok
        detail = res.detail
        reader = getattr(lc.backend, "reader", None)
        if ok and reader is not None:  # on GPUs, the memory must be free before the next run
            pids = {p.pid for p in procs}
            released = wait_memory_released(
                pids, lambda: {p.pid for d in reader.read_all()[0] for p in d.processes},
                self.cfg.recovery.memory_release_timeout_s)
            ok = released
            detail += "; GPU memory released" if released else "; GPU memory NOT released"
        inc.end_action(entry, ok, detail)
        self._metric("action", "stop", ok)
        lc.say(f"stopped the job: {detail}")

    def stop_only(self, child: subprocess.Popen[bytes]) -> None:
        res = stop_processes(job_processes(child), self.cfg.recovery.stop_grace_s, reap=child.poll)
        child.poll()
        self.lc.say(f"stopped the job: {res.detail}")
