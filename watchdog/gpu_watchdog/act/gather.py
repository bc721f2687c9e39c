"""An incident's evidence, gathered the same way for every stall: a fresh py-spy dump of every rank kept raw in
the incident, the diagnosis that names the culprit, the workers of a culprit waiting on them, Flight Recorder
dumps when the job configured them (analyzed across every process group), NCCL RAS for jobs that serve it (two
polls compared, ``ras.json``), and the readable report. One verdict over the sources (``evidence.culprit``): the
stacks name the culprit when they can tell the ranks apart, else the Flight Recorder, else RAS; the summary's
``culprit_evidence`` says which source named it."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import psutil

from gpu_watchdog.act.target import ActContext
from gpu_watchdog.detect.detector import Finding, JobStatus
from gpu_watchdog.evidence import flight_recorder as fr
from gpu_watchdog.evidence.analyze import fr_dir, write_rank_stacks
from gpu_watchdog.evidence.collect import (
    WAITS_ON_WORKERS,
    blocked_workers,
    classify_results,
    dump_job,
    dump_workers,
    pids_on_gpu,
    rank_workers,
)
from gpu_watchdog.evidence.culprit import FLIGHT_RECORDER, NCCL_RAS, STACKS, SourceVerdict, merge_evidence
from gpu_watchdog.evidence.diagnosis import Diagnosis, communication_evidence, diagnose, format_ranks
from gpu_watchdog.evidence.fr_analysis import FrAnalysis, analyze_traces, rank_trace
from gpu_watchdog.evidence.ras_poll import RasPoller, write_ras_evidence
from gpu_watchdog.evidence.report import render_report
from gpu_watchdog.model import NodeSample, RankStack, rank_known, rank_label
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.group_members import fd_targets
from gpu_watchdog.sample.processes import command_text
from gpu_watchdog.store.incidents import Incident


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

    def gather(self, inc: Incident, finding: Finding, status: JobStatus | None, sample: NodeSample) -> Gathered:
        ctx, cfg = self.ctx, self.ctx.cfg
        job_id = finding.job_id or ""
        rank_pids = dict(status.rank_pids) if status else {}
        diag: Diagnosis | None = None
        if not rank_pids or not cfg.stacks.enabled:
            out = Gathered()
        else:
            entry = inc.begin_action("dump_stacks")
            t0 = time.monotonic()
            results = dump_job(rank_pids, cfg.stacks, pids_on_gpu(sample, rank_pids.values()))
            world = max((p.job.world_size or 0 for p in sample.processes
                         if p.job and p.job.job_id == job_id), default=0) or None
            for rank, res in results.items():
                write_rank_stacks(inc.dir, rank, ctx.host, res, world_size=world, job_id=job_id)
                ctx.metric("pyspy_dump", res.outcome)
            stacks = classify_results(results)
            ok = sum(r.ok for r in results.values())
            inc.end_action(entry, ok > 0, f"{ok}/{len(results)} ranks dumped in {time.monotonic() - t0:.2f}s"
                           + "".join(f"; {rank_label(r)}: {res.detail}" for r, res in results.items() if not res.ok))
            missing = set(finding.ranks) - set(rank_pids)
            elsewhere = set(range(world or 0)) - set(rank_pids) - missing  # other nodes' ranks
            diag = diagnose(stacks, None, missing, elsewhere)
            remote = self._remote_stacks(inc, finding, diag, stacks, job_id)
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
            behind = self._workers(inc, diag, stacks, rank_pids, job_id)
            out = Gathered(tuple(stacks), diag, behind or culprit, alive_elsewhere=_alive(diag, remote))
        fr = self._flight_recorder(inc, rank_pids, job_id)
        ras = self._nccl_ras(inc, job_id, rank_pids, sample)
        merged = self._decide(inc, finding, diag, fr, ras)
        if merged is not None and merged is not diag:  # the recovery acts on the merged verdict
            out = replace(out, diagnosis=merged, culprit=out.culprit or _culprit_stack(merged, list(out.stacks)))
        comm = communication_sources(finding, diag, out.stacks, inc.summary.get("workers") or [], fr, ras)
        inc.update(communication_evidence=comm or None)
        out = replace(out, communication="; ".join(comm))
        out.report(inc)
        return out

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

    def _decide(self, inc: Incident, finding: Finding, diag: Diagnosis | None, fr: FrAnalysis | None,
                ras: SourceVerdict | None = None) -> Diagnosis | None:
        """One verdict over the evidence sources (``merge_evidence``): the stacks decide when they tell the ranks
        apart, else the Flight Recorder (NCCL ranks all busy-waiting in the same device sync), else NCCL RAS. Returns
        the diagnosis the recovery acts on: ``diag`` itself unless another source named the culprit."""
        verdict = merge_evidence(diag, fr, *([ras] if ras is not None else []))
        evidence = verdict.evidence or ("detector" if finding.culprit_ranks else None)
        inc.update(culprit_evidence=evidence, evidence_disagreements=list(verdict.disagreements))
        if fr is not None:
            inc.update(flight_recorder={"culprit_ranks": list(fr.culprit_ranks), "reason": fr.reason,
                                        "process_groups": [g.as_json() for g in fr.groups],
                                        "ranks": list(fr.ranks), "no_dump": list(fr.no_dump),
                                        "versions": list(fr.versions)})
        for line in verdict.disagreements:
            self.ctx.say(f"evidence disagrees: {line}")
        if verdict.evidence in (None, STACKS):
            return diag
        stuck = [g for g in fr.groups if g.kind != "in_progress"] if fr and verdict.evidence == FLIGHT_RECORDER else []
        collective = stuck[0].op if stuck else (diag.collective if diag else None)
        desync = bool(diag and diag.desync) or any(g.kind == "mismatch" for g in stuck) or (
            verdict.evidence == NCCL_RAS and ras is not None and ras.desync)
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

    def _flight_recorder(self, inc: Incident, rank_pids: dict[int, int], job_id: str = "") -> FrAnalysis | None:
        """Ask every rank for a Flight Recorder dump (NCCL's dump pipe, or the in-job helper serving the same FIFO
        for gloo), wait for the fresh dumps, copy them and the job's dump-on-timeout files into the incident's
        ``flight-recorder/``, and analyze them. None when the job runs without FR or no dump came. Dumps the engine
        asked for when the job turned suspect (``ctx.fr_dumps``) count as fresh: only ranks without one are asked."""
        env, started = _rank_env(rank_pids)
        settings = fr.fr_settings(env)
        if settings is None or fr.unserved(settings, rank_pids, started):
            return None
        entry = inc.begin_action("flight_recorder")
        try:
            suspect = self.ctx.fr_dumps.asked_at(job_id) if self.ctx.fr_dumps is not None and job_id else None
            asked_at = suspect[0] if suspect else time.time()
            ask = [r for r in sorted(rank_pids) if suspect is None or not _fresh(settings, {r: 0}, asked_at)]
            triggered = list(dict.fromkeys([*(suspect[1] if suspect else ()), *fr.trigger_dumps(settings, ask)]))
            when = f" (at suspect, {time.time() - suspect[0]:.0f}s earlier)" if suspect else ""
            deadline = time.monotonic() + (FR_WAIT_S if triggered else 0.0)
            while time.monotonic() < deadline and not _fresh(settings, rank_pids, asked_at):
                time.sleep(0.2)
            # this job's ranks only, written since they started: another job may share the default dump prefix
            files = fr.collect_dumps(settings, fr_dir(inc.dir), ranks=sorted(rank_pids), newer_than=started)
            traces = [rank_trace(fr.load_dump(f), rank, f.stat().st_mtime)
                      for f in files if (rank := fr.dump_rank(f)) is not None]
        except Exception as e:  # diagnostics must never block recovery; a bad dump is "no evidence"
            inc.end_action(entry, False, f"flight recorder: {e}")
            return None
        if not traces:
            if not triggered and not settings.pipe_prefix and not settings.dump_on_timeout:
                # FR records but nothing can ask it to dump (gloo has no dump pipe): not available, not a failure
                inc.end_action(entry, False, "not available: no dump trigger (TORCH_NCCL_DEBUG_INFO_PIPE_FILE "
                                             "unset; gloo ranks have no dump pipe)", outcome="not_available")
            else:
                inc.end_action(entry, False, f"no dump collected, {len(triggered)} triggered")
            return None
        analysis = analyze_traces(traces, min_wait_s=0.0)  # the stall is confirmed: every wait counts
        inc.end_action(entry, True, f"{len(files)} dump(s) collected, {len(triggered)} triggered{when}; "
                                    f"{analysis.reason}")
        return analysis

    def _nccl_ras(self, inc: Incident, job_id: str, rank_pids: dict[int, int],
                  sample: NodeSample) -> SourceVerdict | None:
        """NCCL RAS, two polls compared (evidence.ras_poll): ``ras.json`` in the incident and ``ras_culprit_ranks``
        in its summary. Nothing at all for a job RAS is not asked about (a gloo job, ``ras.enabled = off``).
        Returns what RAS says as an evidence source (None: not asked, or it failed)."""
        poller = self.ctx.ras or RasPoller(lambda: self.ctx.cfg.ras)
        addr = poller.address(job_id, rank_pids)
        if addr is None:
            return None
        world = max((p.job.world_size or 0 for p in sample.processes if p.job and p.job.job_id == job_id),
                    default=0) or None
        entry = inc.begin_action("nccl_ras", addr)
        try:
            evidence = poller.incident_evidence(job_id, rank_pids, world)
            write_ras_evidence(inc.dir, evidence)
            inc.update(ras_culprit_ranks=evidence.culprit_ranks, ras_hung_communicators=len(evidence.hung))
            inc.end_action(entry, bool(evidence.hung), evidence.summary)
            if evidence.hung:
                self.ctx.say(evidence.summary)
        except Exception as e:  # diagnostics must never block recovery
            inc.end_action(entry, False, f"nccl ras: {e}")
            return None
        return SourceVerdict(NCCL_RAS, tuple(evidence.culprit_ranks) if evidence.hung else (), evidence.summary,
                             desync=evidence.desync, inside_collective=evidence.frozen_equal)

def communication_sources(finding: Finding, diag: Diagnosis | None, stacks: tuple[RankStack, ...],
                          workers: list[dict[str, object]], fr: FrAnalysis | None,
                          ras: SourceVerdict | None) -> list[str]:
    """Every source that says the hang is in communication, one line each (empty: none does): the ranks' stacks
    (evidence.diagnosis.communication_evidence), a rank's worker blocked in a collective, the Flight Recorder's
    pending collectives, NCCL RAS's ranks behind, the GPUs' NCCL spin (a kernel polling for its peers)."""
    out = []
    if diag is not None and (line := communication_evidence(diag, stacks)):
        out.append(line)
    for w in workers:
        out.append(f"worker pid {w.get('pid')} of rank {w.get('rank')} blocked in {w.get('op') or w.get('state')}")
    pending = [g for g in fr.groups if g.kind != "in_progress"] if fr is not None else []
    if fr is not None and pending:
        out.append(f"flight recorder: {len(pending)} process group(s) with pending collectives ({fr.reason})")
    if ras is not None and (ras.culprit_ranks or (ras.inside_collective and finding.signature == "spin")):
        out.append(f"NCCL RAS: {ras.reason}")
    if finding.signature == "spin":
        out.append("GPUs spin at idle power with no traffic (an NCCL kernel polling for its peers)")
    return out


FR_WAIT_S = 10.0  # how long to wait for the triggered ranks' dumps (the first one may import torch._dynamo)
PEER_WAIT_S = 6.0  # how long a job whose local ranks all wait alike waits for another node's published dump


def _rank_env(rank_pids: dict[int, int]) -> tuple[dict[str, str], float | None]:
    """The environment of one of the job's ranks (FR settings are job-wide) and the earliest rank start time (older
    dump files belong to an earlier run)."""
    import psutil

    env: dict[str, str] = {}
    started: list[float] = []
    for pid in rank_pids.values():
        try:
            p = psutil.Process(pid)
            started.append(p.create_time())
            env = env or p.environ()
        except Exception:
            continue
    return env, min(started) if started else None


def _fresh(settings: fr.FrSettings, rank_pids: dict[int, int], asked_at: float) -> bool:
    for rank in rank_pids:
        try:
            if settings.dump_path(rank).stat().st_mtime < asked_at:
                return False
        except OSError:
            return False
    return True
