"""Why a straggler is slow, where its node can see it: its cgroup's CPU throttling and memory pressure, its input,
its GPU's clock slowdown reasons, SM clock and PCIe link (standard library and the node's NVML sample only).

A cause is named only with its figure; none found is said as such (a slow rank with no visible cause is still
named: the cause may be on another node, in the job's own code, or in a GPU whose NVML tells nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpu_watchdog.model import DeviceSample
from gpu_watchdog.sample.nvml import clock_slowdowns

CPU_THROTTLED_MIN_SHARE = 0.05  # of the window's wall time spent throttled by the cgroup's CPU quota
INPUT_MIN_SHARE = 0.3  # of its samples spent waiting for input: its data loader (or storage) is what it waits on
MEMORY_PRESSURE_MIN_AVG60 = 10.0  # % of the last minute some of the cgroup's tasks stalled on memory
SM_CLOCK_BELOW_MAX = 0.9
# Of the time it wanted a CPU (running or runnable), the share it waited for one — at least this, and this many
# times its peers' share: the CPUs where it runs are oversubscribed (a noisy neighbour, too many ranks or loader
# workers on them). Its peers' share must be measured (they wanted a CPU a little of the time at least).
CONTENTION_MIN_SHARE = 0.5
CONTENTION_RATIO = 2.0
CONTENTION_MIN_DEMAND = 0.05
# On a CPU (or its GPU at work) this many times its peers' median share, with no cause on its node: it does more
# per step than they do — its work (uneven shards, a heavier pipeline stage), not its machine.
WORK_RATIO = 1.25
NODE_CAUSES = frozenset({"cpu_throttled", "cpu_contention", "memory_pressure", "input", "gpu_clocks", "pcie"})


@dataclass(frozen=True)
class Cause:
    kind: str  # cpu_throttled | cpu_contention | memory_pressure | input | gpu_clocks | pcie
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "detail": self.detail}


@dataclass(frozen=True)
class HostCounters:
    """What a rank's host side counts, read at one round (cumulative)."""

    throttled_s: float | None = None  # its cgroup's time throttled by the CPU quota
    pcie_replays: int | None = None  # its GPU's PCIe replay counter


def _mountpoints() -> tuple[str | None, str | None]:
    """(the cgroup v1 mount holding the cpu controller, the cgroup v2 mount) of this machine."""
    v1 = v2 = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, fs = left.split(), right.split()
        if len(parts) < 5 or len(fs) < 3:
            continue
        if fs[0] == "cgroup" and "cpu" in fs[2].split(",") and v1 is None:
            v1 = parts[4]
        elif fs[0] == "cgroup2" and v2 is None:
            v2 = parts[4]
    return v1, v2


def cgroup_dirs(pid: int) -> tuple[str | None, str | None]:
    """(the cpu controller's directory of ``pid``'s cgroup, its cgroup v2 directory), each None when unknown."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    v1_mount, v2_mount = _mountpoints()
    cpu = unified = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and v2_mount is not None:
            unified = os.path.join(v2_mount, path.lstrip("/"))
        elif "cpu" in controllers.split(",") and v1_mount is not None:
            cpu = os.path.join(v1_mount, path.lstrip("/"))
    return cpu or unified, unified


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def throttled_seconds(cpu_dir: str | None) -> float | None:
    """The cgroup's cumulative time throttled by its CPU quota: v2 ``throttled_usec``, v1 ``throttled_time`` (ns)."""
    text = _read(os.path.join(cpu_dir, "cpu.stat")) if cpu_dir else None
    if text is None:
        return None
    stat = dict(line.split(None, 1) for line in text.splitlines() if " " in line)
    if "throttled_usec" in stat:
        return int(stat["throttled_usec"]) / 1e6
    if "throttled_time" in stat:
        return int(stat["throttled_time"]) / 1e9
    return None


def cpu_quota(cpu_dir: str | None) -> float | None:
    """The cgroup's CPU quota in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``); None: none."""
    if not cpu_dir:
        return None
    text = _read(os.path.join(cpu_dir, "cpu.max"))
    if text is not None:
        parts = text.split()
        return None if len(parts) < 2 or parts[0] == "max" else int(parts[0]) / int(parts[1])
    quota_text, period_text = _read(os.path.join(cpu_dir, "cpu.cfs_quota_us")), _read(
        os.path.join(cpu_dir, "cpu.cfs_period_us"))
    if quota_text is None or period_text is None or int(quota_text) < 0:
        return None
    return int(quota_text) / int(period_text)


def memory_pressure(unified_dir: str | None) -> float | None:
    """``some avg60`` of the cgroup's memory.pressure (cgroup v2 with PSI), in %."""
    text = _read(os.path.join(unified_dir, "memory.pressure")) if unified_dir else None
    for line in (text or "").splitlines():
        if line.startswith("some "):
            for kv in line.split()[1:]:
                k, _, v = kv.partition("=")
                if k == "avg60":
                    return float(v)
    return None


def host_counters(pid: int, device: DeviceSample | None) -> HostCounters:
    cpu_dir, _ = cgroup_dirs(pid)
    return HostCounters(throttled_s=throttled_seconds(cpu_dir),
                        pcie_replays=device.pcie_replay_total if device is not None else None)


def find_causes(pid: int, input_share: float, device: DeviceSample | None, first: HostCounters | None,
                last: HostCounters | None, span_s: float) -> list[Cause]:
    """Every cause visible for the rank ``pid`` over a window of ``span_s`` seconds (``first``/``last``: its
    counters at the window's first and last rounds)."""
    out: list[Cause] = []
    cpu_dir, unified = cgroup_dirs(pid)
    if first is not None and last is not None and first.throttled_s is not None and last.throttled_s is not None \
            and span_s > 0:
        share = (last.throttled_s - first.throttled_s) / span_s
        if share >= CPU_THROTTLED_MIN_SHARE:
            quota = cpu_quota(cpu_dir)
            limit = f", quota {quota:.2g} of a core" if quota is not None else ""
            out.append(Cause("cpu_throttled", f"CPU throttled by its cgroup {share:.0%} of the time{limit}"))
    pressure = memory_pressure(unified)
    if pressure is not None and pressure >= MEMORY_PRESSURE_MIN_AVG60:
        out.append(Cause("memory_pressure", f"memory pressure: its cgroup's tasks stalled {pressure:.0f}% of the "
                                            "last minute"))
    if input_share >= INPUT_MIN_SHARE:
        out.append(Cause("input", f"input: waiting for its data (data loader, storage) in {input_share:.0%} of its "
                                  "samples"))
    if device is not None:
        out.extend(_gpu_causes(device, first, last))
    return out


def _gpu_causes(dev: DeviceSample, first: HostCounters | None, last: HostCounters | None) -> list[Cause]:
    out = []
    reasons = clock_slowdowns(dev)
    clock = dev.sm_clock_mhz
    top = dev.sm_clock_max_mhz
    if reasons or (clock is not None and top and clock < SM_CLOCK_BELOW_MAX * top):
        speed = f", SM clock {clock:.0f} of {top:.0f} MHz" if clock is not None and top else ""
        why = ", ".join(reasons) if reasons else "no reason reported"
        out.append(Cause("gpu_clocks", f"GPU {dev.index} ({dev.uuid}) clocks slowed: {why}{speed}"))
    if first is not None and last is not None and first.pcie_replays is not None and last.pcie_replays is not None \
            and last.pcie_replays > first.pcie_replays:
        out.append(Cause("pcie", f"GPU {dev.index} PCIe replays: {last.pcie_replays - first.pcie_replays} in the "
                                 "window"))
    gen, width = dev.pcie_link_gen, dev.pcie_link_width
    gen_max, width_max = dev.pcie_link_gen_max, dev.pcie_link_width_max
    if gen is not None and width is not None and gen_max and width_max and (gen < gen_max or width < width_max) \
            and (dev.util_percent or 0) > 0:  # an idle GPU lowers its link on purpose
        out.append(Cause("pcie", f"GPU {dev.index} PCIe link at gen {gen} x{width}, below its gen {gen_max} "
                                 f"x{width_max}"))
    return out


def contention(running: float, queued: float, peer_running: float, peer_queued: float) -> Cause | None:
    """The rank waited for a CPU far more of the time it wanted one than its peers did (the cheap signal's shares
    over the window)."""
    if running + queued < CONTENTION_MIN_DEMAND or peer_running + peer_queued < CONTENTION_MIN_DEMAND:
        return None
    unserved, peers = queued / (running + queued), peer_queued / (peer_running + peer_queued)
    if unserved >= CONTENTION_MIN_SHARE and unserved >= CONTENTION_RATIO * peers:
        return Cause("cpu_contention", f"waiting for a CPU {unserved:.0%} of the time it wanted one (its peers "
                                       f"{peers:.0%}): the CPUs where it runs are oversubscribed")
    return None


def origin(causes: list[Cause], busy: float, peer_busy: float) -> str:
    """"node" when its node shows a cause; "work" when none does and it is at work (``busy``: its share on a CPU
    or its GPU at work) far more than its peers — it does more per step; else "unknown"."""
    if any(c.kind in NODE_CAUSES for c in causes):
        return "node"
    if busy > 0 and busy >= WORK_RATIO * peer_busy:
        return "work"
    return "unknown"
