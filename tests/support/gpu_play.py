"""Play, on the NVML stand-in's fake GPUs, what a real H200 showed while an NCCL job ran and hung — driven by the state
of a running tests/jobs/nccl_like.py.

    play = GpuPlay(nvml_standin.state, state_dir, n_gpus=1)
    with play:                          # a thread, until the block ends
        ...                             # run the job (under ``gpu-watchdog launch --backend nvml``)

Every ``period_s`` (0.5 s) the thread reads the job's per-rank state files (``$NCCL_LIKE_STATE_DIR``, see
nccl_like_state.py), lists every live rank process on GPU ``local_rank % n_gpus`` as an NVML compute process holding
``mem_per_rank`` (2 GiB), drops the ones that exited (a CUDA context goes with its process), and rewrites the stand-in
state once. Each GPU with ranks shows one profile, chosen from what its ranks do (shared/real-gpu/README.md):

``spin``      a rank on it waits in the device sync (its collective launched, not complete) and no collective of the
              job completed for ``frozen_after_s``: utilization 100 %, memory controller 0 %, power 17 % of the 700 W
              limit, PCIe counters growing by ~117 MiB/s of NCCL polling (tx 37, rx 80 MiB/s), per-process
              utilization 100 % for the waiting ranks. That is the NCCL hang *and* the healthy slow phase of a peer
              (a checkpoint save): on the GPU they look the same.
``transfer``  a rank waits on a big collective (≥ ``big_bytes`` pending) and collectives complete: utilization swinging
              8–100 %, memory controller 5–25 %, power still 17 %, PCIe 1–3 GiB/s (the H200's 256 MiB all-reduces).
``busy``      training: utilization 60–100 %, memory controller 30–60 %, power 60–90 %, PCIe 1–3 GiB/s.
``idle``      every rank on it is out of kernels (blocked in its own code, stopped, saving, done): 0 %, memory held,
              power 11 %, counters frozen.
``none``      no rank on it: 0 %, 70 W, counters frozen.

The PCIe byte counters (field values 197/198) are reported modulo 2^32, as NVML's wrap; on entering ``spin`` the rx
counter is moved (one burst, like the last bytes of the step) to ``wrap_in_spin_s`` of polling below the wrap, so
every hang shows a wrap while it spins. NVLink counters (138/139) are NOT_SUPPORTED, as on that H200 (socket
transport, one GPU). With ``n_gpus=1`` every rank shares GPU 0, as in the real captures (their sums).

``history`` keeps (wall time, profile per GPU) of every tick; ``shown_at(profile)`` the first time a GPU showed it.
Other edits of the stand-in state while the thread runs go through ``apply(fn, ...)``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from harness_loop import HarnessLoop
from nccl_like_state import ALIVE, DEAD, RankView, read_ranks
from nvml_standin import (
    FI_NVLINK_THROUGHPUT_DATA_RX,
    FI_NVLINK_THROUGHPUT_DATA_TX,
    FI_PCIE_COUNT_RX_BYTES,
    FI_PCIE_COUNT_TX_BYTES,
    GIB,
    SCALAR_KEYS,
    StandinState,
)

T = TypeVar("T")
MIB = 1 << 20
WRAP = 1 << 32
H200: dict[str, Any] = {
    "name": "NVIDIA H200", "memory_total": 143771 * MIB, "power_limit_mw": 700_000, "clock_sm_mhz": 1980,
    "clock_graphics_mhz": 1980, "temperature_c": 33,
}
LINK = {"pcie_link_gen_current": 5, "pcie_link_gen_max": 5, "pcie_link_width_current": 16,
        "pcie_link_width_max": 16}
SPIN_TX_BPS, SPIN_RX_BPS = 37 * MIB, 80 * MIB  # measured: NCCL's polling over the socket transport
SYNC, COMPUTE = "sync", ("compute", "init")


class GpuPlay(HarnessLoop):
    """A harness thread that plays the H200's NVML readings for a running nccl_like.py job (see the module doc)."""

    name = "gpu-play"

    def __init__(self, state: StandinState, state_dir: Path, n_gpus: int = 1, *, period_s: float = 0.5,
                 mem_per_rank: int = 2 * GIB, frozen_after_s: float = 1.0, big_bytes: int = 4 * MIB,
                 wrap_in_spin_s: float | None = 2.0, seed: int = 0) -> None:
        self.state = state
        self.state_dir = Path(state_dir)
        self.n_gpus = n_gpus
        super().__init__(period_s)
        self.mem_per_rank = mem_per_rank
        self.frozen_after_s = frozen_after_s
        self.big_bytes = big_bytes
        self.wrap_in_spin_s = wrap_in_spin_s
        self.rng = random.Random(seed)
        self.limit_w = H200["power_limit_mw"] / 1000
        self._lock = threading.Lock()
        self._tx = [self.rng.randrange(WRAP) for _ in range(n_gpus)]  # unwrapped byte counters
        self._rx = [self.rng.randrange(WRAP) for _ in range(n_gpus)]
        self._shown = ["none"] * n_gpus
        self._progress: tuple[int, float] = (-1, 0.0)  # (the job's completed collectives, when that total changed)
        self._last_t = time.time()
        self.seen_pids: set[int] = set()
        self.history: list[tuple[float, tuple[str, ...]]] = []
        self._setup()

    def _setup(self) -> None:
        fields: dict[str, Any] = dict(H200)
        fields.update({k: v for k, v in LINK.items() if k in SCALAR_KEYS})
        with self.state.batch():
            while len(self.state.data["gpus"]) < self.n_gpus:
                self.state.add_gpu()
            for gpu in range(self.n_gpus):
                self.state.set(gpu, **fields)
                g = self.state.gpu(gpu)
                for fid in (FI_NVLINK_THROUGHPUT_DATA_TX, FI_NVLINK_THROUGHPUT_DATA_RX):
                    g["fields"].pop(str(fid), None)  # NOT_SUPPORTED, as on the H200 the captures come from
                self._show(gpu, "none", [], 0.0)

    # -- control from the test -----------------------------------------------------------------------------
    def apply(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a ``StandinState`` edit while the thread is not writing."""
        with self._lock:
            return fn(*args, **kwargs)

    def placed(self) -> dict[int, int]:
        """pid → GPU of the processes listed now."""
        with self._lock:
            return {p["pid"]: gpu for gpu in range(self.n_gpus) for p in self.state.gpu(gpu)["processes"]}

    def shown_at(self, profile: str, after: float = 0.0) -> float | None:
        """When a GPU first showed ``profile`` at or after ``after`` (wall clock), or None."""
        return next((t for t, profs in self.history if t >= after and profile in profs), None)


    # -- the thread --------------------------------------------------------------------------------------------

    def tick(self) -> None:
        now = time.time()
        ranks = [r for r in read_ranks(self.state_dir) if r.liveness != DEAD]
        total = sum(r.completed_total for r in ranks)
        if total != self._progress[0]:
            self._progress = (total, now)
        moving = now - self._progress[1] < self.frozen_after_s
        with self._lock:
            dt, self._last_t = max(0.0, now - self._last_t), now
            shown = []
            with self.state.batch():
                for gpu in range(self.n_gpus):
                    on = [r for r in ranks if r.local_rank % self.n_gpus == gpu]
                    profile = self._profile(on, moving)
                    self._show(gpu, profile, on, dt)
                    shown.append(profile)
            self.history.append((time.time(), tuple(shown)))

    def _profile(self, on: list[RankView], moving: bool) -> str:
        if not on:
            return "none"
        if any(r.state == SYNC and r.liveness == ALIVE for r in on):
            if not moving:
                return "spin"
            return "transfer" if any(r.pending_bytes >= self.big_bytes for r in on) else "busy"
        if any(r.state in COMPUTE and r.liveness == ALIVE for r in on):
            return "busy"
        return "idle"

    def _show(self, gpu: int, profile: str, on: list[RankView], dt: float) -> None:
        g = self.state.gpu(gpu)
        u = self.rng.uniform
        if profile == "busy":
            util, mem, power = round(u(60, 100)), round(u(30, 60)), u(0.6, 0.9) * self.limit_w
            tx_bps, rx_bps = u(1, 3) * GIB, u(1, 3) * GIB
        elif profile == "transfer":
            util, mem, power = round(u(8, 100)), round(u(5, 25)), 0.17 * self.limit_w
            tx_bps, rx_bps = u(1, 3) * GIB, u(1, 3) * GIB
        elif profile == "spin":
            util, mem, power = 100, 0, 0.17 * self.limit_w * u(0.99, 1.01)
            tx_bps, rx_bps = SPIN_TX_BPS * u(0.97, 1.03), SPIN_RX_BPS * u(0.97, 1.03)
            if self._shown[gpu] != "spin" and self.wrap_in_spin_s is not None:
                # Put the rx counter a short polling time below the wrap: the hang shows NVML's 2^32 wrap.
                target = WRAP - int(SPIN_RX_BPS * self.wrap_in_spin_s)
                self._rx[gpu] += (target - self._rx[gpu] % WRAP) % WRAP
        elif profile == "idle":
            util, mem, power, tx_bps, rx_bps = 0, 0, 0.11 * self.limit_w, 0.0, 0.0
        else:
            util, mem, power, tx_bps, rx_bps = 0, 0, 70.0, 0.0, 0.0
        self._tx[gpu] += int(tx_bps * dt)
        self._rx[gpu] += int(rx_bps * dt)
        g["utilization_gpu"], g["utilization_memory"], g["power_mw"] = util, mem, int(power * 1000)
        g["fields"][str(FI_PCIE_COUNT_TX_BYTES)] = self._tx[gpu] % WRAP
        g["fields"][str(FI_PCIE_COUNT_RX_BYTES)] = self._rx[gpu] % WRAP
        g["processes"] = [{"pid": r.pid, "used_memory": self.mem_per_rank} for r in on]
        g["memory_used"] = self.mem_per_rank * len(on)
        self.seen_pids.update(r.pid for r in on)
        ts = int(time.time() * 1e6)
        if profile == "spin":
            samples = [(r.pid, 100, 0) for r in on if r.state == SYNC and r.liveness == ALIVE]
        elif profile in ("busy", "transfer"):
            active = [r for r in on if r.liveness == ALIVE and (r.state == SYNC or r.state in COMPUTE)]
            samples = [(r.pid, max(1, util // max(1, len(active))), mem) for r in active]
        else:
            samples = []
        g["process_samples"].extend({"pid": pid, "sm_util": sm, "mem_util": mu, "enc_util": 0, "dec_util": 0,
                                     "timestamp_us": ts} for pid, sm, mu in samples)
        del g["process_samples"][:-2 * max(1, len(on))]
        self._shown[gpu] = profile
