"""The NVML layer driven through an injected pynvml: the REAL pynvml error classes and constants, fake calls.

Nothing here needs a GPU. ``FakeNvml`` exposes every ``NVMLError*`` class and ``NVML_*`` constant of the
installed pynvml module, plus the query functions NvmlReader calls, answering from per-GPU state that a
test edits (values, and an exception to raise per (function, gpu)).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pynvml
import pytest
from fake_nvml import GIB, QUERIES, FakeNvml, nvml_error, started
from gpu_watchdog.errors import EXIT_UNAVAILABLE, BackendUnavailable
from gpu_watchdog.model import DeviceSample, GpuFault
from gpu_watchdog.sample.backends import NvmlBackend, ProcBackend, choose_backend
from gpu_watchdog.sample.nvml import (
    FI_PCIE_REPLAY_COUNTER,
    FI_PCIE_RX_BYTES,
    FI_PCIE_TX_BYTES,
    PCIE_LANE_BYTES_PER_S,
    NvmlReader,
    clock_slowdowns,
)
from gpu_watchdog.sample.processes import ProcessScanner
from nvml_standin import NvmlStandin
from nvml_standin.fixtures import nvml_standin as _nvml_standin_fixture  # noqa: F401
from nvml_standin.fixtures import nvml_standin_lib as _nvml_standin_lib_fixture  # noqa: F401

CLI = str(Path(sys.executable).with_name("gpu-watchdog"))
GEN5_X16 = 16 * 32e9 * 128 / 130 / 8  # ≈ 63.0 GB/s per direction: an H100 SXM's link


# -- a healthy read -----------------------------------------------------------------------------------
def test_a_full_read_maps_every_value_with_units() -> None:
    fake = FakeNvml(n_gpus=2)
    devices, errors = started(fake).read_all()
    assert errors == []
    d = devices[1]
    assert (d.index, d.uuid, d.name) == (1, "GPU-fake-1", "NVIDIA H100 80GB HBM3")
    assert d.util_percent == 97.0 and d.mem_used_bytes == 40 * GIB and d.mem_total_bytes == 80 * GIB
    assert d.power_w == 450.0 and d.power_limit_w == 700.0
    assert d.temperature_c == 61.0 and d.sm_clock_mhz == 1980.0
    assert (d.nvlink_tx_bytes_total, d.nvlink_rx_bytes_total) == (10 * 1024, 20 * 1024)  # KiB → bytes
    assert (d.pcie_tx_bytes_total, d.pcie_rx_bytes_total) == (30, 40)
    assert d.mem_util_percent == 10.0 and d.pcie_link_bytes_per_s == pytest.approx(GEN5_X16)
    assert (d.sm_clock_max_mhz, d.clock_event_reasons, d.pcie_replay_total) == (1980.0, 0, 0)
    assert (d.pcie_link_gen, d.pcie_link_width, d.pcie_link_gen_max, d.pcie_link_width_max) == (5, 16, 5, 16)
    assert [(p.pid, p.used_memory_bytes, p.util_percent) for p in d.processes] == [
        (10_100, 4 * GIB, 90.0), (10_101, 4 * GIB, 89.0)]
    assert d.fault is None and d.unsupported == () and not d.virtual


def test_process_utilization_asks_only_for_new_samples() -> None:
    fake = FakeNvml(n_gpus=1)
    reader = started(fake)
    reader.read_all()
    devices, _ = reader.read_all()  # nothing newer than the last timeStamp: no per-process util
    assert [p.util_percent for p in devices[0].processes] == [None, None]
    fake.gpus[0]["proc_util"] = [(10_000, 55, 5_000)]
    devices, _ = reader.read_all()
    assert [p.util_percent for p in devices[0].processes] == [55.0, None]


def test_no_process_samples_yet_is_not_an_error() -> None:
    fake = FakeNvml(n_gpus=1)
    fake.fail[("nvmlDeviceGetProcessUtilization", None)] = nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
    devices, errors = started(fake).read_all()
    assert errors == [] and devices[0].unsupported == ()
    assert all(p.util_percent is None for p in devices[0].processes)


# -- NotSupported → None, listed ----------------------------------------------------------------------
@pytest.mark.parametrize(("fn", "metrics", "attrs"), [
    ("nvmlDeviceGetPowerUsage", "power", ("power_w",)),
    ("nvmlDeviceGetEnforcedPowerLimit", "power_limit", ("power_limit_w",)),
    ("nvmlDeviceGetClockInfo", "sm_clock", ("sm_clock_mhz",)),
    ("nvmlDeviceGetTemperature", "temperature", ("temperature_c",)),
    ("nvmlDeviceGetUtilizationRates", "utilization", ("util_percent", "mem_util_percent")),
    ("nvmlDeviceGetMemoryInfo", "memory", ("mem_used_bytes", "mem_total_bytes")),
    ("nvmlDeviceGetFieldValues", ("traffic", "pcie_replay"), (
        "pcie_tx_bytes_total", "pcie_rx_bytes_total", "nvlink_tx_bytes_total", "nvlink_rx_bytes_total",
        "pcie_replay_total")),
    ("nvmlDeviceGetProcessUtilization", "process_utilization", ()),
    ("nvmlDeviceGetMaxPcieLinkGeneration", "pcie_link", ("pcie_link_bytes_per_s", "pcie_link_gen_max",
                                                         "pcie_link_width_max")),
    ("nvmlDeviceGetMaxPcieLinkWidth", "pcie_link", ("pcie_link_bytes_per_s", "pcie_link_width_max")),
    ("nvmlDeviceGetMaxClockInfo", "sm_clock_max", ("sm_clock_max_mhz",)),
    ("nvmlDeviceGetCurrentClocksEventReasons", "clock_event_reasons", ("clock_event_reasons",)),
    ("nvmlDeviceGetCurrPcieLinkGeneration", "pcie_link_current", ("pcie_link_gen",)),
    ("nvmlDeviceGetCurrPcieLinkWidth", "pcie_link_current", ("pcie_link_width",)),
])
def test_not_supported_is_none_and_listed(fn: str, metrics: str | tuple[str, ...], attrs: tuple[str, ...]) -> None:
    fake = FakeNvml(n_gpus=2)
    fake.fail[(fn, 1)] = pynvml.NVMLError_NotSupported()
    devices, errors = started(fake).read_all()
    assert errors == []
    metric = metrics if isinstance(metrics, str) else metrics[0]
    assert devices[1].unsupported == ((metrics,) if isinstance(metrics, str) else metrics)
    assert devices[0].unsupported == ()
    for a in attrs:
        assert getattr(devices[1], a) is None and getattr(devices[0], a) is not None
    if metric == "process_utilization":
        assert [p.util_percent for p in devices[1].processes] == [None, None]
        assert len(devices[1].processes) == 2  # memory per process still known
    assert devices[1].fault is None


# -- memory-controller utilization and the PCIe link --------------------------------------------------
def test_memory_controller_utilization_is_read_per_gpu() -> None:
    fake = FakeNvml(n_gpus=2)
    fake.gpus[1].update(util=100, mem_util=0)  # the real-GPU NCCL spin: SMs busy, memory controller idle
    devices, _ = started(fake).read_all()
    assert [(d.util_percent, d.mem_util_percent) for d in devices] == [(97.0, 10.0), (100.0, 0.0)]


# Bytes/s per lane and direction after line encoding (Wikipedia "PCI Express", link performance table: 0.250,
# 0.500, 0.985, 1.969, 3.938, 7.563 GB/s), written out here rather than derived as the code derives them.
@pytest.mark.parametrize(("gen", "lane"), [(1, 250e6), (2, 500e6), (3, 984.6e6), (4, 1969.2e6), (5, 3938.5e6),
                                           (6, 7562.5e6)])
def test_pcie_link_capacity_is_lane_rate_times_width(gen: int, lane: float) -> None:
    fake = FakeNvml(n_gpus=1)
    fake.gpus[0].update(pcie_link_gen_max=gen, pcie_link_width_max=8)
    devices, errors = started(fake).read_all()
    assert devices[0].pcie_link_bytes_per_s == pytest.approx(8 * lane, rel=1e-4)
    assert errors == [] and devices[0].unsupported == ()


@pytest.mark.parametrize(("gen", "width"), [(0, 16), (7, 16), (5, 0)])
def test_an_unknown_generation_or_no_lanes_is_no_capacity(gen: int, width: int) -> None:
    assert 7 not in PCIE_LANE_BYTES_PER_S  # no guess for a generation the table does not know
    fake = FakeNvml(n_gpus=1)
    fake.gpus[0].update(pcie_link_gen_max=gen, pcie_link_width_max=width)
    devices, errors = started(fake).read_all()
    assert devices[0].pcie_link_bytes_per_s is None
    assert errors == [] and devices[0].unsupported == ()  # NVML answered: not "unsupported"


def test_pcie_link_is_the_maximum_read_once_per_gpu() -> None:
    """An idle GPU's link drops (gen 1 here): the maximum is what it carries under load, and it is read once.
    The current link is read every tick, apart, and never enters the capacity."""
    fake = FakeNvml(n_gpus=2)
    fake.gpus[1].update(pcie_link_gen_current=1, pcie_link_width_current=16)
    reader = started(fake)
    for _ in range(3):
        devices, _ = reader.read_all()
        assert [d.pcie_link_bytes_per_s for d in devices] == [pytest.approx(GEN5_X16)] * 2
        assert [(d.pcie_link_gen, d.pcie_link_width) for d in devices] == [(5, 16), (1, 16)]
        assert [(d.pcie_link_gen_max, d.pcie_link_width_max) for d in devices] == [(5, 16), (5, 16)]
    assert fake.calls.count("nvmlDeviceGetMaxPcieLinkGeneration") == 2
    assert fake.calls.count("nvmlDeviceGetMaxPcieLinkWidth") == 2
    assert fake.calls.count("nvmlDeviceGetCurrPcieLinkGeneration") == 6  # 2 GPUs x 3 ticks
    assert fake.calls.count("nvmlDeviceGetCurrPcieLinkWidth") == 6
    fake.gpus[0]["pcie_link_width_max"] = 1  # not asked again
    fake.gpus[0]["pcie_link_width_current"] = 8  # asked again: a link that retrained narrower shows
    d = reader.read_all()[0][0]
    assert d.pcie_link_bytes_per_s == pytest.approx(GEN5_X16) and (d.pcie_link_width, d.pcie_link_width_max) == (8, 16)


def test_pcie_link_not_supported_is_remembered_and_listed_every_tick() -> None:
    fake = FakeNvml(n_gpus=1)
    fake.fail[("nvmlDeviceGetMaxPcieLinkGeneration", None)] = pynvml.NVMLError_NotSupported()
    reader = started(fake)
    for _ in range(3):
        devices, errors = reader.read_all()
        assert devices[0].unsupported == ("pcie_link",) and devices[0].pcie_link_bytes_per_s is None
        assert errors == [] and devices[0].mem_util_percent == 10.0
    assert fake.calls.count("nvmlDeviceGetMaxPcieLinkGeneration") == 1
    assert "nvmlDeviceGetMaxPcieLinkWidth" not in fake.calls  # no width without a generation


def test_pcie_link_after_another_error_is_asked_again() -> None:
    fake = FakeNvml(n_gpus=2)
    fake.fail[("nvmlDeviceGetMaxPcieLinkWidth", 1)] = pynvml.NVMLError_Unknown()
    reader = started(fake)
    devices, errors = reader.read_all()
    assert devices[1].pcie_link_bytes_per_s is None and devices[1].unsupported == () and devices[1].fault is None
    assert [(e.error_class, e.where) for e in errors] == [("NVMLError_Unknown", "nvmlDeviceGetMaxPcieLinkWidth gpu 1")]
    assert devices[0].pcie_link_bytes_per_s == pytest.approx(GEN5_X16)
    del fake.fail[("nvmlDeviceGetMaxPcieLinkWidth", 1)]
    devices, errors = reader.read_all()
    assert errors == [] and devices[1].pcie_link_bytes_per_s == pytest.approx(GEN5_X16)


def test_field_values_not_supported_per_field() -> None:
    fake = FakeNvml(n_gpus=1)
    fake.gpus[0]["fields"] = {}  # the call works but every field answers NOT_SUPPORTED (no NVLink, old GPU)
    devices, errors = started(fake).read_all()
    assert devices[0].unsupported == ("traffic", "pcie_replay") and errors == []
    assert devices[0].pcie_tx_bytes_total is None and devices[0].nvlink_rx_bytes_total is None
    assert devices[0].pcie_replay_total is None
    fake.gpus[0]["fields"] = {FI_PCIE_TX_BYTES: 5, FI_PCIE_RX_BYTES: 6}  # PCIe only, no replay counter
    devices, _ = started(fake).read_all()
    assert devices[0].unsupported == ("pcie_replay",) and devices[0].pcie_rx_bytes_total == 6
    assert devices[0].nvlink_tx_bytes_total is None and devices[0].pcie_replay_total is None
    fake.gpus[0]["fields"] = {FI_PCIE_REPLAY_COUNTER: 17}  # the replay counter alone: traffic is unsupported
    devices, _ = started(fake).read_all()
    assert devices[0].unsupported == ("traffic",) and devices[0].pcie_replay_total == 17


def test_pcie_replays_ride_in_the_batched_field_values_call() -> None:
    fake = FakeNvml(n_gpus=1)
    fake.gpus[0]["fields"][FI_PCIE_REPLAY_COUNTER] = 3
    reader = started(fake)
    assert reader.read_all()[0][0].pcie_replay_total == 3
    fake.gpus[0]["fields"][FI_PCIE_REPLAY_COUNTER] = 40
    assert reader.read_all()[0][0].pcie_replay_total == 40  # cumulative, read every tick
    assert fake.calls.count("nvmlDeviceGetFieldValues") == 2  # no call of its own


# -- clocks: the SM clock's maximum, the clocks event reasons -----------------------------------------
def test_sm_clock_max_is_read_once_and_its_not_supported_remembered() -> None:
    fake = FakeNvml(n_gpus=2)
    fake.gpus[0].update(sm_clock=1410, sm_clock_max=1980)
    fake.fail[("nvmlDeviceGetMaxClockInfo", 1)] = pynvml.NVMLError_NotSupported()
    reader = started(fake)
    for _ in range(3):
        devices, errors = reader.read_all()
        assert [(d.sm_clock_mhz, d.sm_clock_max_mhz) for d in devices] == [(1410.0, 1980.0), (1980.0, None)]
        assert devices[1].unsupported == ("sm_clock_max",) and errors == []
    assert fake.calls.count("nvmlDeviceGetMaxClockInfo") == 2


def test_sm_clock_max_after_another_error_is_asked_again() -> None:
    fake = FakeNvml(n_gpus=1)
    fake.fail[("nvmlDeviceGetMaxClockInfo", None)] = pynvml.NVMLError_Unknown()
    reader = started(fake)
    devices, errors = reader.read_all()
    assert devices[0].sm_clock_max_mhz is None and devices[0].unsupported == ()
    assert [(e.error_class, e.where) for e in errors] == [("NVMLError_Unknown", "nvmlDeviceGetMaxClockInfo gpu 0")]
    del fake.fail[("nvmlDeviceGetMaxClockInfo", None)]
    devices, errors = reader.read_all()
    assert devices[0].sm_clock_max_mhz == 1980.0 and errors == []


def test_clock_event_reasons_are_read_every_tick() -> None:
    fake = FakeNvml(n_gpus=2)
    fake.gpus[1]["clocks_event_reasons"] = pynvml.nvmlClocksEventReasonSwThermalSlowdown
    reader = started(fake)
    devices, _ = reader.read_all()
    assert [d.clock_event_reasons for d in devices] == [0, 0x20]
    fake.gpus[1]["clocks_event_reasons"] = pynvml.nvmlClocksEventReasonGpuIdle
    devices, _ = reader.read_all()
    assert [d.clock_event_reasons for d in devices] == [0, 0x1]
    assert fake.calls.count("nvmlDeviceGetCurrentClocksEventReasons") == 4
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in fake.calls


def test_clock_event_reasons_fall_back_to_the_throttle_reasons_name_when_the_driver_lacks_it() -> None:
    """A driver older than the newer symbol: pynvml raises FunctionNotFound; the deprecated name has the same bits."""
    fake = FakeNvml(n_gpus=2)
    fake.fail[("nvmlDeviceGetCurrentClocksEventReasons", None)] = nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake.gpus[1]["clocks_event_reasons"] = 0x40 | 0x8
    reader = started(fake)
    for _ in range(2):
        devices, errors = reader.read_all()
        assert [d.clock_event_reasons for d in devices] == [0, 0x48]
        assert errors == [] and all(d.unsupported == () for d in devices)
    assert fake.calls.count("nvmlDeviceGetCurrentClocksEventReasons") == 1  # tried once, then the older name
    assert fake.calls.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 4


def test_clock_event_reasons_fall_back_when_pynvml_lacks_the_newer_wrapper() -> None:
    fake = FakeNvml(n_gpus=1)
    del fake.nvmlDeviceGetCurrentClocksEventReasons  # an nvidia-ml-py older than the rename
    fake.gpus[0]["clocks_event_reasons"] = 0x4
    devices, errors = started(fake).read_all()
    assert devices[0].clock_event_reasons == 0x4 and errors == []
    assert fake.calls.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 1


@pytest.mark.parametrize(("error", "unsupported", "n_errors"), [
    (pynvml.NVMLError_NotSupported(), ("clock_event_reasons",), 0),
    (pynvml.NVMLError_Unknown(), (), 1),
])
def test_clock_event_reasons_first_call_errors_are_mapped_like_any_query(
        error: BaseException, unsupported: tuple[str, ...], n_errors: int) -> None:
    fake = FakeNvml(n_gpus=2)
    fake.fail[("nvmlDeviceGetCurrentClocksEventReasons", 0)] = error
    reader = started(fake)
    for _ in range(2):
        devices, errors = reader.read_all()
        assert devices[0].clock_event_reasons is None and devices[0].unsupported == unsupported
        assert devices[1].clock_event_reasons == 0 and len(errors) == n_errors
        assert devices[0].power_w == 450.0
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in fake.calls  # the symbol exists: no fallback


def test_a_gpu_without_any_of_the_new_queries_still_samples_the_rest() -> None:
    fake = FakeNvml(n_gpus=2)
    for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetMaxClockInfo",
               "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth"):
        fake.fail[(fn, 1)] = pynvml.NVMLError_NotSupported()
    del fake.gpus[1]["fields"][FI_PCIE_REPLAY_COUNTER]
    reader = started(fake)
    for _ in range(2):
        devices, errors = reader.read_all()
        d = devices[1]
        assert errors == [] and d.fault is None
        assert d.unsupported == ("clock_event_reasons", "pcie_replay", "sm_clock_max", "pcie_link_current")
        assert (d.clock_event_reasons, d.sm_clock_max_mhz, d.pcie_replay_total, d.pcie_link_gen,
                d.pcie_link_width) == (None,) * 5
        assert d.util_percent == 97.0 and d.power_w == 450.0 and d.sm_clock_mhz == 1980.0
        assert d.pcie_tx_bytes_total == 30 and d.nvlink_tx_bytes_total == 10 * 1024 and len(d.processes) == 2
        assert d.pcie_link_bytes_per_s == pytest.approx(GEN5_X16)
        assert (d.pcie_link_gen_max, d.pcie_link_width_max) == (5, 16)
        assert devices[0].unsupported == () and devices[0].clock_event_reasons == 0


# -- clock_slowdowns: the NVML bits (nvml.h, nvmlClocksEventReasons) ----------------------------------
@pytest.mark.parametrize(("reasons", "names"), [
    (None, ()),
    (0, ()),
    (pynvml.nvmlClocksEventReasonGpuIdle, ()),  # idle is not a slowdown
    (pynvml.nvmlClocksEventReasonApplicationsClocksSetting, ()),  # nor the applications clocks setting
    (0x1 | 0x2, ()),
    (pynvml.nvmlClocksEventReasonSwThermalSlowdown, ("thermal",)),
    (pynvml.nvmlClocksEventReasonHwThermalSlowdown, ("thermal",)),
    (0x20 | 0x40, ("thermal",)),  # named once
    (pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown, ("power brake",)),
    (pynvml.nvmlClocksEventReasonSwPowerCap, ("power cap",)),
    (pynvml.nvmlClocksEventReasonHwSlowdown, ("hw slowdown",)),
    (pynvml.nvmlClocksEventReasonSyncBoost, ("sync boost",)),
    (pynvml.nvmlClocksEventReasonDisplayClockSetting, ("display clocks",)),
    (0x1 | 0x40 | 0x8, ("thermal", "hw slowdown")),  # NVML sets HW slowdown along with HW thermal
    (0x4 | 0x80 | 0x20, ("thermal", "power brake", "power cap")),
])
def test_clock_slowdowns_names_the_slowdown_bits(reasons: int | None, names: tuple[str, ...]) -> None:
    assert clock_slowdowns(DeviceSample(0, "GPU-a", "x", clock_event_reasons=reasons)) == names


def test_clock_slowdown_bits_are_nvmls() -> None:
    """The bits against the installed pynvml's constants, under both the newer and the deprecated names."""
    from gpu_watchdog.sample import nvml

    for ours, name in [(nvml.CLOCKS_EVENT_GPU_IDLE, "GpuIdle"),
                       (nvml.CLOCKS_EVENT_APPLICATIONS_CLOCKS_SETTING, "ApplicationsClocksSetting"),
                       (nvml.CLOCKS_EVENT_SW_POWER_CAP, "SwPowerCap"), (nvml.CLOCKS_EVENT_HW_SLOWDOWN, "HwSlowdown"),
                       (nvml.CLOCKS_EVENT_SYNC_BOOST, "SyncBoost"),
                       (nvml.CLOCKS_EVENT_SW_THERMAL_SLOWDOWN, "SwThermalSlowdown"),
                       (nvml.CLOCKS_EVENT_HW_THERMAL_SLOWDOWN, "HwThermalSlowdown"),
                       (nvml.CLOCKS_EVENT_HW_POWER_BRAKE_SLOWDOWN, "HwPowerBrakeSlowdown"),
                       (nvml.CLOCKS_EVENT_DISPLAY_CLOCK_SETTING, "DisplayClockSetting")]:
        newer, older = (getattr(pynvml, f"nvmlClocks{kind}Reason{name}") for kind in ("Event", "Throttle"))
        assert ours == newer == older, name
    assert FI_PCIE_REPLAY_COUNTER == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER


