"""A job's cgroup (relative to the cgroup root), as a scheduler prolog registers it; re-read every tick: a Slurm
prolog may register it before the job's processes exist."""

from __future__ import annotations

import re
from pathlib import Path

from gpu_watchdog.errors import UsageError

_CGROUP_RE = re.compile(r"^/?[A-Za-z0-9._:@+=-]+(/[A-Za-z0-9._:@+=-]+)*$")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def validate_cgroup(path: str) -> Path:
    if not isinstance(path, str) or not _CGROUP_RE.fullmatch(path) or ".." in path.split("/"):
        raise UsageError(f"invalid cgroup path {path!r}")
    return CGROUP_ROOT / path.lstrip("/")


def cgroup_pids(path: str) -> list[int]:
    try:
        text = (validate_cgroup(path) / "cgroup.procs").read_text()
    except (OSError, UsageError):
        return []
    return [int(x) for x in text.split() if x.isdigit()]
