"""What an evidence source is, one protocol for each part of a job's life.

While the job runs or is suspect (``JobWatch``): after each tick's detector step the engine hands every registered
watch the jobs and the sample (``engine.loop.Engine.watches``); a watch asks what it asks off the tick (a Flight
Recorder dump at suspect, a RAS poll, a straggler's stack sample) and may return findings; it forgets a job that
ended or was restarted.

At an incident (``IncidentSource``): ``act.gather`` hands each registered source the job, the source asks what
it asks (writing its own files into the incident directory), and answers with one ``Found``: how its action went,
its verdict for the merge (``evidence.culprit.merge_sources``), the line that puts the hang in communication if it
does, its section of the incident's summary and what to tell the console. The gatherer emits it to the
recovery's transcript (act.transcript), whose subscribers write the incident; a source never touches it. A new
source is one package (``evidence/<source>/``) with a watch and/or an incident class, and one line in each
registry it joins (``Engine.watches``, ``act.gather.SOURCES``).

The stacks are the primary source (``evidence.stacks.incident``): their diagnosis names the culprit whenever the
ranks' stacks tell them apart, and it decides which workers to dump, so they run first, with several actions of
their own, written through an ``EvidenceLog`` (the recovery's transcript) rather than one ``Found``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gpu_watchdog.evidence.culprit import SourceVerdict
from gpu_watchdog.model import Finding, JobStatus, NodeSample


@dataclass(frozen=True)
class IncidentJob:
    """The job as a source sees it at an incident: its ranks on this node and where the incident keeps files."""

    job_id: str
    rank_pids: Mapping[int, int]
    world_size: int | None
    incident_dir: Path
    spin: bool = False  # the stall is the GPUs' NCCL spin (idle power, no traffic): a frozen count is evidence


@dataclass(frozen=True)
class Found:
    """What one source found. ``outcome``: the action's outcome when not plain ok/failed ("not_available")."""

    ok: bool
    detail: str
    outcome: str | None = None
    verdict: SourceVerdict | None = None  # None: nothing to merge (it failed, or has no verdict to give)
    communication: str = ""  # the line that says the hang is in communication ("": this source does not)
    section: Mapping[str, Any] = field(default_factory=dict)  # its keys of the incident's summary
    said: tuple[str, ...] = ()  # lines for the console


Begin = Callable[[str], None]  # a source calls it (with the action's detail) when it starts asking


class IncidentSource(Protocol):
    action: str  # the name of its action in the incident

    def gather(self, job: IncidentJob, begin: Begin) -> Found | None:
        """Ask this source about the job. None, without calling ``begin``: nothing to ask (the job does not serve
        it, it is switched off); the incident then has no action of this source at all."""
        ...


class EvidenceLog(Protocol):
    """Where a source with several actions writes them as they run (``act.transcript.Transcript``): each action
    logged before it runs and after it ends, summary keys, console lines."""

    def begin_action(self, action: str, detail: str = "") -> Any: ...

    def end_action(self, entry: Any, ok: bool, detail: str, outcome: str | None = None) -> None: ...

    def update(self, **fields: Any) -> None: ...

    def say(self, line: str) -> None: ...


class JobWatch(Protocol):
    def watch(self, jobs: Mapping[str, JobStatus], sample: NodeSample) -> list[Finding]:
        """One tick's look at the jobs (never blocking the tick); findings for the dispatcher, if any."""
        ...

    def forget(self, job_id: str) -> None:
        """The job ended or was restarted: what was kept for it goes."""
        ...

    def jobs(self) -> set[str]:
        """The jobs it keeps something for."""
        ...