def test_other_errors_are_none_plus_a_sample_error() -> None:
    fake = FakeNvml(n_gpus=2)
    fake.fail[("nvmlDeviceGetPowerUsage", 0)] = pynvml.NVMLError_Unknown()
    fake.fail[("nvmlDeviceGetComputeRunningProcesses", 1)] = nvml_error(pynvml.NVML_ERROR_TIMEOUT)
    fake.fail[("nvmlDeviceGetProcessUtilization", 1)] = pynvml.NVMLError_NoPermission()
    devices, errors = started(fake).read_all()
    assert devices[0].power_w is None and devices[0].unsupported == () and devices[0].fault is None
    assert devices[1].processes == () and devices[1].util_percent == 97.0
    assert [(e.error_class, e.where) for e in errors] == [
        ("NVMLError_Unknown", "nvmlDeviceGetPowerUsage gpu 0"),
        ("NVMLError_Timeout", "nvmlDeviceGetComputeRunningProcesses gpu 1"),
        ("NVMLError_NoPermission", "nvmlDeviceGetProcessUtilization gpu 1"),
    ]


# -- GPU lost / reset required → a fault in the sample, the other GPUs still read ----------------------
@pytest.mark.parametrize("fn", QUERIES)
@pytest.mark.parametrize(("code", "kind"), [(pynvml.NVML_ERROR_GPU_IS_LOST, "gpu_lost"),
                                            (pynvml.NVML_ERROR_RESET_REQUIRED, "reset_required")])
