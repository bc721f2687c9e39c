"""A fake pynvml for tests: the REAL pynvml error classes and constants, fake query calls.

``FakeNvml`` exposes every ``NVMLError*`` class and ``NVML_*`` constant of the installed pynvml module, plus the
query functions NvmlReader calls, answering from per-GPU state that a test edits (values, and an exception to
raise per (function, gpu)).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pynvml
from gpu_watchdog.sample.nvml import (
    FI_NVLINK_RX_KIB,
    FI_NVLINK_TX_KIB,
    FI_PCIE_REPLAY_COUNTER,
    FI_PCIE_RX_BYTES,
    FI_PCIE_TX_BYTES,
    NvmlReader,
)

GIB = 1 << 30
QUERIES = ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage",
           "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo",
           "nvmlDeviceGetFieldValues", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetProcessUtilization",
           "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth",
           "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxClockInfo",
           "nvmlDeviceGetCurrentClocksEventReasons")
# Answered too, though NvmlReader asks it only where the newer clocks event reasons function is missing.
OLD_NAMES = ("nvmlDeviceGetCurrentClocksThrottleReasons",)


def nvml_error(code: int) -> pynvml.NVMLError:
    """The exception pynvml itself raises for an NVML return code (its NVMLError maps code → subclass)."""
    return pynvml.NVMLError(code)


class FakeNvml(types.SimpleNamespace):
    """A module-like stand-in for pynvml with the real error classes and constants."""

    def __init__(self, n_gpus: int = 2, procs_per_gpu: int = 2) -> None:
        super().__init__(**{k: getattr(pynvml, k) for k in dir(pynvml)
                            if k.startswith(("NVMLError", "NVML_"))})
        self.calls: list[str] = []
        self.fail: dict[tuple[str, int | None], BaseException] = {}  # (function, gpu or None=all) → error
        self.init_error: BaseException | None = None
        self.gpus = [self._gpu(i, procs_per_gpu) for i in range(n_gpus)]
        for name in (*QUERIES, *OLD_NAMES, "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName"):
            setattr(self, name, self._wrap(name, getattr(self, "_" + name)))

    @staticmethod
    def _gpu(i: int, nprocs: int) -> dict[str, Any]:
        return {
            "util": 97, "mem_util": 10, "mem_used": 40 * GIB, "mem_total": 80 * GIB, "power_mw": 450_000,
            "limit_mw": 700_000, "temp": 61, "sm_clock": 1980, "sm_clock_max": 1980,
            "clocks_event_reasons": 0,  # nothing holds the clocks down
            # The stand-in's names (docs/nvml-standin.md); an H100 SXM's PCIe 5.0 x16.
            "pcie_link_gen_current": 5, "pcie_link_gen_max": 5,
            "pcie_link_width_current": 16, "pcie_link_width_max": 16,
            "fields": {FI_NVLINK_TX_KIB: 10, FI_NVLINK_RX_KIB: 20, FI_PCIE_TX_BYTES: 30, FI_PCIE_RX_BYTES: 40,
                       FI_PCIE_REPLAY_COUNTER: 0},
            "procs": [(10_000 + 100 * i + j, 4 * GIB) for j in range(nprocs)],
            "proc_util": [(10_000 + 100 * i + j, 90 - j, 1_000 + j) for j in range(nprocs)],
        }

    # -- plumbing ------------------------------------------------------------------------------------
    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            gpu = args[0] if args and isinstance(args[0], int) else None
            self.calls.append(name)
            err = self.fail.get((name, gpu)) or self.fail.get((name, None))
            if err is not None:
                raise err
            return fn(*args)

        call.__name__ = name
        return call

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls.append("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    # Handles are the GPU index itself.
    def _nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def _nvmlDeviceGetUUID(self, h: int) -> bytes:  # noqa: N802
        return f"GPU-fake-{h}".encode()  # older pynvml returned bytes

    def _nvmlDeviceGetName(self, h: int) -> str:  # noqa: N802
        return "NVIDIA H100 80GB HBM3"

    def _nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        return types.SimpleNamespace(gpu=self.gpus[h]["util"], memory=self.gpus[h]["mem_util"])

    def _nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        g = self.gpus[h]
        return types.SimpleNamespace(used=g["mem_used"], total=g["mem_total"], free=g["mem_total"] - g["mem_used"])

    def _nvmlDeviceGetPowerUsage(self, h: int) -> int:  # noqa: N802
        return self.gpus[h]["power_mw"]

    def _nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:  # noqa: N802
        return self.gpus[h]["limit_mw"]

    def _nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:  # noqa: N802
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self.gpus[h]["temp"]

    def _nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        assert clock == pynvml.NVML_CLOCK_SM
        return self.gpus[h]["sm_clock"]

    def _nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:  # noqa: N802
        assert clock == pynvml.NVML_CLOCK_SM
        return self.gpus[h]["sm_clock_max"]

    def _nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:  # noqa: N802
        return self.gpus[h]["clocks_event_reasons"]

    def _nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:  # noqa: N802
        return self.gpus[h]["clocks_event_reasons"]

    def _nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return self.gpus[h]["pcie_link_gen_max"]

    def _nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:  # noqa: N802
        return self.gpus[h]["pcie_link_width_max"]

    def _nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return self.gpus[h]["pcie_link_gen_current"]

    def _nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:  # noqa: N802
        return self.gpus[h]["pcie_link_width_current"]

    def _nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> list[Any]:  # noqa: N802
        out = []
        for fid in ids:
            value = self.gpus[h]["fields"].get(fid)
            ret = pynvml.NVML_SUCCESS if value is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            out.append(types.SimpleNamespace(fieldId=fid, nvmlReturn=ret,
                                             value=types.SimpleNamespace(ullVal=value or 0)))
        return out

    def _nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:  # noqa: N802
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in self.gpus[h]["procs"]]

    def _nvmlDeviceGetProcessUtilization(self, h: int, since: int) -> list[Any]:  # noqa: N802
        return [types.SimpleNamespace(pid=pid, smUtil=u, timeStamp=ts)
                for pid, u, ts in self.gpus[h]["proc_util"] if ts > since]


def started(fake: FakeNvml) -> NvmlReader:
    r = NvmlReader(lib=fake)
    assert r.start() == len(fake.gpus)
    return r
