"""``gpu-watchdog launch -- CMD``: supervise one job on this node and recover it from stalls.

Each run: start CMD in its own session with the job's identity, control directory and fallback overlay in
its environment, under a guardian that stops it if this process dies; run the engine's tick (sample → detect,
stack dumps off the sampling path) every ``agent.interval_s``; hand each finding to ``policy.respond`` and act:
a stall goes to ``act.recovery`` (incident, checkpoint, stop, next run's settings), a GPU fault to
``act.faults`` (stop, drain, exit 74). Then start the next run, until the job exits on its own or the restart
budget is spent. Signal handlers only set a flag; the loop acts on it at a safe point.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gpu_watchdog.act.faults import GpuFaultHandler
from gpu_watchdog.act.recovery import BY_ENGINE, GAVE_UP, RESTARTED, Recovery
from gpu_watchdog.act.stopper import JobProcess, alive, job_tree, stop_processes
from gpu_watchdog.act.transcript import Transcript
from gpu_watchdog.agent.build import Watched, build_agent
from gpu_watchdog.agent.dispatch import Dispatcher, record_finding
from gpu_watchdog.config.schema import Config, HookSpec, resolve_state_dir
from gpu_watchdog.engine.loop import Engine, count_internal_error
from gpu_watchdog.errors import EXIT_BUDGET_SPENT, EXIT_GPU_FAULT, EXIT_SOFTWARE, UsageError
from gpu_watchdog.evidence.deadline.timeout_exit import timeout_exit
from gpu_watchdog.evidence.flight_recorder import dumps as fr
from gpu_watchdog.evidence.stacks.spawned_ranks import no_rank_warning
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.job.protocol import CONTROL_DIR_ENV, FALLBACK_LEVEL_ENV, RESTART_COUNT_ENV, ControlDir
from gpu_watchdog.launch.exits import (
    Exits,
    ExitWatch,
    TorchrunReport,
    ended_by_ray,
    exit_label,
    exit_sections,
    finished_work,
    first_to_exit,
    name_unranked,
    with_report,
)
from gpu_watchdog.launch.guardian import Guardian
from gpu_watchdog.launch.output import JobOutput
from gpu_watchdog.model import Finding, JobState, JobStatus, NodeSample, validate_job_id
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.policy.respond import Response
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.backends import Backend
from gpu_watchdog.sample.processes import JOB_ID_ENV, describe_exit
from gpu_watchdog.sample.unranked import Unranked
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore

log = logging.getLogger("gpu_watchdog.launcher")


@dataclass
class _Outcome:
    exit_code: int | None = None  # None: start the next run, with these settings:
    restart_env: dict[str, str] = field(default_factory=dict)
    level: int = 0  # the fallback level the next run starts at (the plan's, never read back from disk)


def resolve_command(cmd: Sequence[str]) -> list[str]:
    """CMD as given, except a bare program name that is not on PATH but sits next to the running interpreter
    (``torchrun`` of the venv gpu-watchdog runs from, when the venv is not activated): that one, by full path.
    A program that cannot be run is a UsageError (exit 64) here, before anything is started, printed or written."""
    import shutil

    out = list(cmd)
    if out and "/" not in out[0] and shutil.which(out[0]) is None:
        beside = Path(sys.executable).parent / out[0]
        if not (beside.is_file() and os.access(beside, os.X_OK)):
            raise UsageError(f"cannot start {out[0]!r}: not found on PATH nor next to this Python "
                             "(give its full path)")
        out[0] = str(beside)
    elif out and not (os.path.isfile(out[0]) and os.access(out[0], os.X_OK)) and "/" in out[0]:
        raise UsageError(f"cannot start {out[0]!r}: "
                         f"{'not an executable file' if os.path.exists(out[0]) else 'no such file'}")
    return out


class LaunchTarget:
    """The launched command as the act stage sees it (act.target.JobTarget). Its restart is the next run, which
    ``launch`` starts once the outcome reaches its loop; ``stop_signal`` says whether ``launch`` is stopping."""

    may_signal_checkpoint = True  # whoever runs ``launch`` configures recovery.checkpoint_signal for their job
    run: int | None = None  # launch numbers its own runs; job-wide run records are the daemon's (multi-node jobs)

    def __init__(self, job_id: str, child: subprocess.Popen[bytes], control: ControlDir, attempt: int,
                 stop_signal: Callable[[], int | None], say: Callable[[str], None]) -> None:
        self.job_id = job_id
        self.child = child
        self.control = control
        self.attempt = attempt
        self._stop_signal = stop_signal
        self._say = say

    def processes(self) -> list[JobProcess]:
        return job_tree(self.child.pid)

    def poll(self) -> int | None:
        return self.child.poll()

    def restart(self, inc: Transcript, level: int, shown: str) -> bool:
        """The next run starts when the loop gets the outcome; a stop signal that arrived meanwhile wins."""
        signum = self._stop_signal()
        if signum is not None:
            inc.record_action("restart", False, f"skipped: the launcher received {signal.Signals(signum).name}; "
                                                f"the next launch of job {self.job_id} starts at {shown}")
            return False
        inc.record_action("restart", True, f"run {self.attempt + 1} at {shown}")
        self._say(f"restarting (run {self.attempt + 1}) at {shown}")
        return True


class Launcher:
    def __init__(self, cfg: Config, cmd: Sequence[str], *, state_dir: Path | None = None,
                 job_id: str | None = None, out: TextIO = sys.stderr, metrics: Any = None,
                 hooks: Mapping[str, HookSpec] | None = None, health: LoopHealth | None = None,
                 backend: Backend | None = None, job_output: str = "console", job_log: Path | None = None) -> None:
        if not cmd:
            raise UsageError("launch needs a command after --")
        self.cfg = cfg
        self.cmd = resolve_command(cmd)
        self.state_dir = state_dir or resolve_state_dir(cfg)
        self.host = cfg.agent.hostname or socket.gethostname()
        self.job_id = validate_job_id(job_id or f"launch-{self.host}-{os.getpid()}-{int(time.time())}")
        self.out = out
        self.metrics = metrics
        self.health = health or LoopHealth.for_interval(cfg.agent.interval_s)
        self.incidents = IncidentStore(self.state_dir)
        self.fallback = FallbackStore(self.state_dir)
        self.budget = RestartBudget(cfg.recovery)
        self.stop_signal: int | None = None
        self.control = ControlDir(self.state_dir / "run" / self.job_id)
        self._wake = threading.Event()  # set when a stack dump finishes: feed it to the detector at once
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stacks")
        self._warned_no_rank = False
        self.agent = build_agent(cfg, self.host, Watched(root_pid=os.getpid()), incidents=self.incidents,
                                 fallback=self.fallback, pool=self._pool, health=self.health,
                                 heartbeats=lambda: {self.job_id: self.control.steps()}, say=self.say,
                                 metrics=metrics, backend=backend, on_dump_done=self._wake.set)
        self.engine, self.backend, self.ctx = self.agent.engine, self.agent.backend, self.agent.ctx
        self.hooks = hooks or {}
        self.faults = GpuFaultHandler(self.ctx, self.hooks)
        # launch.output's modes; "console" (the default): the job writes to launch's own stdout and stderr
        self.output = JobOutput(job_output, None if job_output == "console" else
                                job_log or self.state_dir / "logs" / f"{self.job_id}.log",
                                console=out if job_output == "story" else sys.stderr, note=self.say)

    def say(self, msg: str) -> None:
        try:
            print(f"gpu-watchdog: {msg}", file=self.out, flush=True)
        except (OSError, ValueError):  # stdout closed (``launch … | head``): supervising matters more than telling
            log.info("%s", msg)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum  # acted on by the loop
        self._wake.set()

    # -- runs --------------------------------------------------------------------------------------------
    def _run_marker(self, attempt: int) -> dict[str, str]:
        """The environment entries that name this run of the job: every process it starts inherits them."""
        return {JOB_ID_ENV: self.job_id, CONTROL_DIR_ENV: str(self.control.path), RESTART_COUNT_ENV: str(attempt)}

    def _start(self, attempt: int, restart_env: Mapping[str, str], level: int = 0) -> subprocess.Popen[bytes]:
        """Run ``attempt`` of the job with the next run's NCCL settings and fallback level (in its environment)."""
        env = dict(os.environ)
        env.update(restart_env)
        env.update({**self._run_marker(attempt), FALLBACK_LEVEL_ENV: str(level)})
        self.control.create()
        env.update(self._flight_recorder_env(env))
        # Ray Train keeps its runs' fault tolerance where the agent can read it (docs/ray.md); the job's own wins.
        env.update({k: v for k, v in ray_node.TRAIN_STATE_ENV.items() if k not in env})
        try:
            child = subprocess.Popen(self.cmd, env=env, start_new_session=True, **self.output.popen_kwargs())
        except OSError as e:
            hint = " (not on PATH nor next to this Python: give its full path)" if "/" not in self.cmd[0] else ""
            raise UsageError(f"cannot start {self.cmd[0]!r}: {e.strerror}{hint}") from None
        self.output.attach(child)
        return child

    def _flight_recorder_env(self, env: dict[str, str]) -> dict[str, str]:
        """``[flight_recorder]``: recording, dumps and NCCL's dump pipe in this run's own directory, for every job;
        what the job's environment already sets wins (flight_recorder.recording_env)."""
        cfg = self.cfg.flight_recorder
        if not cfg.enabled:
            return {}
        d = fr.prepare_run_dir(self.control.path)
        return fr.recording_env(env, cfg.buffer_size, d if d is not None else self.control.path / fr.RUN_DIR_NAME)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        backend, engine = self.backend, self.engine
        logged = f"; job log {self.output.log_path}" if self.output.log_path else ""
        self.say(f"job {self.job_id}: sampling with the {self.agent.backend_why}; state in {self.state_dir}{logged}")
        settings = self._stored_settings()  # the first run's: what an earlier launch of this job id left
        attempt = 0
        try:
            while True:
                if self.stop_signal is not None:  # arrived during a recovery (the job is already stopped)
                    self.say(f"received {signal.Signals(self.stop_signal).name}: not restarting the job")
                    return 128 + self.stop_signal
                child = self._start(attempt, settings.restart_env, settings.level)
                scanner = getattr(backend, "scanner", None)
                if scanner is not None:
                    scanner.root_pid = child.pid
                engine.new_run(self.job_id)
                # Stops the job if this process dies without ending the run (even SIGKILL); released only
                # when the run ended under our control, so an internal error still takes the job down with us.
                guardian = Guardian(child.pid, self.cfg.recovery.stop_grace_s, self._run_marker(attempt))
                exits = self._exits = ExitWatch()
                exits.watch_command(child.pid)
                target = self.target(child, attempt)
                try:
                    outcome = self._watch(engine, target, exits)
                except Exception as e:  # a bug while acting: never leave the job running unsupervised
                    outcome = self._internal_error(e, target)
                finally:
                    exits.close()
                guardian.release()
                self.output.finish()
                if outcome.exit_code is not None:
                    return outcome.exit_code
                settings = outcome
                attempt += 1
        finally:
            self.agent.close()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _watch(self, engine: Engine, target: LaunchTarget, exits: ExitWatch) -> _Outcome:
        dispatcher = self.dispatcher(target)
        seen: dict[int, JobProcess] = {}  # every job process sampled in this run (pid + create time)
        last_seen: JobStatus | None = None  # the job as last seen with ranks (they are gone after a crash)
        last_wait: tuple[JobStatus, float] | None = None  # ... as last seen waiting on some ranks, and when
        next_tick = started = time.monotonic()
        scanner = getattr(self.backend, "scanner", None)
        while True:
            rc = target.poll()
            if rc is not None:
                return self._exited(rc, seen.values(), exits, last_seen, target.attempt, last_wait)
            if self.stop_signal is not None:
                self.say(f"received {signal.Signals(self.stop_signal).name}: stopping the job")
                self._stop_now(target)
                return _Outcome(exit_code=128 + self.stop_signal)
            tick = engine.tick()
            if tick.ok:
                assert tick.sample is not None
                job_procs = [JobProcess(p.pid, p.create_time) for p in tick.sample.processes
                             if p.job is not None and p.job.job_id == self.job_id]
                seen.update((p.pid, p) for p in job_procs)
                exits.watch_processes(p.pid for p in job_procs)  # timed from now on, if a rank is named later
                ours = tick.jobs.get(self.job_id)
                last_seen = ours or last_seen
                if ours is not None and ours.waiting_on and ours.state in (JobState.WAITING, JobState.STALLED):
                    last_wait = (ours, tick.sample.t)
                if scanner is not None:  # the processes that may become ranks, named by what is known till then
                    exits.watch_unranked(scanner.not_yet_ranked)
                    exits.watch_ray_workers(scanner.ray_workers)
                if ours is not None:
                    exits.watch(dict(ours.rank_pids))
                elif last_seen is None:
                    self._warn_if_no_rank(time.monotonic() - started)
                outcome = dispatcher.dispatch(tick.findings, tick.sample, tick.jobs)
                if outcome is not None:
                    self._stop_leftovers(seen.values())
                    return outcome
            next_tick += self.cfg.agent.interval_s
            if self._wake.wait(max(0.0, next_tick - time.monotonic())):
                self._wake.clear()  # an early tick; the regular schedule resumes after it
                next_tick -= self.cfg.agent.interval_s

    def target(self, child: subprocess.Popen[bytes], attempt: int) -> LaunchTarget:
        """Run ``attempt`` of the job (the process ``child``) as the act stage sees it."""
        return LaunchTarget(self.job_id, child, self.control, attempt, lambda: self.stop_signal, self.say)

    def dispatcher(self, target: LaunchTarget) -> Dispatcher[_Outcome]:
        """Findings of this run to ``launch``'s handlers (agent.dispatch): only its own job is supervised."""
        return Dispatcher(lambda: self.cfg, _RunHandlers(self, target), supervised=lambda job_id: job_id == self.job_id)

    def _warn_if_no_rank(self, waited_s: float) -> None:
        """Once per launch: the job has shown no rank ``agent.no_rank_warning_s`` after its run started."""
        limit = self.cfg.agent.no_rank_warning_s
        scanner = getattr(self.backend, "scanner", None)
        if self._warned_no_rank or limit <= 0 or waited_s < limit or scanner is None:
            return
        self._warned_no_rank = True
        self.say(no_rank_warning(self.job_id, waited_s, scanner.unranked, scanner.rankless,
                                 self.engine.ranks_in_code.why))

    def _internal_error(self, e: Exception, target: LaunchTarget) -> _Outcome:
        """The agent cannot tell what state its job is in: stop it with the usual ladder, then exit 70. The
        traceback goes to the log (``-v``), the console gets one line."""
        log.debug("internal error", exc_info=True)
        count_internal_error(self.metrics, "act")
        self.say(f"internal error ({type(e).__name__}: {e}); stopping the job, launch exits {EXIT_SOFTWARE}")
        self._stop_now(target)
        return _Outcome(exit_code=EXIT_SOFTWARE)

    def _stop_now(self, target: LaunchTarget) -> None:
        """The stop ladder on the whole job, no incident: launch is ending the run itself."""
        res = stop_processes(target.processes(), self.cfg.recovery.stop_grace_s, reap=target.poll)
        target.poll()
        self.say(f"stopped the job: {res.detail}")

    # -- acting ------------------------------------------------------------------------------------------
    def gpu_fault(self, finding: Finding, sample: NodeSample, target: LaunchTarget) -> int | None:
        """A draining GPU fault (respond's "drain"): the job's processes on that GPU stop, the node drains; exit 74
        when the job was on it (it must run elsewhere), else supervise on."""
        inc, stopped = self.faults.drain(finding, sample, {self.job_id: target})
        if self.job_id not in stopped:
            inc.finish("node drained; the job does not use that GPU and is watched on")
            if self.cfg.recovery.enabled:
                self.say(f"job {self.job_id} does not use {finding.devices[0] if finding.devices else 'that GPU'}: "
                         "watching on")
            return None
        inc.record_action("exit", True, f"launch exits {EXIT_GPU_FAULT}: the job must run on another node "
                                        "(its fallback level is unchanged)")
        inc.finish(f"job stopped, node drained, launch exits {EXIT_GPU_FAULT}")
        self.say(f"giving up on this node: {inc.incident.summary.get('advice')} (exit {EXIT_GPU_FAULT})")
        return EXIT_GPU_FAULT

    def record(self, finding: Finding, sample: NodeSample) -> None:
        """An incident only (respond's "record"): an application Xid, ranks launched with different settings."""
        record_finding(self.ctx, self.hooks, finding, sample, lambda line: self.say(f"WARNING: {line}"))

    def _backoff_wait(self, seconds: float) -> bool:
        """The restart backoff, cut short by SIGINT/SIGTERM (the job is already stopped): False when cut."""
        deadline = time.monotonic() + seconds
        while self.stop_signal is None and (left := deadline - time.monotonic()) > 0:
            self.health.busy(left + 10.0)
            self._wake.wait(min(left, 1.0))
            self._wake.clear()
        return self.stop_signal is None

    def _recover(self, finding: Finding, target: LaunchTarget, sample: NodeSample,
                 status: JobStatus | None) -> _Outcome | None:
        rc = self.cfg.recovery  # the stack dump, checkpoint grace, stop ladder and GPU memory wait hold the loop
        self.health.busy(self.cfg.stacks.timeout_s + rc.checkpoint_grace_s + rc.stop_grace_s + 5.0
                         + rc.memory_release_timeout_s + 10.0)
        try:
            result = Recovery(self.ctx, self.budget, wait=self._backoff_wait).handle(finding, target, sample, status)
        finally:
            self.health.busy(None)
        if result.hold is not None:  # observed, not acted on: the job waits (Engine.hold) and is watched on
            self.engine.hold(self.job_id, finding.onset, result.hold.why, result.hold.on, result.hold.doing)
            return None
        if result.outcome == BY_ENGINE:  # the job runs on: its engine restarts the ranks that were ended
            result.transcript.finish(f"restarted by the job's engine ({result.by})")
            self.engine.new_run(self.job_id)
            self._exits.forget()
            return None
        if result.outcome == GAVE_UP:
            result.transcript.finish(f"gave up: restart budget spent; launch exits {EXIT_BUDGET_SPENT}")
            self.say(f"giving up (exit {EXIT_BUDGET_SPENT})")
            return _Outcome(exit_code=EXIT_BUDGET_SPENT)
        # launch has no job-wide runs (no other node decides): restarted here, or stopping
        result.transcript.finish(f"restarted at fallback level {result.level}" if result.outcome == RESTARTED
                               else "stopped; not restarted (launch is stopping)")
        return _Outcome(restart_env=result.restart_env, level=result.level)

    def _stored_settings(self) -> _Outcome:
        """The job's stored fallback record as the next run's settings (a first run, a restart after a crash)."""
        record = self.fallback.load(self.job_id)
        return _Outcome(restart_env=dict(record.get("env") or {}), level=int(record.get("level", 0)))

    def _exited(self, rc: int, seen: Iterable[JobProcess], exits: ExitWatch, last_seen: JobStatus | None,
                attempt: int, last_wait: tuple[JobStatus, float] | None = None) -> _Outcome:
        self.say(f"job exited with code {rc}")
        self._stop_leftovers(seen)
        code = 128 - rc if rc < 0 else rc  # killed by signal N: 128+N, as a shell
        if code != 0 and self.stop_signal is None:
            exits.close()
            self.output.finish()  # torchrun's report of its workers' ends is in the job's output: read it whole
            crashed = self._crashed(code, exits.exits, last_seen, attempt, exits.command_exited_at,
                                    self.output.torchrun_report, last_wait, exits.unranked_exits,
                                    exits.ray_ranks())
            if crashed is not None:
                return crashed
        return _Outcome(exit_code=code)

    def _crashed(self, code: int, seen: Exits, status: JobStatus | None, attempt: int,
                 command_exited_at: float | None = None, report: TorchrunReport | None = None,
                 waited: tuple[JobStatus, float] | None = None,
                 unranked: Mapping[int, tuple[float, int | None, Unranked]] | None = None,
                 ray_ranks: Mapping[int, Unranked] | None = None) -> _Outcome | None:
        """A rank died and took the job down (torchrun tears every rank down within a second): an incident naming
        the rank, how it ended, its last stack if one was taken and the peers' state; then a restart within the
        budget when ``recovery.restart_on_crash``, else None (``launch`` exits with the job's code). ``seen``: the
        exits the agent saw; ``report``: torchrun's, for the statuses torchrun reaped before the agent read them;
        ``unranked``: the exits of processes that died before their rank was known (named by what is known);
        ``ray_ranks``: the named ranks that exited and were Ray workers, as Ray's records tell after their end (a
        rank Ray ended on purpose, its driver gone, is never the failure)."""
        now = time.time()
        late = name_unranked(unranked or {}, seen, status.rank_pids if status else {})
        seen = {**seen, **{r: e for r, (e, _) in late.items()}}
        ranks = tuple(sorted(set(status.ranks_seen if status else ()) | late.keys()))
        exits = with_report(seen, report, ranks, command_exited_at or now)
        ray_ranks = ray_ranks or {}
        ray_ended = ended_by_ray(ray_ranks)
        first = first_to_exit({r: e for r, e in exits.items() if r not in ray_ended}, command_exited_at)
        if len(ranks) > 1 and set(first) >= set(ranks):
            first = ()  # every rank went at once: which one failed is not known
        how = "; ".join(f"{exit_label(r, late, ray_ranks)}: {_describe(r, exits, seen, ray_ended)}" for r in first) or \
            "no rank was seen exiting first (torchrun reaps and tears down within its monitor interval)"
        # The job's own collective timeout: the first to exit are the waiters; the rank they waited on is the cause.
        onset = min((t for t, _ in exits.values()), default=now)
        own = timeout_exit(self.output.run_text(), waited[0] if waited else None, first,
                           waited[1] if waited else None, onset)
        if own is not None:
            how = f"{own.detail()}; {how}"
        finding = Finding("rank_exited", "rank_exited", self.job_id, ranks, own.waited_on if own else first, onset,
                          now, status.devices if status else (), f"{how}; the launched command exited {code}",
                          "process")
        inc = self.ctx.open_incident(finding)
        if own is not None:
            inc.update(own_timeout=own.to_json(), collective=own.collective)
        inc.update(**exit_sections(late, self.host, {r: w for r, w in ray_ranks.items() if r in first}))
        last = status.evidence[-1] if status and status.evidence else None
        inc.update(exits={str(r): _describe(r, exits, seen, ray_ended) for r in sorted(exits)},
                   peers={str(r): status.state for r in sorted(status.ranks_seen) if r not in first} if status else {},
                   last_stacks=[{"rank": rs.rank, "state": rs.state, "where": rs.where, "stack": rs.signature}
                                for rs in last.ranks] if last else [])
        self.say(f"RANK EXITED in job {self.job_id}: {finding.detail}; incident {inc.id}")
        done = {r: d.get("step") for r, d in self.control.finished().items()}
        finished = finished_work(first, ranks, seen, done, command_exited_at, report)
        if finished is not None:
            inc.update(finished_work=finished)
        if finished is not None and self.cfg.recovery.restart_on_crash:
            inc.record_action("restart", False, f"skipped: the job had finished its work ({finished}); launch exits "
                                                f"{code}", outcome="skipped")
            inc.finish("not restarted: the job had finished its work")
            self.say(f"not restarting: the job had finished its work ({finished})")
            return None
        if not self.cfg.recovery.restart_on_crash:
            inc.record_action("restart", False, "skipped: recovery.restart_on_crash is false (a crash usually "
                                                f"comes back); launch exits {code}", outcome="skipped")
            inc.finish("not restarted")
            return None
        allowed, why_not = self.budget.allow(now, None)
        if not allowed:
            inc.record_action("give_up", True, f"restart budget spent: {why_not}")
            inc.finish("gave up: restart budget spent")
            return _Outcome(exit_code=code)
        inc.record_action("restart", True, f"run {attempt + 1} (recovery.restart_on_crash), fallback level unchanged")
        inc.finish("restarted")
        self.say(f"restarting (run {attempt + 1}) after the crash (recovery.restart_on_crash)")
        return self._stored_settings()

    def _stop_leftovers(self, procs: Iterable[JobProcess]) -> None:
        """Ranks that outlived the launched process (torchrun killed, or crashed): orphans re-parented away from
        its tree would train or hang on unsupervised. Only processes sampled as this job's, same create time."""
        left = [p for p in procs if alive(p)]
        if left:
            res = stop_processes(left, self.cfg.recovery.stop_grace_s)
            self.say(f"stopped {len(left)} job process(es) left behind by the launched command: {res.detail}")


