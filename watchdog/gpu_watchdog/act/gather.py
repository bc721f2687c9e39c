"""An incident's evidence, gathered the same way for every stall: a fresh py-spy dump of every rank kept raw in
the incident, the diagnosis that names the culprit, the workers of a culprit waiting on them, then every registered
source (``SOURCES``, each an ``evidence.source``: the Flight Recorder, NCCL RAS) asked in turn, and the
readable report. One verdict over the sources (``evidence.culprit``): the stacks name the culprit when they can
tell the ranks apart, else the first registered source that can; the summary's ``culprit_evidence`` says which
source named it. The gatherer writes the incident: each source's action, section and console lines."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psutil

from gpu_watchdog.act.events import StacksDumped
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.evidence.analyze import write_rank_stacks
from gpu_watchdog.evidence.culprit import STACKS, SourceVerdict, from_stacks, merge_sources
from gpu_watchdog.evidence.flight_recorder.incident import FlightRecorderAtIncident
from gpu_watchdog.evidence.nccl_ras.incident import NcclRasAtIncident
from gpu_watchdog.evidence.nccl_ras.poll import RasPoller
from gpu_watchdog.evidence.report import render_report
from gpu_watchdog.evidence.source import Found, IncidentJob, IncidentSource
from gpu_watchdog.evidence.stacks.collect import (
    WAITS_ON_WORKERS,
    blocked_workers,
    classify_results,
    dump_job,
    dump_workers,
    pids_on_gpu,
    rank_workers,
)
from gpu_watchdog.evidence.stacks.diagnosis import Diagnosis, communication_evidence, diagnose, format_ranks
from gpu_watchdog.model import Finding, JobStatus, NodeSample, RankStack, rank_known, rank_label
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.group_members import fd_targets
from gpu_watchdog.sample.processes import command_text
from gpu_watchdog.store.incidents import Incident

log = logging.getLogger("gpu_watchdog.act")

# The sources asked at every incident after the stacks, in the order their verdicts are preferred: a new source is
# one module (evidence.source) and one line here.
SOURCES: tuple[Callable[[ActContext], IncidentSource], ...] = (
    lambda ctx: FlightRecorderAtIncident(ctx.fr_dumps),
    lambda ctx: NcclRasAtIncident(ctx.ras or RasPoller(lambda: ctx.cfg.ras)),
)


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

    def report(self, inc: Incident) -> None:
        inc.write_report(render_report(inc.summary, list(self.stacks)))


def _alive(diag: Diagnosis, remote: list[RankStack]) -> str:
    """The culprits, when every one is another node's rank that its own agent saw alive: in a wait that ends by
    itself (a poll), in I/O, or computing. On one node the detector never confirms such a job (it waits on those
    ranks); across nodes this node cannot see them progress, only their published dumps."""
    by_rank = {rs.rank: rs for rs in remote}
    culprits = [by_rank.get(r) for r in diag.culprit_ranks]
    if not culprits or any(rs is None or not (rs.timed or rs.state == "io" or (rs.state == "compute" and rs.active))
                           for rs in culprits):
        return ""
    return ", ".join(f"{rank_label(rs.rank)}: {rs.state} at {rs.where}" for rs in culprits if rs is not None)


def _culprit_stack(diag: Diagnosis, stacks: list[RankStack]) -> RankStack | None:
    by_rank = {s.rank: s for s in stacks}
    return next((by_rank[r] for r in diag.culprit_ranks if r in by_rank), None)


class EvidenceGatherer:
    def __init__(self, ctx: ActContext) -> None:
        self.ctx = ctx
        self.sources = tuple(make(ctx) for make in SOURCES)

    def gather(self, inc: Incident, finding: Finding, status: JobStatus | None, sample: NodeSample) -> Gathered:
        job_id = finding.job_id or ""
        rank_pids = dict(status.rank_pids) if status else {}
        world = max((p.job.world_size or 0 for p in sample.processes if p.job and p.job.job_id == job_id),
                    default=0) or None
        job = IncidentJob(job_id, rank_pids, world, inc.dir, spin=finding.signature == "spin")
        out = self._stacks(inc, finding, job, sample) if rank_pids and self.ctx.cfg.stacks.enabled else Gathered()
        diag = out.diagnosis  # the stacks' own: what they say about communication stands whoever names the culprit
        found = [f for source in self.sources if (f := self.ask(inc, source, job)) is not None]
        merged = self._decide(inc, finding, diag, [f.verdict for f in found if f.verdict is not None])
        if merged is not None and merged is not diag:  # the recovery acts on the merged verdict
            out = replace(out, diagnosis=merged, culprit=out.culprit or _culprit_stack(merged, list(out.stacks)))
        comm = communication_sources(finding, diag, out.stacks, inc.summary.get("workers") or [],
                                     [f.communication for f in found if f.communication])
        inc.update(communication_evidence=comm or None)
        out = replace(out, communication="; ".join(comm))
        out.report(inc)
        return out

    def _stacks(self, inc: Incident, finding: Finding, job: IncidentJob, sample: NodeSample) -> Gathered:
        """A fresh dump of every rank (kept raw in the incident), the diagnosis over them and the other nodes'
        published ones, what names each rank, and the workers a culprit waits on."""
        ctx, rank_pids = self.ctx, dict(job.rank_pids)
        entry = inc.begin_action("dump_stacks")
        t0 = time.monotonic()
        results = dump_job(rank_pids, ctx.cfg.stacks, pids_on_gpu(sample, rank_pids.values()))
        for rank, res in results.items():
            write_rank_stacks(inc.dir, rank, ctx.host, res, world_size=job.world_size, job_id=job.job_id)
            ctx.count(StacksDumped(res.outcome))
        stacks = classify_results(results)
        ok = sum(r.ok for r in results.values())
        inc.end_action(entry, ok > 0, f"{ok}/{len(results)} ranks dumped in {time.monotonic() - t0:.2f}s"
                       + "".join(f"; {rank_label(r)}: {res.detail}" for r, res in results.items() if not res.ok))
        missing = set(finding.ranks) - set(rank_pids)
        elsewhere = set(range(job.world_size or 0)) - set(rank_pids) - missing  # other nodes' ranks
        diag = diagnose(stacks, None, missing, elsewhere)
        remote = self._remote_stacks(inc, finding, diag, stacks, job.job_id)
        if remote:  # the other nodes' ranks, from their agents' dumps: the culprit named from any node
            diag = diagnose([*stacks, *remote], None, missing, elsewhere)
        inc.update(culprit_ranks=list(diag.culprit_ranks) or list(finding.culprit_ranks),
                   collective=diag.collective, reason=diag.reason, desync=diag.desync,
                   groups=[[k, list(v)] for k, v in diag.groups])
        ctx.say(f"culprit: {diag.reason}")
        culprit = _culprit_stack(diag, [*stacks, *remote])
        if culprit is not None:
            ctx.say(f"culprit {rank_label(culprit.rank)} stack: {culprit.signature}")
        self._identities(inc, diag, rank_pids)
        behind = self._workers(inc, diag, stacks, rank_pids, job.job_id)
        return Gathered(tuple(stacks), diag, behind or culprit, alive_elsewhere=_alive(diag, remote))

    def _remote_stacks(self, inc: Incident, finding: Finding, diag: Diagnosis, stacks: list[RankStack],
                       job_id: str) -> list[RankStack]:
        """With ``fallback.shared_dir``: the job's other ranks as their own nodes' agents last dumped them (since
        shortly before the onset; a waiting job is re-dumped every ``waiting_stack_interval_s``). When every local
        rank waits alike and no other node has published yet, its agent gets PEER_WAIT_S to do so. Remote ranks
        are named only from their own node's evidence, never because this node cannot see them."""
        runs = self.ctx.runs
        if runs is None or not stacks:
            return []
        since = finding.onset - self.ctx.cfg.detect.waiting_stack_interval_s - 5.0
        peers = runs.peer_stacks(job_id, since)
        deadline = time.monotonic() + (PEER_WAIT_S if not diag.culprit_ranks else 0.0)
        while not peers and time.monotonic() < deadline:
            time.sleep(0.5)
            peers = runs.peer_stacks(job_id, since)
        local = {s.rank for s in stacks}
        newest: dict[int, tuple[float, RankStack]] = {}
        for ev in peers.values():
            for rs in ev.ranks:
                if rs.rank not in local and (rs.rank not in newest or ev.t > newest[rs.rank][0]):
                    newest[rs.rank] = (ev.t, rs)
        if newest:
            inc.update(remote_stacks={host: sorted(rs.rank for rs in ev.ranks if rs.rank not in local)
                                      for host, ev in sorted(peers.items())})
        return [rs for _, (_, rs) in sorted(newest.items())]

    def ask(self, inc: Incident, source: IncidentSource, job: IncidentJob) -> Found | None:
        """One source asked about the job, its action, section and console lines written into the incident. None:
        the source had nothing to ask (no action), or it broke (its action says how: diagnostics never block
        recovery)."""
        entry: dict[str, Any] | None = None

        def begin(detail: str) -> None:
            nonlocal entry
            entry = inc.begin_action(source.action, detail)

        try:
            found = source.gather(job, begin)
        except Exception as e:
            log.exception("evidence source %s failed", source.action)
            if entry is not None:
                inc.end_action(entry, False, f"{source.action}: {e}")
            return None
        if found is None or entry is None:
            return None
        inc.end_action(entry, found.ok, found.detail, outcome=found.outcome)
        if found.section:
            inc.update(**found.section)
        for line in found.said:
            self.ctx.say(line)
        return found

    def _decide(self, inc: Incident, finding: Finding, diag: Diagnosis | None,
                verdicts: Sequence[SourceVerdict]) -> Diagnosis | None:
        """One verdict over the evidence sources (``merge_sources``): the stacks decide when they tell the ranks
        apart, else the first registered source that names ranks (the Flight Recorder for NCCL ranks all
        busy-waiting in the same device sync, then NCCL RAS). Returns the diagnosis the recovery acts on: ``diag``
        itself unless another source named the culprit."""
        verdict = merge_sources([*([from_stacks(diag)] if diag is not None else []), *verdicts])
        evidence = verdict.evidence or ("detector" if finding.culprit_ranks else None)
        inc.update(culprit_evidence=evidence, evidence_disagreements=list(verdict.disagreements))
        for line in verdict.disagreements:
            self.ctx.say(f"evidence disagrees: {line}")
        if verdict.evidence in (None, STACKS):
            return diag
        named = next(v for v in verdicts if v.source == verdict.evidence)
        collective = named.collective or (diag.collective if diag else None)
        desync = bool(diag and diag.desync) or named.desync
        inc.update(culprit_ranks=list(verdict.culprit_ranks), reason=verdict.reason, collective=collective,
                   desync=desync)
        self.ctx.say(f"culprit: {verdict.reason}")
        return Diagnosis(verdict.culprit_ranks, collective, verdict.reason, desync, diag.groups if diag else ())

    def _identities(self, inc: Incident, diag: Diagnosis, rank_pids: dict[int, int]) -> None:
        """What names each rank besides its number: for Ray workers what Ray calls them (actor class and id, Ray
        Train run), as its Ray logs and dashboard do; for ranks no source gave a number (model.unknown_rank) the
        host, pid and command, so that such a culprit is named all the same."""
        named, unknown = {}, {}
        for rank, pid in sorted(rank_pids.items()):
            try:
                cmdline = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            facts = ray_node.describe(pid, cmdline, fd_targets(pid))
            if facts is not None:
                named[str(rank)] = facts
            if not rank_known(rank):
                unknown[str(rank)] = {"host": self.ctx.host, "pid": pid, "command": command_text(cmdline, 200),
                                      **({"ray": facts} if facts is not None else {})}
        if named:
            inc.update(ray_workers=named)
        if unknown:
            inc.update(unknown_ranks=unknown)
        for rank in diag.culprit_ranks:
            if (w := named.get(str(rank))) is not None:
                self.ctx.say(f"culprit {rank_label(rank)} is Ray actor {w['actor_class']} {w['actor_id'] or '?'} "
                             f"(pid {w['pid']}{', Ray Train run ' + str(w['train_run']) if 'train_run' in w else ''})")
            elif (u := unknown.get(str(rank))) is not None:
                self.ctx.say(f"culprit {rank_label(rank)} on {u['host']}: {u['command']}")

    def _workers(self, inc: Incident, diag: Diagnosis, stacks: list[RankStack], rank_pids: dict[int, int],
                 job_id: str) -> RankStack | None:
        """A culprit whose main thread waits on a queue, a pipe or a poll may be waiting on its own workers (vLLM's
        generate(), Ray, multiprocessing): dump them; one blocked in a collective or a device sync is the hang
        behind the process boundary, named in the incident with its pid and stack. Returns its stack."""
        waiting = {s.rank: rank_pids[s.rank] for s in stacks
                   if s.rank in diag.culprit_ranks and s.state in WAITS_ON_WORKERS and s.rank in rank_pids}
        owners = {rank: pid for rank, pid in waiting.items() if rank_workers(pid)}
        if not owners:
            return None
        entry = inc.begin_action("dump_workers", f"worker processes of {format_ranks(owners)}")
        workers = dump_workers(owners, self.ctx.cfg.stacks)
        for w in workers:
            write_rank_stacks(inc.dir, w.rank, self.ctx.host, w.result, job_id=job_id, worker=True)
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
        self.ctx.say(f"culprit: {reason}")
        return first.stack


def communication_sources(finding: Finding, diag: Diagnosis | None, stacks: tuple[RankStack, ...],
                          workers: list[dict[str, object]], sources: Sequence[str] = ()) -> list[str]:
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


PEER_WAIT_S = 6.0  # how long a job whose local ranks all wait alike waits for another node's published dump