def test_gpu_lost_on_any_call_is_a_fault_and_the_tick_goes_on(fn: str, code: int, kind: str) -> None:
    fake = FakeNvml(n_gpus=4)
    reader = started(fake)
    fake.fail[(fn, 2)] = nvml_error(code)
    devices, errors = reader.read_all()
    assert [d.index for d in devices] == [0, 1, 2, 3]
    assert devices[2].fault is not None and devices[2].fault.kind == kind and "GPU 2" in devices[2].fault.detail
    assert devices[2].uuid == "GPU-fake-2"  # still named, so the detector can report it
    assert devices[2].util_percent is None and devices[2].processes == ()
    for i in (0, 1, 3):
        assert devices[i].fault is None and devices[i].util_percent == 97.0 and len(devices[i].processes) == 2
    assert errors == []
    # It stays faulted on the next tick; the others keep being read.
    devices, _ = reader.read_all()
    assert devices[2].fault is not None and devices[3].fault is None


def test_gpu_lost_at_handle_time_is_a_fault_on_every_tick() -> None:
    fake = FakeNvml(n_gpus=3)
    fake.fail[("nvmlDeviceGetHandleByIndex", 1)] = pynvml.NVMLError_GpuIsLost()
    reader = NvmlReader(lib=fake)
    assert reader.start() == 3
    for _ in range(2):
        devices, errors = reader.read_all()
        assert [d.fault.kind if d.fault else None for d in devices] == [None, "gpu_lost", None]
        assert devices[1].uuid and devices[1].uuid != devices[0].uuid
        assert devices[0].util_percent == 97.0 and errors == []


