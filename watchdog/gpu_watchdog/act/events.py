"""What acting tells the agent's metrics, as typed events (``ActContext.count``), dispatched by their type
(``export.metrics.AgentMetrics.count``) rather than by a method's name in a string."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IncidentOpened:
    kind: str  # the finding's kind: "stall", "gpu_fault", …


@dataclass(frozen=True)
class StallConfirmed:
    latency_s: float  # from the onset to the confirmation


@dataclass(frozen=True)
class ActionDone:
    action: str  # "checkpoint", "stop", "restart", "observe", "drain", a hook's name
    ok: bool


@dataclass(frozen=True)
class JobRestarted:
    job_id: str


@dataclass(frozen=True)
class StacksDumped:
    outcome: str  # one rank's py-spy dump: "ok", "timeout", …


@dataclass(frozen=True)
class GpuFaulted:
    gpu: str  # its UUID
    cause: int | str  # the Xid, or the fault's kind ("gpu_lost", …)


@dataclass(frozen=True)
class TimeSaved:
    saved_s: float  # from the recovery's stop to the job's own deadline
    gpu_seconds: float  # saved_s times the job's GPUs on this node (its ranks, for a CPU job)


ActEvent = IncidentOpened | StallConfirmed | ActionDone | JobRestarted | StacksDumped | GpuFaulted | TimeSaved
