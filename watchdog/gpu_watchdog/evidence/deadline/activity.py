"""What a waited-on rank does during a wait, from ``/proc`` (cheap: two small reads and a directory listing): the
bytes its process read and wrote (``rchar``/``wchar``: what it handed to read(2)/write(2), storage or not) and the
file it is writing — of its files open for writing, the one furthest along (``fdinfo``'s ``pos``), a checkpoint
being saved. Compared over the wait: "writing 96.0 MiB at 0.50 MiB/s to /ckpt/step-20.pt"."""

from __future__ import annotations

import os
from dataclasses import dataclass

MIB = 1 << 20
_ACCESS_MODE = 0o3  # fdinfo "flags" (octal): O_WRONLY 1, O_RDWR 2


@dataclass(frozen=True)
class IoSnapshot:
    t: float  # unix seconds
    read_bytes: int
    written_bytes: int
    writing: str | None = None  # the regular file open for writing with the largest position
    writing_pos: int = 0


def snapshot(pid: int, t: float, proc: str = "/proc") -> IoSnapshot | None:
    """The process's I/O counters and the file it writes now; None when it is gone or unreadable."""
    try:
        with open(f"{proc}/{pid}/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        read, written = int(fields["rchar"]), int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None
    path, pos = _file_being_written(pid, proc)
    return IoSnapshot(t, read, written, path, pos)


def _file_being_written(pid: int, proc: str) -> tuple[str | None, int]:
    best: tuple[int, str] | None = None
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return None, 0
    for fd in fds:
        try:
            target = os.readlink(f"{proc}/{pid}/fd/{fd}")
            if not target.startswith("/") or target.startswith(("/dev/", "/proc/", "/sys/")):
                continue  # pipes, sockets, devices: not a file being saved
            with open(f"{proc}/{pid}/fdinfo/{fd}") as f:
                info = dict(line.split(":", 1) for line in f if ":" in line)
            if not int(info["flags"].strip(), 8) & _ACCESS_MODE:
                continue
            pos = int(info["pos"])
        except (OSError, KeyError, ValueError):
            continue
        if best is None or pos > best[0]:
            best = (pos, target.removesuffix(" (deleted)"))
    return (best[1], best[0]) if best else (None, 0)


def describe(before: IoSnapshot | None, after: IoSnapshot | None) -> str:
    """What the process did between two snapshots: "writing 96.0 MiB at 0.50 MiB/s to /ckpt/x.pt", "reading …",
    or "" when it moved no bytes (or a snapshot is missing)."""
    if before is None or after is None or after.t <= before.t:
        return ""
    span = after.t - before.t
    written, read = after.written_bytes - before.written_bytes, after.read_bytes - before.read_bytes
    parts = []
    if written > 0:
        to = f" to {after.writing}" if after.writing else ""
        parts.append(f"writing {written / MIB:.1f} MiB at {written / MIB / span:.2f} MiB/s{to}")
    if read > 0:
        parts.append(f"reading {read / MIB:.1f} MiB at {read / MIB / span:.2f} MiB/s")
    return ", ".join(parts)
