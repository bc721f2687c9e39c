"""Process state through psutil: rank discovery, job identity from the environment, tree CPU and I/O.

A process's environment is read once per (pid, create_time) and cached; a reused pid gets a fresh read, and a
process without a rank of its own is read again each tick for its first 30 s (it may still exec into one).
Vanished, zombie and access-denied processes are recorded or skipped, never raised out of a tick.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import psutil

from gpu_watchdog.model import JobIdentity, ProcessSample, SampleError

# The launcher sets this in the job's environment; it wins over scheduler-given ids.
JOB_ID_ENV = "GPU_WATCHDOG_JOB_ID"
_JOB_ID_SOURCES = (JOB_ID_ENV, "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
_RANK_SOURCES = ("RANK", "SLURM_PROCID")
_REREAD_YOUNG_S = 30.0  # how long after its start a process without a rank of its own is read again (exec)


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def identity_from_env(env: Mapping[str, str]) -> JobIdentity | None:
    """The job identity a process carries in its environment, or None when it is not a rank of a job."""
    rank = next((_int_or_none(env.get(k)) for k in _RANK_SOURCES if env.get(k) is not None), None)
    job_id = next((env[k] for k in _JOB_ID_SOURCES if env.get(k)), None)
    if rank is None and job_id is None:
        return None
    return JobIdentity(
        job_id=job_id or "unknown",
        rank=rank,
        local_rank=_int_or_none(env.get("LOCAL_RANK", env.get("SLURM_LOCALID"))),
        world_size=_int_or_none(env.get("WORLD_SIZE", env.get("SLURM_NTASKS"))),
    )


@dataclass
class _Known:
    proc: psutil.Process
    create_time: float
    identity: JobIdentity | None
    env: Mapping[str, str] = field(default_factory=dict)
    start: float = 0.0  # the process table's start token when this entry was made (see _process_table)
    cmdline: tuple[str, ...] | None = None  # read once, on first use


_LINUX = sys.platform.startswith("linux")


def _process_table() -> dict[int, tuple[int, float]]:
    """pid → (ppid, start token) for every process on the node; the token changes when a pid is reused.

    Linux: one read of /proc/PID/stat per process (token: its start time in clock ticks). psutil's
    ``process_iter(["ppid"])`` costs about three file reads per process and was most of a tick's CPU.
    Elsewhere: psutil, with the create time as the token.
    """
    if not _LINUX:
        return {p.pid: (p.info["ppid"] or 0, p.info["create_time"] or 0.0)
                for p in psutil.process_iter(["ppid", "create_time"])}
    out: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
            try:
                data = os.read(fd, 4096)
            finally:
                os.close(fd)
            # "pid (comm) state ppid ... starttime ...": comm may hold spaces and parentheses.
            rest = data[data.rfind(b")") + 2:].split(b" ", 21)
            out[int(name)] = (int(rest[1]), float(rest[19]))
        except (OSError, IndexError, ValueError):
            continue  # gone between the listing and the read
    return out


class ProcessScanner:
    """Finds rank processes and reads their state once per tick.

    Scope: with ``root_pid`` only that process and its descendants are considered (the launcher's job);
    otherwise every process on the node whose environment names a rank (the daemon). ``extra_pids`` adds
    processes named by someone else (NVML's compute processes, scheduler registrations).
    """

    def __init__(self, root_pid: int | None = None, env_filter: Iterable[str] = ()) -> None:
        self.root_pid = root_pid
        self._known: dict[int, _Known | None] = {}  # pid → cached process, None = not ours / unreadable
        self._children: dict[int, tuple[float | None, psutil.Process]] = {}  # rank descendants: (start, handle)
        self._keep_env = tuple(env_filter)  # env keys kept for consistency checks

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
        elif pid in self._known:
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
            return known  # one that exited young keeps what it showed alive (a zombie rank is still a rank)
        ident = identity_from_env(env)
        kept = {k: v for k, v in env.items() if k.startswith(self._keep_env)} if self._keep_env else {}
        known = _Known(proc, ctime, ident, kept, start if start is not None else 0.0)
        self._known[pid] = known
        return known

    def _settled(self, known: _Known, ppid: int) -> bool:
        """Has this process shown its own rank? A fork carries its parent's environment until it execs the
        real program (torchrun's workers, wrapper scripts): no RANK, or only the job id (under `launch`),
        or the parent's very identity (torchrun under Slurm: the srun task's SLURM_PROCID). Until it shows
        a rank of its own, a young process is read again every tick."""
        ident = known.identity
        if ident is None or ident.rank is None:
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

    def sample(self, extra_pids: Iterable[int] = ()) -> tuple[tuple[ProcessSample, ...], list[SampleError]]:
        """One read of every rank process in scope (plus ``extra_pids``), with tree-aggregated counters."""
        errors: list[SampleError] = []
        table = _process_table()
        ppids = {pid: v[0] for pid, v in table.items()}
        starts = {pid: v[1] for pid, v in table.items()}
        # Forget vanished pids so the cache stays bounded.
        for cache in (self._known, self._children):
            for pid in [p for p in cache if p not in ppids]:
                del cache[pid]
        scope = self._in_scope(ppids)
        extra = {p for p in extra_pids if p in ppids}
        idents: dict[int, _Known] = {}
        for pid in scope | extra:
            known = self._lookup(pid, starts.get(pid), ppids.get(pid, 0), errors)
            if known is not None and (known.identity is not None or pid in extra):
                idents[pid] = known
        children = self._tree(ppids)
        samples = []
        for pid, known in idents.items():
            parent = idents.get(ppids.get(pid, 0))
            # A dataloader worker inherits RANK: only the topmost process of a (job, rank) is the rank.
            is_rank = known.identity is not None and known.identity.rank is not None and not (
                parent is not None and parent.identity == known.identity)
            if not is_rank and pid not in extra:
                continue
            s = self._read(pid, known, ppids.get(pid, 0), children, starts, errors)
            if s is not None:
                samples.append(replace(s, is_rank=is_rank))
        samples.sort(key=lambda s: (s.job.job_id if s.job else "", s.job.rank if s.job and s.job.rank is not None
                                    else -1, s.pid))
        return tuple(samples), errors

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
        except psutil.ZombieProcess:
            return ProcessSample(pid, known.create_time, ppid, psutil.STATUS_ZOMBIE, 0.0, None, 0, (),
                                 known.identity)
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
        return ProcessSample(pid=pid, create_time=known.create_time, ppid=ppid, status=status,
                             cpu_time_s=cpu_total, io_bytes=io_total, rss_bytes=rss, cmdline=cmdline,
                             job=known.identity)


def _io_bytes(proc: psutil.Process) -> int | None:
    try:
        io = proc.io_counters()
    except (psutil.AccessDenied, AttributeError):
        return None
    return int(io.read_chars + io.write_chars)  # type: ignore[attr-defined]  # Linux fields
