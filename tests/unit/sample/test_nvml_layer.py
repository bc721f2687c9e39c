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
from gpu_watchdog.model import GpuFault
from gpu_watchdog.sample.backends import NvmlBackend, ProcBackend, choose_backend
from gpu_watchdog.sample.nvml import FI_PCIE_RX_BYTES, FI_PCIE_TX_BYTES, PCIE_LANE_BYTES_PER_S, NvmlReader
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
@pytest.mark.parametrize(("fn", "metric", "attrs"), [
    ("nvmlDeviceGetPowerUsage", "power", ("power_w",)),
    ("nvmlDeviceGetEnforcedPowerLimit", "power_limit", ("power_limit_w",)),
    ("nvmlDeviceGetClockInfo", "sm_clock", ("sm_clock_mhz",)),
    ("nvmlDeviceGetTemperature", "temperature", ("temperature_c",)),
    ("nvmlDeviceGetUtilizationRates", "utilization", ("util_percent", "mem_util_percent")),
    ("nvmlDeviceGetMemoryInfo", "memory", ("mem_used_bytes", "mem_total_bytes")),
    ("nvmlDeviceGetFieldValues", "traffic", ("pcie_tx_bytes_total", "pcie_rx_bytes_total",
                                             "nvlink_tx_bytes_total", "nvlink_rx_bytes_total")),
    ("nvmlDeviceGetProcessUtilization", "process_utilization", ()),
    ("nvmlDeviceGetMaxPcieLinkGeneration", "pcie_link", ("pcie_link_bytes_per_s",)),
    ("nvmlDeviceGetMaxPcieLinkWidth", "pcie_link", ("pcie_link_bytes_per_s",)),
])
def test_not_supported_is_none_and_listed(fn: str, metric: str, attrs: tuple[str, ...]) -> None:
    fake = FakeNvml(n_gpus=2)
    fake.fail[(fn, 1)] = pynvml.NVMLError_NotSupported()
    devices, errors = started(fake).read_all()
    assert errors == []
    assert devices[1].unsupported == (metric,) and devices[0].unsupported == ()
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
    """An idle GPU's link drops (gen 1 here): the maximum is what it carries under load, and it is read once."""
    fake = FakeNvml(n_gpus=2)
    fake.gpus[1].update(pcie_link_gen_current=1, pcie_link_width_current=16)
    reader = started(fake)
    for _ in range(3):
        devices, _ = reader.read_all()
        assert [d.pcie_link_bytes_per_s for d in devices] == [pytest.approx(GEN5_X16)] * 2
    assert fake.calls.count("nvmlDeviceGetMaxPcieLinkGeneration") == 2
    assert fake.calls.count("nvmlDeviceGetMaxPcieLinkWidth") == 2
    assert not {"nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth"} & set(fake.calls)
    fake.gpus[0]["pcie_link_width_max"] = 1  # not asked again
    assert reader.read_all()[0][0].pcie_link_bytes_per_s == pytest.approx(GEN5_X16)


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
    assert devices[0].unsupported == ("traffic",) and errors == []
    assert devices[0].pcie_tx_bytes_total is None and devices[0].nvlink_rx_bytes_total is None
    fake.gpus[0]["fields"] = {FI_PCIE_TX_BYTES: 5, FI_PCIE_RX_BYTES: 6}  # PCIe only
    devices, _ = started(fake).read_all()
    assert devices[0].unsupported == () and devices[0].pcie_rx_bytes_total == 6
    assert devices[0].nvlink_tx_bytes_total is None


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
