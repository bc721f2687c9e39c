"""The seam between the act stage and whoever runs a job: what recovery and GPU-fault handling need to know and
do, without knowing whether ``launch`` started the job or the daemon found it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpu_watchdog.act.events import ActEvent, IncidentOpened
from gpu_watchdog.act.stopper import JobProcess
from gpu_watchdog.act.transcript import Transcript, with_subscribers
from gpu_watchdog.config.schema import Config
from gpu_watchdog.evidence.flight_recorder.dumps import SuspectDumps
from gpu_watchdog.evidence.nccl_ras.poll import RasPoller
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import Finding
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.sample.recent import TRACE_NAME, RecentSamples
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import Incident, IncidentStore
from gpu_watchdog.store.job_runs import JobRuns

log = logging.getLogger("gpu_watchdog.act")


class JobTarget(Protocol):
    """One job as the act stage sees it. ``launch`` builds it on its Popen; the daemon on a registration. A target
    may also have ``run`` (int | None: the job-wide run number, Slurm's restart count) for job-wide run records."""

    job_id: str
    control: ControlDir  # where the in-job client listens for checkpoint requests and writes its heartbeats
    may_signal_checkpoint: bool  # whether ``recovery.checkpoint_signal`` may be sent (the job opted in)

    def processes(self) -> list[JobProcess]:
        """Every process the agent may signal for this job (each with its create time)."""
        ...

    def poll(self) -> int | None:
        """None while the job still runs."""
        ...

    def restart(self, inc: Transcript, level: int, shown: str) -> bool:
        """Start the job's next run at fallback ``level`` (``shown``: its settings, for people), or hand that to
        the scheduler; records the action in ``inc``. Returns whether a restart is under way."""
        ...


@dataclass
class ActContext:
    """What acting needs from the agent around it; the same object for every job of a daemon."""

    cfg: Config
    host: str
    incidents: IncidentStore
    fallback: FallbackStore
    metrics: Any = None
    say: Callable[[str], None] = log.info
    gpu_pids: Callable[[], set[int]] | None = None  # processes holding GPU memory (NVML); None on the proc backend
    drained: set[str] = field(default_factory=set)  # GPUs whose fault already drained the node
    ras: RasPoller | None = None  # the engine's NCCL RAS poller: an incident reuses its last poll
    recent: RecentSamples | None = None  # the engine's ring of recent samples: each incident's trace
    runs: JobRuns | None = None  # fallback.shared_dir: the job-wide run records (multi-node jobs)
    fr_dumps: SuspectDumps | None = None  # the engine's Flight Recorder dumps asked for at suspect
    # job → its latest ``deadline`` warning (incident id, due time, remedies): a crash or stall of that wait points
    # back at it.
    deadline_warnings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def count(self, event: ActEvent) -> None:
        """Count an event in the metrics; a broken metrics collector is logged, never a reason to stop acting on a
        job."""
        if self.metrics is None:
            return
        try:
            self.metrics.count(event)
        except Exception:
            log.exception("metrics: counting %s failed", type(event).__name__)

    def level_record(self, job_id: str, run: int | str | None) -> dict[str, Any]:
        """The fallback record that configures run ``run`` of the job: with ``fallback.shared_dir`` the job-wide one
        (the truth for a multi-node job: every node decides from, and exports, the same level), else — or before
        any run was decided there — this node's own store."""
        shared = self.runs.current(job_id, int(run)) if self.runs is not None and run is not None else None
        return shared if shared is not None else self.fallback.load(job_id)

    def open_incident(self, finding: Finding) -> Incident:
        """Every incident starts here, so the incidents counter counts every one written and each one carries
        the node's recent past (``trace.jsonl``)."""
        inc = self.incidents.create(finding, self.host)
        self.count(IncidentOpened(finding.kind))
        self._keep_trace(inc, finding)
        self._link_deadline_warning(inc, finding)
        return inc

    def _link_deadline_warning(self, inc: Incident, finding: Finding) -> None:
        """A ``deadline`` warning is remembered for its job; a crash or stall of that job before the warned
        deadline (plus the margin) has passed refers to it and repeats its remedy — the job died of the timeout it
        was warned about. A later one is a new story: the warning is dropped."""
        job = finding.job_id or ""
        if finding.kind == "deadline":
            f = finding.facts
            self.deadline_warnings[job] = {"incident": inc.id, "due_at": f.get("due_at"),
                                           "timeout_s": f.get("timeout_s"), "source": f.get("source"),
                                           "waiting_in": f.get("waiting_in"), "remedies": f.get("remedies") or []}
            inc.update(collective=f.get("waiting_in"))
            return
        warned = self.deadline_warnings.get(job)
        if warned is None or finding.kind not in ("rank_exited", "stall"):
            return
        due = warned.get("due_at")
        if not isinstance(due, (int, float)) or finding.onset > due + self.cfg.detect.deadline_margin_s:
            self.deadline_warnings.pop(job, None)
            return
        inc.update(deadline_warning=warned)
        remedy = "; ".join(str(r) for r in warned["remedies"][:2])
        self.say(f"job {job} ran into the deadline incident {warned['incident']} warned about (its "
                 f"{warned['waiting_in'] or 'collective'} timeout, {warned['timeout_s']:.0f} s): {remedy}")

    def transcript(self, inc: Incident) -> Transcript:
        """What acting on the incident writes to: its record, the console (``say``) and the metrics subscribed."""
        return with_subscribers(inc, self.say, self.count)

    def _keep_trace(self, inc: Incident, finding: Finding) -> None:
        if self.recent is None:
            return
        event = {"t": finding.confirmed_at, "name": "incident", "id": inc.id, "kind": finding.kind,
                 "signature": finding.signature, "onset": finding.onset}
        text = self.recent.trace(finding.confirmed_at, finding.job_id, (event,))
        if text is not None:
            inc.keep_file(TRACE_NAME, text)
            inc.update(trace=TRACE_NAME)


BudgetFor = Callable[[str], RestartBudget]
