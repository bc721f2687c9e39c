"""The one reader of ``/proc/PID/stat`` (and ``/proc/PID/task/TID/stat``): standard library only, the proc root
passed in (a test's fake tree, a container's mount), an unreadable or vanished process answered with None, never
an exception. Every module that needs a process's state, parent, session, start time or exit code reads it here.

Format (proc(5)): ``pid (comm) state ppid pgrp session … starttime …``; ``comm`` may hold spaces and parentheses,
so fields are counted from the last ``)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PROC = "/proc"
_READ = 4096  # a stat line is a few hundred bytes


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    state: str  # field 3: R running or runnable, S sleeping, D uninterruptible, T stopped, Z zombie, …
    ppid: int  # field 4
    sid: int  # field 6: the session
    start: float  # field 22: clock ticks since boot; with the pid, the process's identity (pid reuse)
    exit_code: int | None  # field 52 (Linux ≥ 3.5): a zombie's exit status in waitpid form


def parse(pid: int, data: bytes) -> ProcStat | None:
    """One stat line, or None when it is cut short or malformed."""
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return ProcStat(pid, fields[0].decode(), int(fields[1]), int(fields[3]), float(fields[19]),
                        int(fields[49]) if len(fields) > 49 else None)
    except (IndexError, ValueError):
        return None


def read_stat(pid: int | str, tid: int | str | None = None, root: str = PROC) -> ProcStat | None:
    """Process ``pid`` (or its thread ``tid``); None when it cannot be read (gone, no such thread)."""
    path = f"{root}/{pid}/stat" if tid is None else f"{root}/{pid}/task/{tid}/stat"
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.read(fd, _READ)
        finally:
            os.close(fd)
    except OSError:
        return None
    return parse(int(pid), data)


def scan(root: str = PROC) -> dict[int, ProcStat]:
    """Every process under ``root`` now (one read of each stat file); those gone meanwhile are left out."""
    out: dict[int, ProcStat] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        if name.isdigit() and (st := read_stat(name, root=root)) is not None:
            out[st.pid] = st
    return out


def threads(pid: int, root: str = PROC) -> list[int]:
    """The thread ids of ``pid`` ([] when it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"{root}/{pid}/task") if t.isdigit()]
    except OSError:
        return []
