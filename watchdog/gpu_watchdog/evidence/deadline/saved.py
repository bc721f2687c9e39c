"""The time a recovery saved: how much earlier than the job's own deadline the agent stopped it, times the GPUs it
held (its ranks, for a CPU job). Only against a deadline that is known (the Flight Recorder dumps the incident
collected, the in-job client's group timeouts) or PyTorch's documented default — and the record says which."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpu_watchdog.evidence.analyze import fr_dir
from gpu_watchdog.evidence.deadline import sources
from gpu_watchdog.evidence.flight_recorder.dumps import dump_files, load_traces
from gpu_watchdog.model import Deadline, NodeSample


@dataclass(frozen=True)
class TimeSavedRecord:
    """An acted-on incident's ``deadline`` section (docs/json-contract.md)."""

    deadline: Deadline
    due_at: float | None  # when the job's own timeout would have ended it (unix seconds)
    acted_at: float  # when the agent's stop ended it
    units: int  # the job's GPUs on this node, or its ranks here for a CPU job
    unit: str  # "gpu" | "rank"
    # Why no time is counted though the deadline is known ("": it is): no rank waited in a collective, so the job's
    # own timeout would never have ended this hang.
    not_counted: str = ""

    @property
    def saved_s(self) -> float | None:
        if self.due_at is None or self.not_counted:
            return None
        return max(0.0, self.due_at - self.acted_at)

    @property
    def gpu_seconds(self) -> float | None:
        return None if self.saved_s is None else self.saved_s * self.units

    def to_json(self) -> dict[str, object]:
        saved = self.saved_s
        return {**self.deadline.to_json(), "due_at": self.due_at, "acted_at": self.acted_at,
                "saved_s": None if saved is None else round(saved, 1), "units": self.units, "unit": self.unit,
                "gpu_seconds": None if saved is None else round(saved * self.units, 1),
                **({"not_counted": self.not_counted} if self.not_counted else {})}

    def line(self) -> str:
        """The console story's one line."""
        if self.not_counted:
            return f"time saved: none counted ({self.not_counted})"
        if self.saved_s is None:
            return f"time saved: not known (the job's deadline is {self.deadline.detail})"
        what = "GPU" if self.unit == "gpu" else "rank"
        return (f"time saved: stopped {self.saved_s:.0f} s before the job's own timeout would have "
                f"({self.deadline.source}: {self.deadline.timeout_s:.0f} s) — {self.saved_s * self.units / 3600:.2f} "
                f"{what}-hours on {self.units} {what}(s)")


def deadline_at_incident(incident_dir: str | Path, groups: Mapping[int, Mapping[str, object]],
                         backend: str | None) -> Deadline:
    """The job's deadline as an incident knows it: the pending collectives of the Flight Recorder dumps it
    collected, else the client's group timeouts, else the backend's default."""
    traces = load_traces(dump_files(fr_dir(incident_dir)))
    tried = ["no Flight Recorder dump with a pending collective", "no in-job client report",
             f"backend {backend or 'not known'}"]
    return sources.first_known(sources.from_flight_recorder(traces), sources.from_client(groups),
                               sources.backend_default(backend), tried=tried)


NOT_IN_COMMUNICATION = "no rank waited in a collective: the job's own timeout would never have ended this hang"


def time_saved(deadline: Deadline, onset: float, acted_at: float, job_id: str, sample: NodeSample,
               in_communication: bool = True) -> TimeSavedRecord:
    """``deadline`` against a wait that began at ``onset`` (the stall's), for the job's GPUs (or ranks) here. A hang
    with no rank in communication (``in_communication`` False) has no deadline of its own: nothing is counted."""
    pids = {p.pid for p in sample.processes if p.job is not None and p.job.job_id == job_id and p.is_rank}
    gpus = {d.uuid for d in sample.devices if not d.virtual and d.pids & pids}
    units, unit = (len(gpus), "gpu") if gpus else (len(pids), "rank")
    return TimeSavedRecord(deadline, deadline.due_at(onset), acted_at, units, unit,
                           "" if in_communication else NOT_IN_COMMUNICATION)