def test_gpu_lost_when_reading_its_uuid_at_start() -> None:
    fake = FakeNvml(n_gpus=2)
    fake.fail[("nvmlDeviceGetUUID", 0)] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    devices, _ = started(fake).read_all()
    assert devices[0].fault == GpuFault("gpu_lost", devices[0].fault.detail) and devices[1].fault is None


def test_other_errors_opening_a_gpu_make_the_backend_unavailable() -> None:
    fake = FakeNvml(n_gpus=2)
    fake.fail[("nvmlDeviceGetHandleByIndex", 1)] = pynvml.NVMLError_NoPermission()
    with pytest.raises(BackendUnavailable, match="cannot open GPU 1"):
        NvmlReader(lib=fake).start()


# -- init failures → BackendUnavailable with a clear message -------------------------------------------
@pytest.mark.parametrize(("error", "words"), [
    (pynvml.NVMLError_DriverNotLoaded(), "driver is not loaded"),
    (pynvml.NVMLError_LibraryNotFound(), "libnvidia-ml.so.1 not found"),
    (pynvml.NVMLError_LibRmVersionMismatch(), "version mismatch"),
    (pynvml.NVMLError_NoPermission(), "no permission"),
    (pynvml.NVMLError_Unknown(), "NVMLError_Unknown"),
])
def test_init_failures(error: BaseException, words: str) -> None:
    fake = FakeNvml()
    fake.init_error = error
    with pytest.raises(BackendUnavailable) as ei:
        NvmlReader(lib=fake).start()
    assert str(ei.value).startswith("NVML cannot start: ") and words in str(ei.value)
    assert "\n" not in str(ei.value)
    with pytest.raises(BackendUnavailable, match=words):
        choose_backend("nvml", nvml_lib=fake)
    backend, why = choose_backend("auto", nvml_lib=fake)
    assert isinstance(backend, ProcBackend) and words in why


