"""Put a real job's rank processes on the NVML stand-in's fake GPUs, and script what those GPUs show.

    placer = GpuPlacer(state, events_path, n_gpus=4, hung="idle")
    with placer:                       # a thread, until the block ends
        ...                            # run the job (under ``gpu-watchdog launch --backend nvml``)

The thread follows the job's ``--events`` file (tests/jobs/train.py and gpu_watchdog/demo/train.py both write
``{"event": "start", "rank", "pid"}`` once a rank is up and ``{"event": "hang_onset"}`` when the hang
begins). Rank r is placed on GPU ``r % n_gpus`` with ``mem_per_rank`` bytes as an NVML compute process
(``nvmlDeviceGetComputeRunningProcesses``). While the job runs, its GPUs show the ``busy`` profile: high
utilization and power, traffic counters (NVLink 138/139, PCIe 197/198) that rise, per-process utilization
samples. From the moment a ``hang_onset`` event appears they show the ``hung`` profile (default ``idle``:
0 % with the memory still held, counters frozen). A rank whose pid shows up again in a later ``start``
event (a restart) puts the job back to ``busy``. A placed process that exits (or turns zombie) leaves its
GPU, as a real CUDA context would, so the agent's "wait for GPU memory to be released" sees it go.

Profiles are plain dicts of stand-in GPU keys (see docs/nvml-standin.md) plus ``traffic_bps``: the rate at
which the four traffic counters rise (0: frozen; None: leave the ``fields`` alone, e.g. when the test made
them NOT_SUPPORTED). ``set_profile("hung", "spin")`` switches a profile while the job runs;
``override(gpu, "hot")`` pins one GPU to a profile. Other edits of the state while the thread runs go
through ``apply(state.inject_error, …)`` (the thread rewrites the shared document every few ms).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psutil
from harness_loop import HarnessLoop
from nvml_standin import (
    FI_NVLINK_THROUGHPUT_DATA_RX,
    FI_NVLINK_THROUGHPUT_DATA_TX,
    FI_PCIE_COUNT_RX_BYTES,
    FI_PCIE_COUNT_TX_BYTES,
    GIB,
    StandinState,
)

TRAFFIC_FIELDS = (FI_NVLINK_THROUGHPUT_DATA_TX, FI_NVLINK_THROUGHPUT_DATA_RX, FI_PCIE_COUNT_TX_BYTES,
                  FI_PCIE_COUNT_RX_BYTES)

PROFILES: dict[str, dict[str, Any]] = {
    # Real work: compute and communication.
    "busy": {"utilization_gpu": 97, "utilization_memory": 45, "power_mw": 520_000, "traffic_bps": 4e9},
    # Signature A: a host-side hang. Nothing runs, the memory stays held.
    "idle": {"utilization_gpu": 0, "utilization_memory": 0, "power_mw": 75_000, "traffic_bps": 0.0},
    # Signature B: a rank blocked inside an NCCL kernel. Busy-looking at idle power, no traffic.
    "spin": {"utilization_gpu": 100, "utilization_memory": 0, "power_mw": 60_000, "traffic_bps": 0.0},
    # The same utilization with real power and traffic: the GPUs work (a long kernel the host waits on).
    "hot": {"utilization_gpu": 100, "utilization_memory": 30, "power_mw": 560_000, "traffic_bps": 4e9},
    # For GPUs whose power and traffic are NOT_SUPPORTED: only utilization changes.
    "busy_util_only": {"utilization_gpu": 97, "utilization_memory": 45, "traffic_bps": None},
    "idle_util_only": {"utilization_gpu": 0, "utilization_memory": 0, "traffic_bps": None},
}
T = TypeVar("T")
NO_PROCESS = {"utilization_gpu": 0, "utilization_memory": 0, "power_mw": 70_000, "traffic_bps": 0.0}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class GpuPlacer(HarnessLoop):
    """A harness thread that keeps the stand-in's GPUs in step with a real job (see the module doc)."""

    name = "gpu-placer"

    def __init__(self, state: StandinState, events: Path, n_gpus: int, *, mem_per_rank: int = 2 * GIB,
                 busy: str | Mapping[str, Any] = "busy", hung: str | Mapping[str, Any] = "idle",
                 idle: Mapping[str, Any] | None = None, period_s: float = 0.02,
                 process_samples: bool = True) -> None:
        self.state = state
        self.events_path = Path(events)
        self.n_gpus = n_gpus
        self.mem_per_rank = mem_per_rank
        super().__init__(period_s)
        self.process_samples = process_samples
        self._profiles = {"busy": self._resolve(busy), "hung": self._resolve(hung),
                          "none": dict(NO_PROCESS if idle is None else idle)}
        self._overrides: dict[int, dict[str, Any]] = {}  # GPU → profile shown while it has processes
        self._lock = threading.Lock()
        self._offset = 0
        self._partial = b""
        self._rank_pid: dict[int, int] = {}
        self._placed: dict[int, int] = {}  # pid → GPU index
        self.seen_pids: set[int] = set()  # every rank pid ever placed (for cleanup)
        self.last_placed_at = 0.0  # when a rank last appeared on a GPU (wall clock, after the state write)
        self.hung = False
        self.hang_onsets: list[float] = []  # the job's hang_onset times (wall clock, from its events)
        self.hang_shown_at: list[float] = []  # when the GPUs started showing the hung profile
        self.starts = 0  # runs seen (a run = a new set of rank pids)
        self._counters = [0] * n_gpus
        self._last_t = time.time()
        self._last_sample = 0.0
        self._profile_changed = True

    @staticmethod
    def _resolve(p: str | Mapping[str, Any]) -> dict[str, Any]:
        return dict(PROFILES[p]) if isinstance(p, str) else dict(p)

    # -- control from the test -------------------------------------------------------------------------
    def set_profile(self, phase: str, profile: str | Mapping[str, Any]) -> None:
        """Switch the profile of ``phase`` ("busy", "hung" or "none") while the job runs."""
        with self._lock:
            self._profiles[phase] = self._resolve(profile)
            self._profile_changed = True

    def override(self, gpu: int, profile: str | Mapping[str, Any] | None) -> None:
        """Show ``profile`` on one GPU while it has processes, whatever the job does (None: back to normal)."""
        with self._lock:
            if profile is None:
                self._overrides.pop(gpu, None)
            else:
                self._overrides[gpu] = self._resolve(profile)
            self._profile_changed = True

    def apply(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a ``StandinState`` edit (e.g. ``state.inject_error``) while the thread is not writing: the
        state document is one shared dict, so every edit during a run goes through here."""
        with self._lock:
            return fn(*args, **kwargs)

    def placed(self) -> dict[int, int]:
        with self._lock:
            return dict(self._placed)


    # -- the thread --------------------------------------------------------------------------------------
    def _new_events(self) -> list[dict[str, Any]]:
        try:
            with self.events_path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the rest
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


    def tick(self) -> None:
        changed = placed_now = False
        with self._lock:
            for ev in self._new_events():
                if ev.get("event") == "start" and "pid" in ev:
                    rank, pid = int(ev["rank"]), int(ev["pid"])
                    if pid in self.seen_pids:
                        continue
                    old = self._rank_pid.get(rank)
                    if old is not None and self.hung:  # a rank came back: the job was restarted
                        self.hung = False
                    if rank == 0:
                        self.starts += 1
                    self._rank_pid[rank] = pid
                    self.seen_pids.add(pid)
                    gpu = rank % self.n_gpus
                    if old is not None:
                        self.state.gpu(gpu)["processes"][:] = [
                            p for p in self.state.gpu(gpu)["processes"] if p["pid"] != old]
                        self._placed.pop(old, None)
                    self.state.gpu(gpu)["processes"].append({"pid": pid, "used_memory": self.mem_per_rank})
                    self._placed[pid] = gpu
                    placed_now = True
                    changed = True
                elif ev.get("event") == "hang_onset" and not self.hung:
                    self.hung = True
                    self.hang_onsets.append(float(ev["t"]))
                    changed = True
            for pid, gpu in list(self._placed.items()):
                if not _alive(pid):
                    procs = self.state.gpu(gpu)["processes"]
                    procs[:] = [p for p in procs if p["pid"] != pid]
                    self.state.gpu(gpu)["process_samples"][:] = [
                        s for s in self.state.gpu(gpu)["process_samples"] if s["pid"] != pid]
                    del self._placed[pid]
                    changed = True
            changed |= self._profile_changed
            self._profile_changed = False
            now = time.time()
            dt, self._last_t = now - self._last_t, now
            rising = False
            sample_now = self.process_samples and now - self._last_sample >= 0.5
            for gpu in range(self.n_gpus):
                g = self.state.gpu(gpu)
                pids = [p["pid"] for p in g["processes"]]
                prof = self._profiles["none" if not pids else "hung" if self.hung else "busy"]
                if pids and gpu in self._overrides:
                    prof = self._overrides[gpu]
                for key, value in prof.items():
                    if key != "traffic_bps" and g.get(key) != value:
                        g[key] = value
                        changed = True
                used = sum(p["used_memory"] or 0 for p in g["processes"])
                if g.get("memory_used") is not None and g["memory_used"] != used:
                    g["memory_used"] = used
                    changed = True
                rate = prof.get("traffic_bps")
                if rate is not None:
                    if rate > 0:
                        self._counters[gpu] += int(rate * dt)
                        rising = True
                    for fid in TRAFFIC_FIELDS:
                        # NVLink fields count KiB, PCIe fields bytes; both just have to move (or not).
                        value = self._counters[gpu] // (1024 if fid < 190 else 1)
                        if g["fields"].get(str(fid)) != value:
                            g["fields"][str(fid)] = value
                            changed = True
                if sample_now and pids and not self.hung and g.get("utilization_gpu"):
                    ts = int(now * 1e6)
                    g["process_samples"].extend({"pid": pid, "sm_util": g["utilization_gpu"], "mem_util": 10,
                                                 "enc_util": 0, "dec_util": 0, "timestamp_us": ts} for pid in pids)
                    del g["process_samples"][:-2 * len(pids)]
                    changed = True
            if sample_now:
                self._last_sample = now
            if changed or rising:
                self.state.write()
                if placed_now:
                    self.last_placed_at = time.time()
                if self.hung and len(self.hang_shown_at) < len(self.hang_onsets):
                    self.hang_shown_at.append(time.time())
