"""Merge what each evidence source says about the culprit into one verdict (pure; the one place that decides).

Sources, in order of preference: the ranks' stacks (what every rank does now), the Flight Recorder (which rank
never entered, or entered differently, the collective its peers wait in, across every process group), and any
later source (NCCL RAS) passed as a ``SourceVerdict``. The first source that names ranks names the culprit; a
source that names nobody (stacks all alike, no dumps) cannot tell the ranks apart and lets the next one speak.
Two sources that name different ranks are reported as a disagreement; the preferred one still decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpu_watchdog.evidence.flight_recorder.analysis import FrAnalysis
from gpu_watchdog.evidence.stacks.diagnosis import Diagnosis, format_ranks

STACKS = "stacks"
FLIGHT_RECORDER = "flight_recorder"
NCCL_RAS = "nccl_ras"
SOURCE_TITLES = {STACKS: "stacks", FLIGHT_RECORDER: "flight recorder", NCCL_RAS: "NCCL RAS"}


@dataclass(frozen=True)
class SourceVerdict:
    """What one evidence source says: the ranks it names (empty: it cannot tell) and why, in one line."""

    source: str  # "stacks" | "flight_recorder" | "nccl_ras" | …
    culprit_ranks: tuple[int, ...]
    reason: str
    desync: bool = False  # the source shows the ranks issued different collectives (the culprits are the odd ones)
    inside_collective: bool = False  # every rank launched the same collectives and none completes (RAS, frozen)
    collective: str | None = None  # the collective it shows the ranks waiting in, when it knows one


@dataclass(frozen=True)
class Verdict:
    culprit_ranks: tuple[int, ...]
    evidence: str | None  # the source that named them; None when no source could
    reason: str
    disagreements: tuple[str, ...] = ()
    sources: tuple[SourceVerdict, ...] = ()


def from_stacks(diag: Diagnosis) -> SourceVerdict:
    return SourceVerdict(STACKS, tuple(diag.culprit_ranks), diag.reason)


def from_flight_recorder(fr: FrAnalysis) -> SourceVerdict:
    """Its collective: the first process group's with pending collectives; desync: a group whose ranks entered
    different collectives."""
    pending = [g for g in fr.groups if g.kind != "in_progress"]
    return SourceVerdict(FLIGHT_RECORDER, tuple(fr.culprit_ranks), fr.reason,
                         desync=any(g.kind == "mismatch" for g in pending),
                         collective=pending[0].op if pending else None)


def _title(source: str) -> str:
    return SOURCE_TITLES.get(source, source)


def merge_evidence(stacks: Diagnosis | None = None, flight_recorder: FrAnalysis | None = None,
                   *more: SourceVerdict) -> Verdict:
    """The culprit and the source that named it, from the stack diagnosis, the FR analysis and further sources
    (each optional), plus one line per pair of sources naming different ranks."""
    sources: list[SourceVerdict] = []
    if stacks is not None:
        sources.append(from_stacks(stacks))
    if flight_recorder is not None:
        sources.append(from_flight_recorder(flight_recorder))
    sources.extend(more)
    return merge_sources(sources)


def merge_sources(sources: Sequence[SourceVerdict]) -> Verdict:
    naming = [s for s in sources if s.culprit_ranks]
    disagreements = tuple(
        f"{_title(a.source)}: {format_ranks(a.culprit_ranks)}; {_title(b.source)}: {format_ranks(b.culprit_ranks)}"
        for i, a in enumerate(naming) for b in naming[i + 1:] if set(a.culprit_ranks) != set(b.culprit_ranks))
    if not naming:
        reason = "; ".join(f"{_title(s.source)}: {s.reason}" for s in sources) or "no evidence"
        return Verdict((), None, reason, (), tuple(sources))
    first = naming[0]
    reason = first.reason if first is sources[0] else f"{_title(first.source)}: {first.reason}"
    return Verdict(first.culprit_ranks, first.source, reason, disagreements, tuple(sources))
