"""Process state through psutil: which processes are a job's ranks, composed from the ways ranks are found
(sample.ranks: the environment, and for the members of a process group with no rank there the sources of their
number), and each rank's tree CPU and I/O.

A process's environment is read once per (pid, create_time) and cached; a reused pid gets a fresh read, and a
process without a rank of its own is read again each tick for its first 30 s (it may still exec into one).
Vanished, zombie and access-denied processes are recorded or skipped, never raised out of a tick.

Job ids come from the environment (sample.ranks.environment); a torchrun rank with neither a run id nor a usable
endpoint is named after its torchrun agent (``torchrun-pidPID-START``). Two rank processes that still claim the same
(job, rank) are never merged: each launcher's ranks become ``JOB@LAUNCHER_PID`` and a ``DuplicateRank`` error
is reported.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

import psutil

from gpu_watchdog.model import JobIdentity, ProcessSample, SampleError, rank_label, unknown_rank
from gpu_watchdog.sample import group_members, proc_stat, ray_node
from gpu_watchdog.sample.ranks import first_claim, none_will_name
from gpu_watchdog.sample.ranks.environment import (
    JOB_ID_ENV,
    LAUNCHED_ID_PREFIX,
    MAX_JOB_ID,
    endpoint_job_id,
    identity_from_env,
    int_or_none,
    wants_launcher_id,
)
from gpu_watchdog.sample.ranks.member import RankFinder
from gpu_watchdog.sample.ranks.stacks import NoRankFinder
from gpu_watchdog.sample.unranked import Unranked, command_text

log = logging.getLogger("gpu_watchdog.sample.processes")

MEMBER_RECHECK_S = 3.0  # processes of a rankless job that have not joined a process group are looked at this often
MEMBER_RECHECK_MAX_S = 24.0  # ... in their first minute as candidates (_JOINS_WITHIN_S), then down to this
_JOINS_WITHIN_S = 60.0  # ranks join their group within this of becoming candidates (imports, init_process_group)
_RAY_LOG_WITHIN_S = 10.0  # a Ray worker opens its core-worker log within its first second
_REREAD_YOUNG_S = 30.0  # how long after its start a process without a rank of its own is read again (exec)



# Launchers that start the ranks themselves: under ``srun`` they carry the task's SLURM_PROCID, but the ranks are
# their workers (with RANK of their own). Known from their first sample, before any worker shows up.
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "torchrun", "accelerate",
                     "deepspeed.launcher", "deepspeed")


def _is_launcher(proc: psutil.Process) -> bool:
    """torchrun / ``python -m torch.distributed.run`` / ``accelerate launch`` / ``deepspeed``: a launcher."""
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return False
    names = [os.path.basename(a) for a in argv[:3]]
    if names and names[0] in _LAUNCHER_MODULES:
        return True
    if len(argv) >= 2 and names[0].startswith("python"):
        if argv[1] == "-m" and len(argv) >= 3:
            return argv[2] in _LAUNCHER_MODULES
        return names[1] in _LAUNCHER_MODULES  # a console script run by its interpreter
    return False


@dataclass
class _Known:
    proc: psutil.Process
    create_time: float
    identity: JobIdentity | None
    env: Mapping[str, str] = field(default_factory=dict)
    start: float = 0.0  # the process table's start token when this entry was made (see process_table)
    cmdline: tuple[str, ...] | None = None  # read once, on first use
    launcher_scoped: bool = False  # a torchrun rank without run id or endpoint: named after its agent
    launcher_id: str | None = None  # that name, fixed when first made (the agent may exit, the rank reparent)
    slurm_rank: bool = False  # its rank is an srun task's SLURM_PROCID (no RANK of its own)
    launcher: bool = False  # torchrun's agent (or another launcher) in an srun task: it starts the ranks
    launcher_cmd: bool | None = None  # its command line is a known launcher's (read once, on first use)
    member: bool = False  # joined its job's process group without a rank in its environment (group_members)
    member_conns: frozenset[int] = frozenset()  # the socket inodes that made it one
    own_conns: bool | None = None  # below another member: whether it holds connections of its own (None: not asked)
    member_checked: bool = False  # looked at by group_members at least once
    member_next_check: float = 0.0  # monotonic: not looked at again before (backs off while it does not join)
    member_checks: int = 0  # looks that found it outside the group
    sockets_seen: frozenset[int] = frozenset()  # its sockets when last found outside the group
    candidate_since: float | None = None  # monotonic: first looked at as a possible member
    member_rank: int | None = None  # that member's rank, once learned
    pipe_stem: str = ""  # TORCH_NCCL_DEBUG_INFO_PIPE_FILE: an NCCL rank's dump pipe names its rank
    master_port: str = ""  # MASTER_PORT from its starting environment
    ray_service: bool | None = None  # a process of Ray itself (ray_node.is_service; read once, on first use)
    ray_idle: bool = False  # of those, an idle Ray worker: read again each tick (its title names its actor once leased)
    service_read_tick: int = -1  # the scanner's tick of that last read
    ray: ray_node.CoreWorker | None = None  # the Ray worker or driver it is, from its own log (ray_node)
    ray_checked: bool = False  # its Ray facts are final (complete, or it is no Ray core worker)
    live_identity: Mapping[str, str] | None = None  # RANK, LOCAL_RANK, WORLD_SIZE as set in code (sample.live_env)
    env_read_at: float = 0.0  # monotonic: its live environment is not read again before


_LINUX = sys.platform.startswith("linux")


_handed_over: tuple[float, dict[int, tuple[int, float]]] | None = None  # (monotonic, table): process_table
_HANDED_OVER_FOR_S = 0.5  # well under a tick: a table handed over is the same tick's, or stale


def process_table(hand_over: bool = False, take_handed_over: bool = False) -> dict[int, tuple[int, float]]:
    """pid → (ppid, start token) for every process on the node; the token changes when a pid is reused. Read-only.

    ``hand_over``: keep this read for the next call that takes one (the daemon's registry reads the table just before
    the tick's scan, which then need not read it again: a read of every process was the largest part of a tick);
    ``take_handed_over``: use such a read, once, if it is from the last half second, instead of reading.

    Linux: one read of /proc/PID/stat per process (token: its start time in clock ticks). psutil's
    ``process_iter(["ppid"])`` costs about three file reads per process and was most of a tick's CPU.
    Elsewhere: psutil, with the create time as the token.
    """
    global _handed_over
    if take_handed_over:
        handed, _handed_over = _handed_over, None
        if handed is not None and time.monotonic() - handed[0] <= _HANDED_OVER_FOR_S:
            return handed[1]
    read_at = time.monotonic()
    table = _read_process_table()
    if hand_over:
        _handed_over = (read_at, table)
    return table


def _read_process_table() -> dict[int, tuple[int, float]]:
    if not _LINUX:
        return {p.pid: (p.info["ppid"] or 0, p.info["create_time"] or 0.0)
                for p in psutil.process_iter(["ppid", "create_time"])}
    return {pid: (st.ppid, st.start) for pid, st in proc_stat.scan().items()}


PIPE_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"


class ProcessScanner:
    """Finds rank processes and reads their state once per tick.

    Scope: with ``root_pid`` only that process and its descendants are considered (the launcher's job);
    otherwise every process on the node whose environment names a rank (the daemon). ``extra_pids`` adds
    processes named by someone else (NVML's compute processes, scheduler registrations).

    Ranks whose rank lives only in code (``mp.spawn``): where no process of the launched tree (or of the
    registered processes) carries a rank in its environment, the ones that joined the process group
    (group_members) are ranks; the number comes from an NCCL rank's dump pipe, else from ``rank_finder`` (the
    stacks' locals, evidence.stacks.spawned_ranks). Until it is known the process is listed in ``unranked``; once
    every source was asked and none names it, it is a rank all the same, as ``model.unknown_rank`` (minus its pid).
    """

    def __init__(self, root_pid: int | None = None, env_filter: Iterable[str] = (),
                 member_pool: Callable[[], Iterable[int]] = tuple) -> None:
        self.root_pid = root_pid
        self._known: dict[int, _Known | None] = {}  # pid → cached process, None = not ours / unreadable
        # pid → start token of processes whose environment reads as gone while the process table still lists them
        # (kernel threads on some kernels): not ours, and not worth a psutil.Process every tick (it was most of the
        # daemon's steady-state CPU on such a box).
        self._gone_env: dict[int, float | None] = {}
        self._children: dict[int, tuple[float | None, psutil.Process]] = {}  # rank descendants: (start, handle)
        self._keep_env = tuple(env_filter)  # env keys kept for consistency checks
        # (claimed job id, launcher pid, launcher start) → the id its ranks were split off under; kept while the
        # launcher has ranks, so that a split job keeps one id after the other claimant ends.
        self._split: dict[tuple[str, int, float | None], str] = {}
        self._dup_warned: set[tuple[str, int, tuple[int, ...]]] = set()  # (job, rank, pids) logged once
        self.rank_finder: RankFinder = NoRankFinder()
        # Without a root (the daemon): the processes whose group membership is looked at (registered jobs).
        self.member_pool = member_pool
        self.unranked: tuple[int, ...] = ()  # group members whose rank is not known yet (last tick)
        self.rankless: tuple[int, ...] = ()  # processes in scope with no rank and not in a group (last tick)
        # Both, less launchers and the launched command, as last seen: what names each should it die before its rank is
        # known (launch's exit watch keeps it; sample.unranked).
        self.not_yet_ranked: dict[int, Unranked] = {}
        self.ray_workers: dict[int, Unranked] = {}  # the job's Ray workers, ranks or not, as last seen alive
        self._members_checked_at = float("-inf")  # monotonic: the last look at who joined a process group
        self._ticks = 0  # calls of sample(): what "once a tick" counts

    def env_of(self, pid: int) -> Mapping[str, str]:
        k = self._known.get(pid)
        return k.env if k else {}

    def _lookup(self, pid: int, start: float | None, ppid: int, errors: list[SampleError]) -> _Known | None:
        known = self._known.get(pid)
        if known is not None:
            # psutil caches create_time() in the Process object, so only the table's fresh start token can
            # tell that this pid now belongs to another process.
            if start is not None and known.start != start:
                known = None
            elif self._settled(known, ppid) or time.time() - known.create_time > _REREAD_YOUNG_S:
                return known
        elif pid in self._known or (pid in self._gone_env and self._gone_env[pid] == start):
            return None
        try:
            proc = known.proc if known is not None else psutil.Process(pid)
            ctime = known.create_time if known is not None else proc.create_time()
            env = proc.environ()
        except psutil.AccessDenied:
            if known is not None:
                return known
            errors.append(SampleError("AccessDenied", f"environ of pid {pid}"))
            self._known[pid] = None
            return None
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            if known is None:
                self._gone_env[pid] = start  # gone, or a kernel thread: its next table entry decides
            return known  # one that exited young keeps what it showed alive (a zombie rank is still a rank)
        ident = identity_from_env(env)
        launcher = ident is not None and ident.rank is not None and env.get("RANK") is None and _is_launcher(proc)
        if launcher and ident is not None:
            ident = replace(ident, rank=None)  # an srun task running torchrun: its agent, never a rank
        kept = {k: v for k, v in env.items() if k.startswith(self._keep_env)} if self._keep_env else {}
        known = _Known(proc, ctime, ident, kept, start if start is not None else 0.0,
                       launcher_scoped=wants_launcher_id(env, ident),
                       slurm_rank=ident is not None and ident.rank is not None and env.get("RANK") is None,
                       launcher=launcher, pipe_stem=env.get(PIPE_FILE_ENV, ""),
                       master_port=env.get("MASTER_PORT", ""))
        old = self._known.get(pid)
        if old is not None and old.start == known.start:  # a re-read of the same process keeps what was learned
            known.launcher_cmd, known.member, known.member_rank = old.launcher_cmd, old.member, old.member_rank
            known.member_conns, known.own_conns = old.member_conns, old.own_conns
            known.member_checked = old.member_checked
            known.member_next_check, known.member_checks = old.member_next_check, old.member_checks
            known.sockets_seen, known.candidate_since = old.sockets_seen, old.candidate_since
            known.env_read_at = old.env_read_at
            known.ray, known.ray_checked = old.ray, old.ray_checked  # (is it Ray's: from the title it has now)
        self._known[pid] = known
        return known

    def _settled(self, known: _Known, ppid: int) -> bool:
        """Has this process shown its own rank? A fork carries its parent's environment until it execs the
        real program (torchrun's workers, wrapper scripts): no RANK, or only the job id (under `launch`),
        or the parent's very identity (torchrun under Slurm: the srun task's SLURM_PROCID). Until it shows
        a rank of its own, a young process is read again every tick."""
        ident = known.identity
        if ident is None or ident.rank is None or known.slurm_rank:
            # An srun task's rank is only its SLURM_PROCID: a wrapper (``bash -c '… exec torchrun …'``) is read
            # again while young, so that once it execs a launcher it is known as one, before any worker starts.
            return False
        parent = self._known.get(ppid)
        return parent is None or parent.identity != ident

    def _tree(self, ppids: Mapping[int, int]) -> dict[int, list[int]]:
        children: dict[int, list[int]] = {}
        for pid, ppid in ppids.items():
            children.setdefault(ppid, []).append(pid)
        return children

    def _in_scope(self, ppids: Mapping[int, int]) -> set[int]:
        if self.root_pid is None:
            return set(ppids)
        children = self._tree(ppids)
        scope, stack = set(), [self.root_pid]
        while stack:
            pid = stack.pop()
            if pid in scope:
                continue
            scope.add(pid)
            stack.extend(children.get(pid, ()))
        return scope

    def remembers(self, pid: int) -> bool:
        """Whether ``pid`` is in the scanner's per-process cache (a vanished process must leave it)."""
        return pid in self._known

    def sample(self, extra_pids: Iterable[int] = (), gpu_pids: Collection[int] = ()
               ) -> tuple[tuple[ProcessSample, ...], list[SampleError]]:
        """One read of every rank process in scope (plus ``extra_pids``, among them ``gpu_pids``: NVML's compute
        processes), with tree-aggregated counters."""
        errors: list[SampleError] = []
        self._ticks += 1
        table = process_table(take_handed_over=True)
        ppids = {pid: v[0] for pid, v in table.items()}
        starts = {pid: v[1] for pid, v in table.items()}
        # Forget vanished pids so the cache stays bounded.
        for cache in (self._known, self._children, self._gone_env):
            for pid in [p for p in cache if p not in ppids]:
                del cache[pid]
        scope = self._in_scope(ppids)
        extra = {p for p in extra_pids if p in ppids}
        idents: dict[int, _Known] = {}
        for pid in scope | extra:
            known = self._lookup(pid, starts.get(pid), ppids.get(pid, 0), errors)
            if known is not None and (known.identity is not None or pid in extra):
                idents[pid] = known
        pool = scope if self.root_pid is not None else {p for p in self.member_pool() if p in ppids}
        self._spawned_ranks(pool, idents, ppids)
        children = self._tree(ppids)
        launched = self._launcher_ids(idents, ppids, starts)
        launchers = _rank_launchers(idents, ppids)
        samples = []
        for pid, known in idents.items():
            parent = idents.get(ppids.get(pid, 0))
            # A dataloader worker inherits RANK: only the topmost process of a (job, rank) is the rank. A
            # process that started ranks of its own job (torchrun's agent in an srun task) is none.
            is_rank = known.identity is not None and known.identity.rank is not None and not (
                parent is not None and parent.identity == known.identity) and pid not in launchers
            if not is_rank and (pid not in extra or self._is_ray_service(known)
                                or (known.ray is not None and pid not in gpu_pids)):
                # A registered Ray node's own processes (ray start, GCS, raylet, agents) and the Ray workers that are
                # not ranks (Ray Train's controller, Ray's library actors) hold no rank and, off the GPUs, nothing
                # of the job's: sampling them, the node's own each with the whole tree below it, was most of such a
                # daemon's CPU.
                continue
            s = self._read(pid, known, ppids.get(pid, 0), children, starts, errors)
            if s is not None:
                job = s.job
                if job is not None and pid in launched:
                    job = replace(job, job_id=launched[pid])
                samples.append(replace(s, is_rank=is_rank, job=job))
        samples = self._separate_duplicates(samples, ppids, starts, errors)
        samples.sort(key=lambda s: (s.job.job_id if s.job else "", s.job.rank if s.job and s.job.rank is not None
                                    else -1, s.pid))
        return tuple(samples), errors

    def _is_launcher_cmd(self, known: _Known) -> bool:
        if known.launcher_cmd is None:
            known.launcher_cmd = _is_launcher(known.proc)
        return known.launcher_cmd

    def _command(self, known: _Known) -> tuple[str, ...]:
        if not known.cmdline:  # an empty read is no command line (a process mid-exec or mid-setproctitle)
            try:
                known.cmdline = tuple(known.proc.cmdline())
            except psutil.Error:
                return ()
        return known.cmdline

    def _is_ray_service(self, known: _Known) -> bool:
        if known.ray_service is None or not known.cmdline or (known.ray_idle
                                                              and known.service_read_tick != self._ticks):
            # An idle Ray worker is Ray's until the raylet hands it an actor: its title then names the actor (read
            # once a tick, however often asked). A verdict on an empty command line (a process mid-exec) is none.
            if known.ray_service is not None:
                known.cmdline = None
            cmd = self._command(known)
            known.ray_service = ray_node.is_service(cmd)
            known.ray_idle = known.ray_service and ray_node.idle(cmd)
            known.service_read_tick = self._ticks
        return known.ray_service

    def _ray_facts(self, pid: int, known: _Known) -> ray_node.CoreWorker | None:
        """The Ray core worker ``pid`` is, read from its log until everything is known (its gRPC port, its actor);
        a process that opened no core-worker log in its first seconds is none — unless it has a Ray title: a Ray
        worker whatever was read of it before (its command line mid-rewrite, a loaded host's slow start), looked for
        until found."""
        if not known.ray_checked or (known.ray is None and ray_node.title(self._command(known))):
            # A read that finds no log once one was found is a process that ended (a zombie lists no fds): it keeps
            # what was read while it lived.
            known.ray = ray_node.core_worker(pid, group_members.fd_targets(pid)) or known.ray
            known.ray_checked = (known.ray.complete if known.ray is not None
                                 else time.time() - known.create_time > _RAY_LOG_WITHIN_S)
        return known.ray

    def _unranked(self, pid: int, known: _Known) -> Unranked:
        """``pid`` as it is known while no source names its rank. A Ray worker's log is found at once (not only at the
        next look at who joined): it names the worker should it die before that look."""
        cmd = self._command(known)
        ray = known.ray if known.ray is not None or not ray_node.title(cmd) else self._ray_facts(pid, known)
        return Unranked(pid, known.create_time, cmd, known.member, ray)

    def _sockets_changed(self, pid: int, known: _Known, now: float) -> bool:
        """Whether ``pid`` may have joined since it was last found outside the group. Past its first minute as a
        candidate, one that opened no socket since cannot have (the TCP table read is most of a look's cost); in
        it, always: its connection may have been still connecting, the same socket established now."""
        if not known.member_checked or not _settled_out(known, now):
            return True
        sockets = frozenset(group_members.socket_inodes(pid))
        if sockets == known.sockets_seen:
            _back_off(known, now)  # not looked at again before its next look is due (its fds were listed each tick)
            return False
        known.sockets_seen = sockets
        return True

    def _spawned_ranks(self, pool: set[int], idents: dict[int, _Known], ppids: Mapping[int, int]) -> None:
        """Ranks of a job that sets them in code: where nothing in ``pool`` has a rank of its own, the topmost
        processes that joined a process group become ranks once their number is known (in ``idents``, in place).
        Ray's own processes never join; the ports of Ray's services and of its workers' gRPC servers are Ray's
        traffic, not a process group's (ray_node)."""
        self.unranked, self.rankless, self.not_yet_ranked, self.ray_workers = (), (), {}, {}
        procs = {pid: idents[pid] for pid in pool if pid in idents}
        if any(k.identity is not None and k.identity.rank is not None and not (k.launcher or k.member)
               for k in procs.values()):
            return  # torchrun, Slurm, a job that exports RANK: the environment says it all
        procs = {pid: k for pid, k in procs.items() if not self._is_ray_service(k)}
        now = time.monotonic()
        for k in procs.values():
            if k.candidate_since is None and not k.member:
                k.candidate_since = now
        candidates = [pid for pid, k in procs.items()
                      if not k.member and not self._is_launcher_cmd(k) and now >= k.member_next_check
                      and self._sockets_changed(pid, k, now)]
        if candidates and (now >= self._members_checked_at + MEMBER_RECHECK_S
                           or any(not procs[pid].member_checked for pid in candidates)):
            # A new process is looked at at once, the others that have not joined every few seconds; one that stayed
            # out past its first minute (a Ray node's own actors never join) less and less often, down to every
            # MEMBER_RECHECK_MAX_S: reading every fd of a job's processes and its TCP table each tick would cost
            # more than the rest of the tick.
            # Listeners are held by the candidates, the members that are not forks of members, and launchers.
            self._members_checked_at = now
            ray_ports = {w.grpc_port for pid, k in procs.items()
                         if (w := self._ray_facts(pid, k)) is not None and w.grpc_port is not None}
            holders = [pid for pid, k in procs.items() if not k.member or k.own_conns is not False]
            envs = {pid: {"MASTER_PORT": procs[pid].master_port} for pid in candidates}
            for pid, conns in group_members.joined(candidates, holders, envs, ignored_ports=ray_ports).items():
                procs[pid].member, procs[pid].member_conns = True, conns
            for pid in candidates:
                k = procs[pid]
                if not k.member_checked or not k.sockets_seen:
                    k.sockets_seen = frozenset(group_members.socket_inodes(pid))
                k.member_checked = True
                if not k.member and _settled_out(k, now):
                    _back_off(k, now)
        members = {pid for pid, k in procs.items() if k.member}
        unranked, rankless = [], []
        for pid, known in procs.items():
            above = _member_above(pid, members, ppids)
            if above is not None:
                # A member's fork (a DataLoader worker) holds only its parent's sockets: its work, not a rank. A
                # rank that starts the others itself (a hand-written mp.Process loop in rank 0) holds its own.
                if known.own_conns is None and known.member:
                    known.own_conns = bool(known.member_conns - group_members.socket_inodes(above))
                if not known.own_conns:
                    continue
            if pid not in members:
                rankless.append(pid)
                continue
            look = _MemberLook(self, pid, known) if known.member_rank is None else None
            if look is not None and (claim := first_claim(look)) is not None:
                known.member_rank = claim.rank
                known.live_identity = claim.identity or known.live_identity
                log.debug("pid %d is rank %d: %s", pid, claim.rank, claim.evidence)
            if look is not None and known.member_rank is None and none_will_name(look):
                # Watched all the same, named by what identifies it: a member left out would leave its job's hangs
                # unseen (an actor group whose code hands init_process_group the rank as an argument).
                known.member_rank = unknown_rank(pid)
                log.warning("pid %d (%s) joined its job's process group but no source names its rank (its stack: %s): "
                            "watched as %s", pid, command_text(self._command(known), 120),
                            self.rank_finder.why(pid), rank_label(known.member_rank))
            if known.member_rank is None:
                unranked.append(pid)
                continue
            ident = known.identity or JobIdentity("unknown")
            train = known.ray.train if known.ray is not None else None
            if train is not None:
                ident = replace(ident, local_rank=train.local_rank, world_size=train.world_size)
            elif known.live_identity:
                ident = replace(ident, local_rank=int_or_none(known.live_identity.get("LOCAL_RANK")),
                                world_size=int_or_none(known.live_identity.get("WORLD_SIZE")))
            known.identity = replace(ident, rank=known.member_rank)
        self.unranked, self.rankless = tuple(sorted(unranked)), tuple(sorted(rankless))
        self.not_yet_ranked = {pid: self._unranked(pid, procs[pid]) for pid in (*unranked, *rankless)
                               if pid != self.root_pid and not self._is_launcher_cmd(procs[pid])}
        self.ray_workers = {pid: Unranked(pid, k.create_time, self._command(k), k.member, k.ray)
                            for pid, k in procs.items() if k.ray is not None and not k.ray.driver}

    def _launcher_ids(self, idents: Mapping[int, _Known], ppids: Mapping[int, int],
                      starts: Mapping[int, float]) -> dict[int, str]:
        """pid → job id for torchrun ranks that carry neither a run id nor an endpoint: named after their agent
        (the rank's parent, with its start token against pid reuse). A rank's child with the rank's identity (a
        dataloader worker) takes the rank's name."""
        out: dict[int, str] = {}
        for pid, known in idents.items():
            if not known.launcher_scoped:
                continue
            top, seen = pid, {pid}
            while True:  # up to the topmost process with this identity: the rank
                parent = idents.get(ppids.get(top, 0))
                nxt = ppids.get(top, 0)
                if parent is None or parent.identity != known.identity or nxt in seen:
                    break
                top = nxt
                seen.add(top)
            rank = idents[top]
            if not rank.launcher_scoped:
                continue
            if rank.launcher_id is None:
                agent = ppids.get(top, 0)
                rank.launcher_id = f"{LAUNCHED_ID_PREFIX}pid{agent}-{int(starts.get(agent, 0.0))}"
            out[pid] = rank.launcher_id
        return out

    def _separate_duplicates(self, samples: list[ProcessSample], ppids: Mapping[int, int],
                             starts: Mapping[int, float], errors: list[SampleError]) -> list[ProcessSample]:
        """Two rank processes that claim the same (job, rank) are two jobs, never one: the daemon-wide scanner
        splits the job's ranks by their launcher (parent) into ``JOB@LAUNCHER_PID``; every tick it happens is a
        ``DuplicateRank`` error. Under a root (``launch``) the tree is the job: reported, not split."""
        for key in [k for k in self._split if k[2] is None or starts.get(k[1]) != k[2]]:
            del self._split[key]  # the launcher is gone (or its pid was reused)
        self._dup_warned = {w for w in self._dup_warned if any(p in ppids for p in w[2])}
        claims: dict[tuple[str, int], list[ProcessSample]] = {}
        for s in samples:
            if s.is_rank and s.job is not None and s.job.rank is not None:
                claims.setdefault((s.job.job_id, s.job.rank), []).append(s)
        for (job_id, rank), claim in claims.items():
            if len(claim) < 2:
                continue
            pids = tuple(sorted(c.pid for c in claim))
            launchers = sorted({c.ppid for c in claim})
            if len(launchers) < 2:
                outcome = f"(launcher {launchers[0]}): one launcher, not split"
            elif self.root_pid is not None:
                outcome = f"(launchers {', '.join(map(str, launchers))}): one launched job, not split"
            else:
                outcome = f"(launchers {', '.join(map(str, launchers))}): watched as separate jobs"
                for s in samples:  # every rank of the job goes with its launcher
                    if s.is_rank and s.job is not None and s.job.job_id == job_id:
                        self._split.setdefault((job_id, s.ppid, starts.get(s.ppid)), _split_job_id(job_id, s.ppid))
            where = f"job {job_id} rank {rank} claimed by pids {', '.join(map(str, pids))} {outcome}"
            errors.append(SampleError("DuplicateRank", where))
            if (job_id, rank, pids) not in self._dup_warned:
                self._dup_warned.add((job_id, rank, pids))
                log.warning("%s", where)
        if not self._split:
            return samples
        renamed: dict[int, tuple[str, str]] = {}  # rank pid → (claimed job id, its split id)
        used = set()
        for s in samples:
            if s.is_rank and s.job is not None:
                key = (s.job.job_id, s.ppid, starts.get(s.ppid))
                split = self._split.get(key)
                if split is not None:
                    renamed[s.pid] = (s.job.job_id, split)
                    used.add(key)
        self._split = {k: v for k, v in self._split.items() if k in used}  # launchers whose ranks all ended
        if not renamed:
            return samples
        out = []
        for s in samples:
            new = renamed.get(s.pid)
            if new is None and s.job is not None and not s.is_rank:  # a rank's worker that NVML named
                up, hops = s.ppid, 0
                while up and up not in renamed and hops < 64:
                    up, hops = ppids.get(up, 0), hops + 1
                new = renamed.get(up)
            if new is not None and s.job is not None and s.job.job_id == new[0]:
                s = replace(s, job=replace(s.job, job_id=new[1]))
            out.append(s)
        return out

    def _read(self, pid: int, known: _Known, ppid: int, children: Mapping[int, list[int]],
              starts: Mapping[int, float], errors: list[SampleError]) -> ProcessSample | None:
        proc = known.proc
        try:
            with proc.oneshot():
                status = proc.status()
                cpu = proc.cpu_times()
                rss = proc.memory_info().rss
                if known.cmdline is None and status != psutil.STATUS_ZOMBIE:
                    known.cmdline = tuple(proc.cmdline())  # fixed for the process's life: read once
                cmdline = known.cmdline or ()
                io = _io_bytes(proc)
                wakeups = proc.num_ctx_switches().voluntary  # /proc/PID/status: the main thread's own
        except psutil.ZombieProcess:
            return ProcessSample(pid, known.create_time, ppid, psutil.STATUS_ZOMBIE, 0.0, None, 0, (),
                                 known.identity, exit_status=read_exit_status(pid))
        except psutil.NoSuchProcess:
            return None
        except psutil.AccessDenied:
            errors.append(SampleError("AccessDenied", f"pid {pid}"))
            return None
        cpu_total = cpu.user + cpu.system + cpu.children_user + cpu.children_system
        io_total = io
        stack = list(children.get(pid, ()))
        while stack:  # live descendants (dataloader workers, compile workers) are part of the rank's work
            child = stack.pop()
            stack.extend(children.get(child, ()))
            try:
                cached = self._children.get(child)
                if cached is None or cached[0] != starts.get(child):  # new, or the pid was reused
                    cached = self._children[child] = (starts.get(child), psutil.Process(child))
                c = cached[1]
                ct = c.cpu_times()
                cpu_total += ct.user + ct.system
                cio = _io_bytes(c)
                if io_total is not None and cio is not None:
                    io_total += cio
            except psutil.Error:
                continue
        wchan = read_wchan(pid)
        if known.ray is not None and known.ray.train is not None:
            # Ray Train runs the training function on a thread of its own while the worker's main thread waits for
            # Ray's next task, waking ~100 times a second whatever training does: not the rank's wakeups or wait.
            wakeups, wchan = None, ""
        return ProcessSample(pid=pid, create_time=known.create_time, ppid=ppid, status=status,
                             cpu_time_s=cpu_total, io_bytes=io_total, rss_bytes=rss, cmdline=cmdline,
                             job=known.identity, wakeups=wakeups, wchan=wchan,
                             exit_status=read_exit_status(pid) if status == psutil.STATUS_ZOMBIE else None)


class _MemberLook:
    """A member as the rank sources see it for one look (sample.ranks.member.Member): its Ray facts are read once."""

    def __init__(self, scanner: ProcessScanner, pid: int, known: _Known) -> None:
        self.pid, self.create_time, self.pipe_stem = pid, known.create_time, known.pipe_stem
        self.rank_finder = scanner.rank_finder
        self._scanner, self._known, self._ray_read = scanner, known, False

    @property
    def env_read_at(self) -> float:
        return self._known.env_read_at

    @env_read_at.setter
    def env_read_at(self, value: float) -> None:
        self._known.env_read_at = value

    @property
    def ray(self) -> ray_node.CoreWorker | None:
        return self._known.ray

    @property
    def ray_final(self) -> bool:
        return self._known.ray_checked

    def read_ray(self) -> ray_node.CoreWorker | None:
        if not self._ray_read:
            self._scanner._ray_facts(self.pid, self._known)
            self._ray_read = True
        return self._known.ray

    def keep_ray(self, worker: ray_node.CoreWorker) -> None:
        self._known.ray = worker

    def command(self) -> tuple[str, ...]:
        return self._scanner._command(self._known)


def _settled_out(known: _Known, now: float) -> bool:
    """Out of the group for longer than ranks take to join it, counted from when it became a candidate (a Ray worker
    may idle for minutes before the raylet hands it the actor that joins)."""
    return known.candidate_since is not None and now - known.candidate_since > _JOINS_WITHIN_S


def _back_off(known: _Known, now: float) -> None:
    """The next look at a candidate settled outside the group: later and later, up to MEMBER_RECHECK_MAX_S — whether
    the last look read the TCP table or only found its sockets unchanged (counting only the first kept a Ray node's
    long-lived actors, whose sockets rarely change, looked at every 3 s for good)."""
    known.member_checks += 1
    known.member_next_check = now + min(MEMBER_RECHECK_S * 2 ** known.member_checks, MEMBER_RECHECK_MAX_S)


def _member_above(pid: int, members: set[int], ppids: Mapping[int, int]) -> int | None:
    """The nearest ancestor of ``pid`` among ``members``, or None."""
    up, hops = ppids.get(pid, 0), 0
    while up > 1 and hops < 64:
        if up in members:
            return up
        up, hops = ppids.get(up, 0), hops + 1
    return None


def _rank_launchers(idents: Mapping[int, _Known], ppids: Mapping[int, int]) -> set[int]:
    """srun tasks (a rank from SLURM_PROCID) with a descendant claiming another rank of the same job, or with a
    launcher among their descendants (``srun bash -c 'torchrun …'`` while torchrun's agent waits in its rendezvous,
    before any worker exists): launchers, never ranks themselves. A rank from RANK stays a rank whatever its
    children claim (a rank may start workers of its own with other ranks)."""
    out: set[int] = set()
    for pid, known in idents.items():
        ident = known.identity
        if ident is None or (ident.rank is None and not known.launcher):
            continue
        up, hops = ppids.get(pid, 0), 0
        while up > 1 and hops < 64:
            anc = idents.get(up)
            if anc is not None and anc.slurm_rank and anc.identity is not None \
                    and anc.identity.job_id == ident.job_id and anc.identity != ident:
                out.add(up)
            up, hops = ppids.get(up, 0), hops + 1
    return out


def _split_job_id(job_id: str, launcher: int) -> str:
    """``JOB@LAUNCHER_PID``, cut to fit a job id's 128 characters."""
    suffix = f"@{launcher}"
    return job_id[:MAX_JOB_ID - len(suffix)] + suffix


def read_exit_status(pid: int) -> int | None:
    """A zombie's exit status in waitpid form (/proc/PID/stat field 52, Linux ≥ 3.5), until its parent reaps it."""
    st = proc_stat.read_stat(pid)
    return st.exit_code if st is not None else None


def describe_exit(status: int | None) -> str:
    """``exit code 3`` / ``killed by SIGKILL`` for a waitpid status; ``exit status unknown`` for None."""
    import signal as _signal

    if status is None:
        return "exit status unknown (reaped by its parent before it was sampled)"
    if status & 0x7F:
        try:
            return f"killed by {_signal.Signals(status & 0x7F).name}"
        except ValueError:
            return f"killed by signal {status & 0x7F}"
    return f"exit code {(status >> 8) & 0xFF}"


def read_wchan(pid: int, tid: int | None = None) -> str:
    """The kernel wait channel of a thread (the main thread by default): ``""`` when unreadable."""
    path = f"/proc/{pid}/wchan" if tid is None else f"/proc/{pid}/task/{tid}/wchan"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def read_task_state(pid: int, tid: int) -> str:
    """A thread's scheduler state letter from /proc (``R``, ``S``, ``D`` uninterruptible, ``T`` …): ``""`` when
    unreadable."""
    st = proc_stat.read_stat(pid, tid)
    return st.state if st is not None else ""


def _io_bytes(proc: psutil.Process) -> int | None:
    try:
        io = proc.io_counters()
    except (psutil.AccessDenied, AttributeError):
        return None
    return int(io.read_chars + io.write_chars)  # type: ignore[attr-defined]  # Linux fields


# Also the names the environment component (sample.ranks.environment) gives, as imported from here before.
__all__ = ["JOB_ID_ENV", "MEMBER_RECHECK_S", "PIPE_FILE_ENV", "ProcessScanner", "RankFinder", "command_text",
           "describe_exit", "endpoint_job_id", "identity_from_env", "process_table", "read_exit_status",
           "read_task_state", "read_wchan"]