def test_auto_with_no_gpu_falls_back_and_nvml_refuses() -> None:
    fake = FakeNvml(n_gpus=0)
    backend, why = choose_backend("auto", nvml_lib=fake)
    assert isinstance(backend, ProcBackend) and "sees no GPU" in why
    with pytest.raises(BackendUnavailable, match="no GPU"):
        choose_backend("nvml", nvml_lib=fake)
    assert fake.calls.count("nvmlShutdown") == 2


def test_auto_with_gpus_picks_nvml() -> None:
    backend, why = choose_backend("auto", nvml_lib=FakeNvml(n_gpus=8))
    assert isinstance(backend, NvmlBackend) and "8 GPU(s)" in why and "550.54.15" in why
    backend.close()


# -- usedGpuMemory not available → None ---------------------------------------------------------------
@pytest.mark.parametrize("raw", [None, (1 << 64) - 1])
def test_used_gpu_memory_not_available(raw: int | None) -> None:
    fake = FakeNvml(n_gpus=1)
    fake.gpus[0]["procs"] = [(10_000, raw), (10_001, 2 * GIB)]
    devices, errors = started(fake).read_all()
    assert [p.used_memory_bytes for p in devices[0].processes] == [None, 2 * GIB]
    assert errors == []


# -- the NVML backend joins NVML's pids with psutil ----------------------------------------------------
@pytest.fixture
def rank_proc() -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "GPU_WATCHDOG_JOB_ID": "nvml-test"}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                         start_new_session=True)
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _wait_env(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the child's environ is readable once exec finished
        try:
            if "RANK" in psutil.Process(pid).environ():
                return
        except psutil.Error:
            pass
        time.sleep(0.02)


def test_nvml_backend_samples_the_gpu_processes(rank_proc: subprocess.Popen[bytes]) -> None:
    _wait_env(rank_proc.pid)
    fake = FakeNvml(n_gpus=1)
    fake.gpus[0]["procs"] = [(rank_proc.pid, 4 * GIB)]
    backend = NvmlBackend(started(fake), ProcessScanner(root_pid=rank_proc.pid), "host-a", clock=lambda: 42.0)
    s = backend.sample()
    assert (s.t, s.hostname, s.backend) == (42.0, "host-a", "nvml")
    assert [p.pid for p in s.processes] == [rank_proc.pid]
    assert s.processes[0].job is not None and s.processes[0].job.job_id == "nvml-test" and s.processes[0].is_rank


def test_a_process_vanishing_between_nvml_and_psutil(rank_proc: subprocess.Popen[bytes]) -> None:
    _wait_env(rank_proc.pid)
    fake = FakeNvml(n_gpus=2)
    fake.gpus[0]["procs"] = [(rank_proc.pid, 4 * GIB)]
    reader = started(fake)
    real_read = fake.nvmlDeviceGetComputeRunningProcesses

    def read_then_exit(h: int) -> list[Any]:
        out = real_read(h)
        if h == 0 and rank_proc.poll() is None:  # NVML saw it; it dies (and is reaped) before psutil looks
            os.killpg(rank_proc.pid, signal.SIGKILL)
            rank_proc.wait()
        return out

    read_then_exit.__name__ = "nvmlDeviceGetComputeRunningProcesses"
    fake.nvmlDeviceGetComputeRunningProcesses = read_then_exit
    # Root the scanner at the vanishing process, as the launcher would for its job.
    backend = NvmlBackend(reader, ProcessScanner(root_pid=rank_proc.pid), "h")
    s = backend.sample()
    assert [p.pid for p in s.devices[0].processes] == [rank_proc.pid]  # NVML's view, as read
    assert s.process(rank_proc.pid) is None  # psutil's: simply absent
    assert len(s.devices) == 2 and s.devices[1].fault is None
    s2 = backend.sample()  # and the next tick is fine too
    assert s2.process(rank_proc.pid) is None


def test_a_process_vanishing_after_being_known(rank_proc: subprocess.Popen[bytes]) -> None:
    _wait_env(rank_proc.pid)
    fake = FakeNvml(n_gpus=1)
    fake.gpus[0]["procs"] = [(rank_proc.pid, 4 * GIB)]
    backend = NvmlBackend(started(fake), ProcessScanner(root_pid=os.getpid()), "h")
    assert backend.sample().process(rank_proc.pid) is not None
    os.killpg(rank_proc.pid, signal.SIGKILL)
    rank_proc.wait()
    s = backend.sample()  # NVML still lists the pid (its view lags); psutil's does not
    assert s.process(rank_proc.pid) is None and s.devices[0].pids == {rank_proc.pid}


# -- the real pynvml against the NVML stand-in ---------------------------------------------------------
def test_standin_memory_controller_utilization_and_pcie_link(nvml_standin: NvmlStandin) -> None:
    """NvmlReader through the real pynvml: utilization.memory per tick, the link's maximum (not its idle,
    downshifted current generation) once, and NOT_SUPPORTED as ``pcie_link`` in ``unsupported``."""
    state = nvml_standin.require_scripted()
    with state.batch():
        state.add_gpu(utilization_gpu=100, utilization_memory=0, pcie_link_gen_current=1, pcie_link_width_current=16)
        state.add_gpu(utilization_gpu=97, utilization_memory=38, pcie_link_gen_max=4, pcie_link_width_max=8)
        state.add_gpu(pcie_link_gen_max=None, pcie_link_width_max=None)
    with nvml_standin.child() as child:
        child.exec("from gpu_watchdog.sample.nvml import NvmlReader\n"
                   "r = NvmlReader(); r.start()\n"
                   "def read(): return [(d.mem_util_percent, d.pcie_link_bytes_per_s, d.unsupported)\n"
                   "                    for d in r.read_all()[0]]\n")
        first = child.eval("read()")
        assert first[0][0] == 0.0 and first[0][1] == pytest.approx(GEN5_X16) and first[0][2] == []
        assert first[1][0] == 38.0 and first[1][1] == pytest.approx(8 * 16e9 * 128 / 130 / 8)
        assert first[2] == [0.0, None, ["pcie_link"]]
        state.set(0, utilization_memory=55, pcie_link_gen_max=1)  # utilization is per tick, the link read once
        again = child.eval("read()")
        assert again[0][0] == 55.0 and again[0][1] == pytest.approx(GEN5_X16) and again[1:] == first[1:]
        child.exec("r.shutdown()")


def test_standin_throttled_gpu_through_the_real_pynvml(nvml_standin: NvmlStandin) -> None:
    """A thermally throttled GPU on a degraded link: the reasons bitmask, the SM clock below its maximum, the replay
    counter and the current link below its maximum, all read by NvmlReader through the real pynvml; and
    ``clock_slowdowns`` names "thermal" there and nothing on an idle GPU."""
    state = nvml_standin.require_scripted()
    thermal = pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    with state.batch():
        state.add_gpu(clocks_event_reasons=pynvml.nvmlClocksEventReasonGpuIdle, clock_sm_mhz=345)
        hot = state.add_gpu(temperature_c=91, pcie_link_gen_current=3, pcie_link_width_current=8)
        state.throttle(hot, thermal | pynvml.nvmlClocksEventReasonHwSlowdown, sm_clock_mhz=1140)
        state.set_pcie_replays(hot, 37)
    with nvml_standin.child() as child:
        child.exec("from gpu_watchdog.sample.nvml import NvmlReader, clock_slowdowns\n"
                   "r = NvmlReader(); r.start()\n"
                   "def read(): return [(d.clock_event_reasons, d.sm_clock_mhz, d.sm_clock_max_mhz,\n"
                   "                     d.pcie_replay_total, d.pcie_link_gen, d.pcie_link_width,\n"
                   "                     d.pcie_link_gen_max, d.pcie_link_width_max, clock_slowdowns(d),\n"
                   "                     d.unsupported) for d in r.read_all()[0]]\n")
        idle, throttled = child.eval("read()")
        assert idle == [0x1, 345.0, 1980.0, 0, 5, 16, 5, 16, [], []]  # idle: slow, but not slowed down
        assert throttled == [0x68, 1140.0, 1980.0, 37, 3, 8, 5, 16, ["thermal", "hw slowdown"], []]
        with state.batch():  # the GPU cools down and replays keep coming: per tick, the maxima stay as read
            state.throttle(hot, 0, sm_clock_mhz=1980, sm_clock_max_mhz=1500)
            state.set_pcie_replays(hot, 40)
        assert child.eval("read()")[1] == [0, 1980.0, 1980.0, 40, 3, 8, 5, 16, [], []]
        child.exec("r.shutdown()")


def test_standin_gpu_without_the_new_queries_samples_the_rest(nvml_standin: NvmlStandin) -> None:
    """NOT_SUPPORTED from every new query, through the real pynvml: each is None and listed, the rest is read; a
    driver without the newer clocks event reasons symbol (FunctionNotFound) is read through the older name."""
    state = nvml_standin.require_scripted()
    with state.batch():
        state.add_gpu()
        bare = state.add_gpu(clocks_event_reasons=None, clock_sm_max_mhz=None, pcie_link_gen_current=None,
                             power_mw=123_000)
        state.set_pcie_replays(bare, None)
    with nvml_standin.child() as child:
        child.exec("from gpu_watchdog.sample.nvml import NvmlReader\n"
                   "r = NvmlReader(); r.start()\n"
                   "def read():\n"
                   "    devices, errors = r.read_all()\n"
                   "    return [(d.clock_event_reasons, d.sm_clock_max_mhz, d.pcie_replay_total, d.pcie_link_gen,\n"
                   "             d.pcie_link_width, d.power_w, d.pcie_link_bytes_per_s, d.unsupported, d.fault)\n"
                   "            for d in devices], [e.where for e in errors]\n")
        devices, errors = child.eval("read()")
        assert errors == []
        assert devices[0][:5] == [0, 1980.0, 0, 5, 16] and devices[0][7] == []
        assert devices[1][:6] == [None, None, None, None, 16, 123.0]
        assert devices[1][6] == pytest.approx(GEN5_X16) and devices[1][8] is None
        assert devices[1][7] == ["clock_event_reasons", "pcie_replay", "sm_clock_max", "pcie_link_current"]
    state.inject_error("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    state.throttle(0, pynvml.nvmlClocksEventReasonSwPowerCap)
    with nvml_standin.child() as child:  # a fresh agent on that driver
        child.exec("from gpu_watchdog.sample.nvml import NvmlReader, clock_slowdowns\n"
                   "r = NvmlReader(); r.start()\n")
        assert child.eval("[(d.clock_event_reasons, clock_slowdowns(d)) for d in r.read_all()[0]]") == [
            [0x4, ["power cap"]], [None, []]]
        assert child.eval("r.read_all()[1]") == []


# -- this machine: no GPU ----------------------------------------------------------------------------
def test_auto_on_this_machine_picks_proc_with_a_reason() -> None:
    backend, why = choose_backend("auto")
    assert isinstance(backend, ProcBackend)
    assert why.startswith("proc backend (") and "NVML" in why


def test_nvml_on_this_machine_is_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match="NVML"):
        choose_backend("nvml")


def test_cli_nvml_backend_on_this_machine_exits_69(tmp_path: Path) -> None:
    r = subprocess.run([CLI, "record", "--backend", "nvml", "--duration", "1", "--output", "t.trace"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_UNAVAILABLE, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "NVML" in lines[0] and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []
