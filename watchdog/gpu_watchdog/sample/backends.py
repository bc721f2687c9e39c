"""Sampling backends behind one interface: ``sample() -> NodeSample``, one call per tick.

- ``nvml``: real GPUs through gpu_watchdog.sample.nvml, plus psutil state of every process NVML reports, plus the
  Xid events gpu_watchdog.sample.xid queued since the last tick (attached as ``DeviceSample.fault``). A faulted GPU
  that no longer lists its processes (lost) keeps the ones seen on it last, so its jobs stay known.
- ``proc``: no GPU; every rank process becomes a virtual device (utilization = its process tree's CPU %
  over the interval, memory = RSS). This is how CPU/gloo jobs, the demo and the end-to-end tests run.
- ``auto``: nvml when NVML initialises and sees a GPU, else proc; ``choose_backend`` says which and why.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

from gpu_watchdog.config.schema import DetectConfig, FaultsConfig
from gpu_watchdog.errors import BackendUnavailable, UsageError
from gpu_watchdog.model import DeviceSample, GpuProcess, NodeSample
from gpu_watchdog.sample.nvml import NvmlReader
from gpu_watchdog.sample.processes import ProcessScanner

BACKENDS = ("auto", "nvml", "proc")
log = logging.getLogger("gpu_watchdog.sample.backends")


class Backend(Protocol):
    name: str

    def sample(self) -> NodeSample: ...

    def close(self) -> None: ...


class ProcBackend:
    name = "proc"

    def __init__(self, scanner: ProcessScanner, hostname: str, clock: Any = time.time,
                 extra_pids: Any = None, min_window_s: float = DetectConfig.progress_min_window_s,
                 monotonic: Any = time.monotonic) -> None:
        self.scanner = scanner
        self.hostname = hostname
        self._clock = clock  # the sample's time stamp (wall clock, for records)
        self._monotonic = monotonic  # rate windows: a wall-clock step (NTP, an admin) must not distort them
        self._extra_pids = extra_pids or (lambda: ())
        # CPU time moves in 10 ms clock ticks: over the few tens of ms between a tick and the early one that
        # follows a stack dump, one clock tick reads as 25 % "busy" and restarts a stall's streak. A window
        # shorter than this keeps the previous baseline and value (as the detector does for rank progress).
        self.min_window_s = min_window_s
        self._prev: dict[tuple[int, float], tuple[float, float, float | None]] = {}  # → (mono, cpu_time_s, util)

    def sample(self) -> NodeSample:
        t = self._clock()
        now = self._monotonic()
        procs, errors = self.scanner.sample(self._extra_pids())
        devices = []
        prev, self._prev = self._prev, {}
        for i, p in enumerate(p for p in procs if p.is_rank):
            key = (p.pid, p.create_time)
            util = None
            if key in prev and now - prev[key][0] < self.min_window_s:
                self._prev[key] = prev[key]
                util = prev[key][2]
            else:
                if key in prev and now > prev[key][0]:
                    util = min(100.0, max(0.0, 100.0 * (p.cpu_time_s - prev[key][1]) / (now - prev[key][0])))
                self._prev[key] = (now, p.cpu_time_s, util)
            job = p.job.job_id if p.job else "unknown"
            rank = p.job.rank if p.job else None
            devices.append(DeviceSample(
                index=i, uuid=f"proc-{job}-r{rank}", name=f"rank {rank} (pid {p.pid})",
                util_percent=util, mem_used_bytes=p.rss_bytes,
                processes=(GpuProcess(p.pid, p.rss_bytes, util),), virtual=True,
            ))
        return NodeSample(t=t, hostname=self.hostname, backend=self.name, devices=tuple(devices),
                          processes=procs, errors=tuple(errors))

    def close(self) -> None:
        pass


class NvmlBackend:
    name = "nvml"

    def __init__(self, reader: NvmlReader, scanner: ProcessScanner, hostname: str, clock: Any = time.time,
                 extra_pids: Any = None, xids: Any = None) -> None:
        self.reader = reader
        self.scanner = scanner
        self.hostname = hostname
        self._clock = clock
        self._extra_pids = extra_pids or (lambda: ())
        self.xids = xids  # a started gpu_watchdog.sample.xid.XidWatcher, or None
        self._last_procs: dict[str, tuple[GpuProcess, ...]] = {}
        self._told_unsupported: dict[str, tuple[str, ...]] = {}  # uuid → the list last logged

    def sample(self) -> NodeSample:
        from gpu_watchdog.sample.xid import attach_faults

        t = self._clock()
        devices, errors = self.reader.read_all()
        self._tell_unsupported(devices)
        if self.xids is not None:
            faults, xerrors = self.xids.drain()
            devices, errors = attach_faults(devices, faults), errors + xerrors
        devices = [self._keep_processes(d) for d in devices]
        gpu_pids = {p.pid for d in devices for p in d.processes}
        procs, perrors = self.scanner.sample(gpu_pids | set(self._extra_pids()), gpu_pids)
        return NodeSample(t=t, hostname=self.hostname, backend=self.name, devices=tuple(devices),
                          processes=procs, errors=tuple(errors + perrors))

    def _keep_processes(self, d: DeviceSample) -> DeviceSample:
        if d.fault is not None and not d.processes:
            return replace(d, processes=self._last_procs.get(d.uuid, ()))
        self._last_procs[d.uuid] = d.processes
        return d

    def _tell_unsupported(self, devices: Iterable[DeviceSample]) -> None:
        """One log line per GPU (again only when the list changes) naming what NVML cannot read there."""
        for d in devices:
            if d.unsupported and self._told_unsupported.get(d.uuid) != d.unsupported:
                self._told_unsupported[d.uuid] = d.unsupported
                effect = ("; without power the NCCL-spin signature cannot be recognised"
                          if {"power", "power_limit"} & set(d.unsupported) else "")
                log.warning("GPU %d (%s, %s): not supported by NVML here: %s; detection uses the rest%s",
                            d.index, d.name, d.uuid, ", ".join(d.unsupported), effect)

    def close(self) -> None:
        if self.xids is not None:
            self.xids.stop()
        self.reader.shutdown()


def choose_backend(name: str, *, root_pid: int | None = None, hostname: str = "",
                   extra_pids: Iterable[int] | Any = None, nvml_lib: Any = None,
                   env_filter: Iterable[str] = (), faults: FaultsConfig | None = None,
                   min_window_s: float = DetectConfig.progress_min_window_s,
                   member_pool: Callable[[], Iterable[int]] = tuple) -> tuple[Backend, str]:
    """Build the named backend; returns it and a one-line reason (``auto`` says what it picked and why).
    The nvml backend also watches Xid events unless ``faults.xid_events`` is false; the proc backend
    measures CPU rates over windows of at least ``min_window_s`` (detect.progress_min_window_s).
    ``member_pool``: without a ``root_pid``, the processes whose process-group membership is looked at for ranks
    set in code (ProcessScanner)."""
    if name not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    host = hostname or socket.gethostname()
    scanner = ProcessScanner(root_pid=root_pid, env_filter=env_filter, member_pool=member_pool)
    extra = extra_pids if callable(extra_pids) else (lambda: tuple(extra_pids or ()))

    def proc(why: str) -> tuple[Backend, str]:
        return ProcBackend(scanner, host, extra_pids=extra, min_window_s=min_window_s), f"proc backend ({why})"

    if name == "proc":
        return proc("requested")
    reader = NvmlReader(nvml_lib)
    try:
        count = reader.start()
    except BackendUnavailable as e:
        if name == "nvml":
            raise
        return proc(str(e))
    if count == 0:
        if name == "nvml":
            reader.shutdown()
            raise BackendUnavailable("NVML started but sees no GPU")
        reader.shutdown()
        return proc("NVML sees no GPU")
    why = "requested" if name == "nvml" else f"NVML sees {count} GPU(s), driver {reader.driver_version}"
    fc = faults or FaultsConfig()
    xids = None
    if fc.xid_events:
        from gpu_watchdog.sample.xid import start_watcher

        xids, note = start_watcher(reader, wait_ms=fc.event_wait_ms, application_xids=fc.application_xids)
        why += f"; {note}"
    return NvmlBackend(reader, scanner, host, extra_pids=extra, xids=xids), f"nvml backend ({why})"


def gpu_memory_holders(backend: Backend) -> Callable[[], set[int]] | None:
    """The pids holding GPU memory now, read through NVML (for the wait until a stopped job's memory is free);
    None on a backend without GPUs."""
    reader = getattr(backend, "reader", None)
    if reader is None:
        return None
    return lambda: {p.pid for d in reader.read_all()[0] for p in d.processes}
