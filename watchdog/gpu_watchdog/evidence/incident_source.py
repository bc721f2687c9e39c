"""What an evidence source does at an incident, one protocol for every source: ``act.gather`` hands each registered
source the job, the source asks what it asks (writing its own files into the incident directory), and answers
with one ``Found``: how its action went, its verdict for the merge (``evidence.culprit.merge_sources``), the line
that puts the hang in communication if it does, its section of the incident's summary and what to tell the
console. The gatherer writes the incident; a source never touches it. A new source is one module with a class
that has ``action`` and ``gather``, and one line in ``act.gather``'s registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gpu_watchdog.evidence.culprit import SourceVerdict


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