def _describe(rank: int, exits: Exits, seen: Exits, ray_ended: Mapping[int, str]) -> str:
    """How ``rank`` ended, and whether that is torchrun's word rather than the agent's own read, or Ray's teardown."""
    text = describe_exit(exits[rank][1])
    if rank in ray_ended:
        text += f"; ended by Ray ({ray_ended[rank]})"
    return text if rank in seen and seen[rank][1] == exits[rank][1] else f"{text} (torchrun's report)"


class _RunHandlers:
    """What ``launch`` does with each finding during one run (agent.dispatch): an outcome ends the run."""

    def __init__(self, launcher: Launcher, target: LaunchTarget) -> None:
        self.launcher = launcher
        self.target = target

    def recover(self, finding: Finding, sample: NodeSample, status: JobStatus | None) -> _Outcome | None:
        return self.launcher._recover(finding, self.target, sample, status)

    def drain(self, finding: Finding, sample: NodeSample) -> _Outcome | None:
        code = self.launcher.gpu_fault(finding, sample, self.target)
        return None if code is None else _Outcome(exit_code=code)

    def record(self, finding: Finding, sample: NodeSample) -> _Outcome | None:
        self.launcher.record(finding, sample)
        return None

    def observe(self, finding: Finding, sample: NodeSample, status: JobStatus | None,
                response: Response) -> _Outcome | None:
        if finding.job_id == self.launcher.job_id:  # recovery disabled: said, not acted on
            self.launcher.say(f"{finding.kind} found ({finding.detail}); {response.why}")
        return None


__all__ = ["LaunchTarget", "Launcher", "resolve_command"]
