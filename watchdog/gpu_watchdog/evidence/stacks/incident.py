"""The stacks at an incident, the primary evidence source (``evidence.source``): a fresh py-spy dump of every rank
kept raw in the incident, the diagnosis over them and over the other nodes' published dumps, what names each rank
(Ray's names, an unknown rank's command), and the workers a culprit waits on. Written through an ``EvidenceLog``
as it runs: the ``dump_stacks`` and ``dump_workers`` actions, the summary's culprit keys, the console's lines."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import psutil

from gpu_watchdog.config.schema import StacksConfig
from gpu_watchdog.evidence.analyze import write_rank_stacks
from gpu_watchdog.evidence.source import EvidenceLog, IncidentJob
from gpu_watchdog.evidence.stacks.classify import COMMUNICATION_STATES, P2P_FAMILIES, collective_family
from gpu_watchdog.evidence.stacks.collect import (
    WAITS_ON_WORKERS,
    WorkerStack,
    blocked_workers,
    classify_results,
    dump_job,
    dump_workers,
    pids_on_gpu,
    rank_workers,
)
from gpu_watchdog.evidence.stacks.diagnosis import Diagnosis, diagnose, format_ranks
from gpu_watchdog.evidence.stacks.frame_groups import client_groups, read_frame_groups
from gpu_watchdog.evidence.waiting_groups import WaitingGroup, describe, from_frames
from gpu_watchdog.model import Finding, NodeSample, RankStack, StackEvidence, rank_known, rank_label
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.group_members import fd_targets
from gpu_watchdog.sample.processes import command_text

logger = logging.getLogger("gpu_watchdog.evidence")
PEER_WAIT_S = 6.0  # how long a job whose local ranks all wait alike waits for another node's published dump

PeerStacks = Callable[[str, float], Mapping[str, StackEvidence]]  # (job, since) → the other nodes' dumps, by host


@dataclass(frozen=True)
class StacksFound:
    stacks: tuple[RankStack, ...]  # this node's ranks
    diagnosis: Diagnosis
    culprit: RankStack | None  # the stack the hang sits in (a blocked worker's when there is one)
    # The culprits are other nodes' ranks their own agents saw alive (polling, computing, in I/O): the job waits
    # on them, as it would on one node, rather than being hung ("" when not so).
    alive_elsewhere: str = ""
    workers: tuple[dict[str, Any], ...] = ()  # a culprit's workers blocked in a collective or device sync
    dumps: tuple[str, ...] = ()  # each rank's dump outcome ("ok", "timeout", …), for the metrics


class StacksAtIncident:
    action = "dump_stacks"

    def __init__(self, cfg: StacksConfig, host: str, peer_stacks: PeerStacks | None = None,
                 peers_since_s: float = 0.0) -> None:
        self.cfg = cfg
        self.host = host
        self.peer_stacks = peer_stacks  # fallback.shared_dir: the other nodes' agents' published dumps
        self.peers_since_s = peers_since_s  # how long before the onset a peer's dump still counts

    def gather(self, job: IncidentJob, finding: Finding, sample: NodeSample, log: EvidenceLog) -> StacksFound:
        rank_pids = dict(job.rank_pids)
        entry = log.begin_action(self.action)
        t0 = time.monotonic()
        results = dump_job(rank_pids, self.cfg, pids_on_gpu(sample, rank_pids.values()))
        for rank, res in results.items():
            write_rank_stacks(job.incident_dir, rank, self.host, res, world_size=job.world_size, job_id=job.job_id)
        stacks = classify_results(results)
        ok = sum(r.ok for r in results.values())
        log.end_action(entry, ok > 0, f"{ok}/{len(results)} ranks dumped in {time.monotonic() - t0:.2f}s"
                       + "".join(f"; {rank_label(r)}: {res.detail}" for r, res in results.items() if not res.ok))
        missing = set(finding.ranks) - set(rank_pids)
        elsewhere = set(range(job.world_size or 0)) - set(rank_pids) - missing  # other nodes' ranks
        diag = diagnose(stacks, None, missing, elsewhere)
        remote = self.remote_stacks(log, finding, diag, stacks, job.job_id)
        if remote:  # the other nodes' ranks, from their agents' dumps: the culprit named from any node
            diag = diagnose([*stacks, *remote], None, missing, elsewhere)
        # the members known not to wait in any group: no stack (exited), or a stack outside communication
        elsewhere = missing | {s.rank for s in [*stacks, *remote] if s.state not in COMMUNICATION_STATES}
        waiting = self.waiting_groups(stacks, rank_pids, elsewhere)
        if waiting:  # who waits in which group goes with the verdict (it names nobody)
            diag = replace(diag, reason=f"{diag.reason}; {describe(waiting)}")
            log.update(waiting_groups=[w.as_json() for w in waiting])
        log.update(culprit_ranks=list(diag.culprit_ranks) or list(finding.culprit_ranks),
                   collective=diag.collective, reason=diag.reason, desync=diag.desync,
                   groups=[[k, list(v)] for k, v in diag.groups])
        log.say(f"culprit: {diag.reason}")
        culprit = culprit_stack(diag, [*stacks, *remote])
        if culprit is not None:
            log.say(f"culprit {rank_label(culprit.rank)} stack: {culprit.signature}")
        self._identities(log, diag, rank_pids)
        blocked = self._workers(log, diag, stacks, rank_pids, job)
        return StacksFound(tuple(stacks), diag, blocked[0].stack if blocked else culprit, alive(diag, remote),
                           tuple(_worker_json(w) for w in blocked), tuple(r.outcome for r in results.values()))

    def waiting_groups(self, stacks: list[RankStack], rank_pids: Mapping[int, int],
                       elsewhere: set[int]) -> list[WaitingGroup]:
        """The group each of this node's ranks in a collective or p2p op waits in, from its own frames (a re-dump
        with locals) named through its in-job client's report of its groups. Without a client the frames name only
        point-to-point partners: the re-dump is then taken only for ranks in a p2p op."""
        try:
            clients = client_groups(rank_pids.values())
            asked = stacks if clients else [s for s in stacks if collective_family(s.op or "?") in P2P_FAMILIES]
            return from_frames(read_frame_groups(asked, rank_pids, self.cfg), clients, elsewhere)
        except Exception:  # diagnostics must never block recovery: no groups is "not known"
            logger.exception("reading the ranks' process groups from their frames failed")
            return []

    def remote_stacks(self, log: EvidenceLog, finding: Finding, diag: Diagnosis, stacks: list[RankStack],
                      job_id: str) -> list[RankStack]:
        """With ``fallback.shared_dir``: the job's other ranks as their own nodes' agents last dumped them (since
        shortly before the onset; a waiting job is re-dumped every ``waiting_stack_interval_s``). When every local
        rank waits alike and no other node has published yet, its agent gets PEER_WAIT_S to do so. Remote ranks
        are named only from their own node's evidence, never because this node cannot see them."""
        if self.peer_stacks is None or not stacks:
            return []
        since = finding.onset - self.peers_since_s
        peers = self.peer_stacks(job_id, since)
        deadline = time.monotonic() + (PEER_WAIT_S if not diag.culprit_ranks else 0.0)
        while not peers and time.monotonic() < deadline:
            time.sleep(0.5)
            peers = self.peer_stacks(job_id, since)
        local = {s.rank for s in stacks}
        newest: dict[int, tuple[float, RankStack]] = {}
        for ev in peers.values():
            for rs in ev.ranks:
                if rs.rank not in local and (rs.rank not in newest or ev.t > newest[rs.rank][0]):
                    newest[rs.rank] = (ev.t, rs)
        if newest:
            log.update(remote_stacks={host: sorted(rs.rank for rs in ev.ranks if rs.rank not in local)
                                      for host, ev in sorted(peers.items())})
        return [rs for _, (_, rs) in sorted(newest.items())]

    def _identities(self, log: EvidenceLog, diag: Diagnosis, rank_pids: dict[int, int]) -> None:
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
                unknown[str(rank)] = {"host": self.host, "pid": pid, "command": command_text(cmdline, 200),
                                      **({"ray": facts} if facts is not None else {})}
        if named:
            log.update(ray_workers=named)
        if unknown:
            log.update(unknown_ranks=unknown)
        for rank in diag.culprit_ranks:
            if (w := named.get(str(rank))) is not None:
                log.say(f"culprit {rank_label(rank)} is Ray actor {w['actor_class']} {w['actor_id'] or '?'} "
                        f"(pid {w['pid']}{', Ray Train run ' + str(w['train_run']) if 'train_run' in w else ''})")
            elif (u := unknown.get(str(rank))) is not None:
                log.say(f"culprit {rank_label(rank)} on {u['host']}: {u['command']}")

    def _workers(self, log: EvidenceLog, diag: Diagnosis, stacks: list[RankStack], rank_pids: dict[int, int],
                 job: IncidentJob) -> list[WorkerStack]:
        """A culprit whose main thread waits on a queue, a pipe or a poll may be waiting on its own workers (vLLM's
        generate(), Ray, multiprocessing): dump them; one blocked in a collective or a device sync is the hang
        behind the process boundary, named in the incident with its pid and stack. Returns the blocked ones."""
        waiting = {s.rank: rank_pids[s.rank] for s in stacks
                   if s.rank in diag.culprit_ranks and s.state in WAITS_ON_WORKERS and s.rank in rank_pids}
        owners = {rank: pid for rank, pid in waiting.items() if rank_workers(pid)}
        if not owners:
            return []
        entry = log.begin_action("dump_workers", f"worker processes of {format_ranks(owners)}")
        workers = dump_workers(owners, self.cfg)
        for w in workers:
            write_rank_stacks(job.incident_dir, w.rank, self.host, w.result, job_id=job.job_id, worker=True)
        blocked = blocked_workers(workers)
        log.end_action(entry, True, f"{len(workers)} worker(s) dumped, {len(blocked)} blocked in a collective "
                                    "or device sync")
        if not blocked:
            return []
        log.update(workers=[_worker_json(w) for w in blocked])
        first = blocked[0]
        what = first.stack.op or first.stack.state
        reason = (f"{diag.reason}; rank {first.rank} waits on its worker pid {first.pid}, blocked in {what} at "
                  f"{first.stack.where}")
        log.update(reason=reason, collective=diag.collective or first.stack.op)
        log.say(f"culprit: {reason}")
        return blocked


def _worker_json(w: WorkerStack) -> dict[str, Any]:
    return {"rank": w.rank, "pid": w.pid, "state": w.stack.state, "op": w.stack.op, "where": w.stack.where,
            "stack": w.stack.signature}


def alive(diag: Diagnosis, remote: list[RankStack]) -> str:
    """The culprits, when every one is another node's rank that its own agent saw alive: in a wait that ends by
    itself (a poll), in I/O, or computing. On one node the detector never confirms such a job (it waits on those
    ranks); across nodes this node cannot see them progress, only their published dumps."""
    by_rank = {rs.rank: rs for rs in remote}
    culprits = [by_rank.get(r) for r in diag.culprit_ranks]
    if not culprits or any(rs is None or not (rs.timed or rs.state == "io" or (rs.state == "compute" and rs.active))
                           for rs in culprits):
        return ""
    return ", ".join(f"{rank_label(rs.rank)}: {rs.state} at {rs.where}" for rs in culprits if rs is not None)


def culprit_stack(diag: Diagnosis, stacks: list[RankStack]) -> RankStack | None:
    by_rank = {s.rank: s for s in stacks}
    return next((by_rank[r] for r in diag.culprit_ranks if r in by_rank), None)
