"""A CPU quota on chosen processes, as a noisy neighbour or a throttled container gives one (test code only): a
fresh cgroup with the cpu controller — cgroup v2's ``cpu.max`` where the unified hierarchy has the controller, else
cgroup v1's ``cpu.cfs_quota_us`` — the processes moved into it, and moved back out and the group removed after.
Needs root (CI runs as root); without a writable cpu controller the test fails, naming why."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

PERIOD_US = 100_000


def _cpu_root() -> tuple[Path, int]:
    """(the hierarchy holding the cpu controller, its cgroup version)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        parts, fs = left.split(), right.split()
        if len(fs) >= 3 and fs[0] == "cgroup" and "cpu" in fs[2].split(","):
            return Path(parts[4]), 1
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        parts, fs = left.split(), right.split()
        if fs and fs[0] == "cgroup2" and "cpu" in (Path(parts[4]) / "cgroup.controllers").read_text().split():
            return Path(parts[4]), 2
    raise RuntimeError("no cgroup hierarchy with the cpu controller is mounted: cannot throttle a process")


@contextlib.contextmanager
def cpu_quota(pids: Iterable[int], cores: float) -> Iterator[Path]:
    """Hold ``pids`` to ``cores`` of CPU time (0.15: 15 ms per 100 ms) until the block ends."""
    root, version = _cpu_root()
    group = root / f"gw-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    group.mkdir()
    try:
        quota = str(int(cores * PERIOD_US))
        if version == 2:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(quota)
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()
