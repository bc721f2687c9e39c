"""An incident's evidence, gathered the same way for every stall: the stacks first (``evidence.stacks.incident``:
a fresh py-spy dump of every rank kept raw in the incident, the diagnosis that names the culprit, the workers of a
culprit waiting on them), then every registered source (``SOURCES``, each an ``evidence.source``: the Flight
Recorder, NCCL RAS) asked in turn, and the readable report. One verdict over the sources (``evidence.culprit``): the
stacks name the culprit when they can tell the ranks apart, else the first registered source that can; the
summary's ``culprit_evidence`` says which source named it. Everything is written through the recovery's transcript
(act.transcript): each source's actions, sections and console lines."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpu_watchdog.act.events import StacksDumped
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.act.transcript import Transcript
from gpu_watchdog.evidence.culprit import STACKS, SourceVerdict, from_stacks, merge_sources
from gpu_watchdog.evidence.flight_recorder.incident import FlightRecorderAtIncident
from gpu_watchdog.evidence.nccl_ras.incident import NcclRasAtIncident
from gpu_watchdog.evidence.nccl_ras.poll import RasPoller
from gpu_watchdog.evidence.source import Found, IncidentJob, IncidentSource
from gpu_watchdog.evidence.stacks.diagnosis import Diagnosis, communication_evidence
from gpu_watchdog.evidence.stacks.incident import StacksAtIncident
from gpu_watchdog.model import Finding, JobStatus, NodeSample, RankStack

log = logging.getLogger("gpu_watchdog.act")

# The sources asked at every incident after the stacks, in the order their verdicts are preferred: a new source is
# one module (evidence.source) and one line here.
SOURCES: tuple[Callable[[ActContext], IncidentSource], ...] = (
    lambda ctx: FlightRecorderAtIncident(ctx.fr_dumps),
    lambda ctx: NcclRasAtIncident(ctx.ras or RasPoller(lambda: ctx.cfg.ras)),
)


def stacks_source(ctx: ActContext) -> StacksAtIncident:
    """The primary source, with the other nodes' published dumps when the job's runs are shared
    (``fallback.shared_dir``): those since shortly before the onset (a waiting job is re-dumped every
    ``waiting_stack_interval_s``)."""
    return StacksAtIncident(ctx.cfg.stacks, ctx.host, ctx.runs.peer_stacks if ctx.runs is not None else None,
                            ctx.cfg.detect.waiting_stack_interval_s + 5.0)


@dataclass(frozen=True)
class Gathered:
    stacks: tuple[RankStack, ...] = ()
    diagnosis: Diagnosis | None = None
    culprit: RankStack | None = None  # the stack the hang sits in (a blocked worker's when there is one)
    # What says the hang is in communication, one line per source ("" when nothing does): acting needs it.
    communication: str = ""
    # The culprits are other nodes' ranks their own agents saw alive (polling, computing, in I/O): the job waits
    # on them, as it would on one node, rather than being hung ("" when not so).
    alive_elsewhere: str = ""
    workers: tuple[dict[str, Any], ...] = ()  # a culprit's workers blocked in a collective or device sync

    def stack_of(self, ranks: Sequence[int]) -> RankStack | None:
        """The stack of the first of ``ranks`` this node dumped (a culprit another source named)."""
        by_rank = {s.rank: s for s in self.stacks}
        return next((by_rank[r] for r in ranks if r in by_rank), None)


class EvidenceGatherer:
    def __init__(self, ctx: ActContext) -> None:
        self.ctx = ctx
        self.sources = tuple(make(ctx) for make in SOURCES)

    def gather(self, t: Transcript, finding: Finding, status: JobStatus | None, sample: NodeSample) -> Gathered:
        job_id = finding.job_id or ""
        rank_pids = dict(status.rank_pids) if status else {}
        world = max((p.job.world_size or 0 for p in sample.processes if p.job and p.job.job_id == job_id),
                    default=0) or None
        job = IncidentJob(job_id, rank_pids, world, t.dir, spin=finding.signature == "spin")
        out = self._stacks(t, finding, job, sample) if rank_pids and self.ctx.cfg.stacks.enabled else Gathered()
        diag = out.diagnosis  # the stacks' own: what they say about communication stands whoever names the culprit
        found = [f for source in self.sources if (f := self.ask(t, source, job)) is not None]
        merged = self._decide(t, finding, diag, [f.verdict for f in found if f.verdict is not None])
        if merged is not None and merged is not diag:  # the recovery acts on the merged verdict
            out = replace(out, diagnosis=merged, culprit=out.culprit or out.stack_of(merged.culprit_ranks))
        comm = communication_sources(finding, diag, out.stacks, out.workers,
                                     [f.communication for f in found if f.communication])
        t.update(communication_evidence=comm or None)
        out = replace(out, communication="; ".join(comm))
        t.report(out.stacks)
        return out

    def _stacks(self, t: Transcript, finding: Finding, job: IncidentJob, sample: NodeSample) -> Gathered:
        found = stacks_source(self.ctx).gather(job, finding, sample, t)
        for outcome in found.dumps:
            t.count(StacksDumped(outcome))
        return Gathered(found.stacks, found.diagnosis, found.culprit, alive_elsewhere=found.alive_elsewhere,
                        workers=found.workers)

    def ask(self, t: Transcript, source: IncidentSource, job: IncidentJob) -> Found | None:
        """One source asked about the job, its action, section and console lines written into the incident. None:
        the source had nothing to ask (no action), or it broke (its action says how: diagnostics never block
        recovery)."""
        entry: int | None = None

        def begin(detail: str) -> None:
            nonlocal entry
            entry = t.begin_action(source.action, detail)

        try:
            found = source.gather(job, begin)
        except Exception as e:
            log.exception("evidence source %s failed", source.action)
            if entry is not None:
                t.end_action(entry, False, f"{source.action}: {e}")
            return None
        if found is None or entry is None:
            return None
        t.end_action(entry, found.ok, found.detail, outcome=found.outcome)
        if found.section:
            t.update(**found.section)
        for line in found.said:
            t.say(line)
        return found

    def _decide(self, t: Transcript, finding: Finding, diag: Diagnosis | None,
                verdicts: Sequence[SourceVerdict]) -> Diagnosis | None:
        """One verdict over the evidence sources (``merge_sources``): the stacks decide when they tell the ranks
        apart, else the first registered source that names ranks (the Flight Recorder for NCCL ranks all
        busy-waiting in the same device sync, then NCCL RAS). Returns the diagnosis the recovery acts on: ``diag``
        itself unless another source named the culprit."""
        verdict = merge_sources([*([from_stacks(diag)] if diag is not None else []), *verdicts])
        evidence = verdict.evidence or ("detector" if finding.culprit_ranks else None)
        t.update(culprit_evidence=evidence, evidence_disagreements=list(verdict.disagreements))
        for line in verdict.disagreements:
            t.say(f"evidence disagrees: {line}")
        if verdict.evidence in (None, STACKS):
            return diag
        named = next(v for v in verdicts if v.source == verdict.evidence)
        collective = named.collective or (diag.collective if diag else None)
        desync = bool(diag and diag.desync) or named.desync
        t.update(culprit_ranks=list(verdict.culprit_ranks), reason=verdict.reason, collective=collective,
                 desync=desync)
        t.say(f"culprit: {verdict.reason}")
        return Diagnosis(verdict.culprit_ranks, collective, verdict.reason, desync, diag.groups if diag else ())


def communication_sources(finding: Finding, diag: Diagnosis | None, stacks: tuple[RankStack, ...],
                          workers: Sequence[dict[str, Any]], sources: Sequence[str] = ()) -> list[str]:
    """Every source that says the hang is in communication, one line each (empty: none does): the ranks' stacks
    (evidence.stacks.diagnosis.communication_evidence), a rank's worker blocked in a collective, the registered sources'
    lines (the Flight Recorder's pending collectives, NCCL RAS's ranks behind), the GPUs' NCCL spin (a kernel
    polling for its peers)."""
    out = []
    if diag is not None and (line := communication_evidence(diag, stacks)):
        out.append(line)
    for w in workers:
        out.append(f"worker pid {w.get('pid')} of rank {w.get('rank')} blocked in {w.get('op') or w.get('state')}")
    out.extend(sources)
    if finding.signature == "spin":
        out.append("GPUs spin at idle power with no traffic (an NCCL kernel polling for its peers)")
    return out

