"""The NVML stand-in, exercised through the REAL pynvml in subprocesses (see docs/nvml-standin.md).

Each test talks to a ``PythonChild``: a Python subprocess started with LD_LIBRARY_PATH pointing at the
compiled stand-in and NVML_STANDIN_STATE at the test's state file, where ``pynvml`` is imported and
``CDLL("libnvidia-ml.so.1")`` therefore resolves to the stand-in.  Exceptions raised in the child come
back as ``ChildError`` carrying the child's exception class name, module and MRO.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pynvml
import pytest
from nvml_standin import (
    FI_PCIE_REPLAY_COUNTER,
    GIB,
    REQUIRED_SYMBOLS,
    RESET_SYMBOL,
    ChildError,
    NvmlStandin,
    PythonChild,
    StandinState,
    find_nvml_include,
)
from nvml_standin.fixtures import nvml_standin as _nvml_standin_fixture  # noqa: F401
from nvml_standin.fixtures import nvml_standin_lib as _nvml_standin_lib_fixture  # noqa: F401
from repo_paths import TESTS

#: The pynvml wrappers the agent calls.  test_required_symbols_cover_pynvml_wrappers derives from
#: pynvml's own source which C symbols these resolve, so a pynvml upgrade that switches a wrapper to
#: a new symbol shows up here instead of as NVMLError_FunctionNotFound inside the agent.
AGENT_PYNVML_CALLS = (
    "nvmlInit",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait",
    "nvmlEventSetFree",
)

OPEN = (
    "import ctypes\n"
    "pynvml.nvmlInit()\n"
    "h = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]\n"
)


_CODE_OF_CLASS = {cls.__name__: code for code, cls in pynvml.NVMLError._valClassMapping.items()}


def expect_nvml_error(child: PythonChild, expr: str, class_name: str) -> ChildError:
    """``expr`` must raise the real ``pynvml.<class_name>`` (a subclass of pynvml.NVMLError)."""
    with pytest.raises(ChildError) as info:
        child.eval(expr)
    err = info.value
    assert err.qualname == f"pynvml.{class_name}", err
    assert err.isinstance_of("pynvml.NVMLError"), err.mro
    assert err.value == _CODE_OF_CLASS[class_name]
    return err


def scripted(nvml_standin: NvmlStandin, gpus: int = 2) -> StandinState:
    state = nvml_standin.require_scripted()
    with state.batch():
        for _ in range(gpus):
            state.add_gpu()
    return state


# ------------------------------------------------------------------------------ symbols & packaging
def exported_symbols(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}


def test_required_symbols_exported(nvml_standin: NvmlStandin) -> None:
    nvml_standin.require_scripted()
    # dlsym through ctypes, in a subprocess so this pytest process never maps the stand-in
    code = (
        "import ctypes, sys, json\n"
        f"lib = ctypes.CDLL({str(nvml_standin.lib_path)!r})\n"
        f"print(json.dumps([s for s in {list(REQUIRED_SYMBOLS)!r} if not hasattr(lib, s)]))\n"
    )
    missing = nvml_standin.run_python(code).stdout.strip()
    assert missing == "[]", f"stand-in lacks NVML symbols: {missing}"
    assert nvml_standin.lib_path is not None
    if shutil.which("nm"):  # and it exports nothing else, so an unplanned symbol cannot sneak in
        assert exported_symbols(nvml_standin.lib_path) == set(REQUIRED_SYMBOLS) | {RESET_SYMBOL}


def _resolved_symbols(fn_name: str, seen: set[str]) -> set[str]:
    """C symbols that ``pynvml.<fn_name>`` resolves, following calls to other pynvml wrappers."""
    if fn_name in seen:
        return set()
    seen.add(fn_name)
    source = inspect.getsource(getattr(pynvml, fn_name))
    symbols = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', source))
    tree = ast.parse(inspect.cleandoc(source) if source.startswith((" ", "\t")) else source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            callee = node.func.id
            if callee.startswith("nvml") and callee != fn_name and inspect.isfunction(getattr(pynvml, callee, None)):
                symbols |= _resolved_symbols(callee, seen)
    return symbols


def test_required_symbols_cover_pynvml_wrappers() -> None:
    needed: set[str] = set()
    for name in AGENT_PYNVML_CALLS:
        needed |= _resolved_symbols(name, set())
    assert needed - set(REQUIRED_SYMBOLS) == set(), "pynvml resolves symbols the stand-in does not list"
    # nvmlInit_v2 is exported for C callers, but pynvml's nvmlInit goes through nvmlInitWithFlags
    assert "nvmlInitWithFlags" in needed and "nvmlInit_v2" not in needed


def test_agent_pynvml_calls_are_covered() -> None:
    """Every pynvml function named in the gpu_watchdog sources must be listed above, so an agent
    change that starts calling a new NVML function fails here until the stand-in implements it."""
    spec = importlib.util.find_spec("gpu_watchdog")
    assert spec is not None and spec.submodule_search_locations
    named: set[str] = set()
    for root in spec.submodule_search_locations:
        for path in Path(root).rglob("*.py"):
            named |= set(re.findall(r"\b(nvml[A-Z]\w*)\b", path.read_text(encoding="utf-8")))
    functions = {n for n in named if inspect.isfunction(getattr(pynvml, n, None))}
    assert functions - set(AGENT_PYNVML_CALLS) == set(), "extend AGENT_PYNVML_CALLS and the stand-in"


def test_missing_symbol_is_lazy_function_not_found(nvml_standin: NvmlStandin) -> None:
    """pynvml resolves symbols at first call, not at nvmlInit: a symbol the library lacks only
    surfaces as NVMLError_FunctionNotFound from that call (hence the symbol tests above)."""
    scripted(nvml_standin, gpus=1)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetPcieThroughput(h[0], 0)", "NVMLError_FunctionNotFound")


def test_package_contains_no_shared_objects() -> None:
    spec = importlib.util.find_spec("gpu_watchdog")
    assert spec is not None and spec.submodule_search_locations
    for root in spec.submodule_search_locations:
        shared = [p for p in Path(root).rglob("*") if p.suffix == ".so" or ".so." in p.name]
        assert shared == [], f"gpu_watchdog must not ship shared objects: {shared}"


def test_importing_gpu_watchdog_does_not_load_nvml(nvml_standin: NvmlStandin) -> None:
    # With the stand-in on LD_LIBRARY_PATH (or a real driver), an eager load would succeed and be seen.
    if nvml_standin.state is not None:
        nvml_standin.state.add_gpu()
    code = (
        "import importlib, pkgutil, json\n"
        "def mapped(): return 'libnvidia-ml' in open('/proc/self/maps').read()\n"
        "import gpu_watchdog\n"
        "report = {'gpu_watchdog': mapped(), 'failed': {}}\n"
        "for m in pkgutil.iter_modules(gpu_watchdog.__path__, 'gpu_watchdog.'):\n"
        "    if m.name == 'gpu_watchdog.__main__': continue\n"
        "    try: importlib.import_module(m.name)\n"
        "    except Exception as e: report['failed'][m.name] = repr(e); continue\n"
        "    report[m.name] = mapped()\n"
        "import pynvml; pynvml.nvmlInit(); report['control_after_nvmlInit'] = mapped()\n"
        "print(json.dumps(report))\n"
    )
    report = json.loads(nvml_standin.run_python(code).stdout)
    assert report.pop("control_after_nvmlInit") is True  # the probe does see a loaded NVML
    failed = report.pop("failed")
    loaded = [name for name, hit in report.items() if hit]
    assert loaded == [], f"importing these loaded libnvidia-ml: {loaded} (import failures: {failed})"


# ------------------------------------------------------------------------------------- lifecycle
def test_init_count_handles_identity(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    state.set(1, uuid="GPU-11111111-2222-3333-4444-555555555555", name="NVIDIA H20")
    state.set_driver_version("575.57.08")
    with nvml_standin.child() as child:
        child.exec(OPEN)
        assert child.eval("pynvml.nvmlSystemGetDriverVersion()") == "575.57.08"
        assert child.eval("len(h)") == 2
        assert child.eval("pynvml.nvmlDeviceGetUUID(h[1])") == "GPU-11111111-2222-3333-4444-555555555555"
        assert child.eval("pynvml.nvmlDeviceGetName(h[1])") == "NVIDIA H20"
        assert child.eval("pynvml.nvmlDeviceGetName(h[0])") == "NVIDIA H100 80GB HBM3"
        assert child.eval("[pynvml.nvmlDeviceGetIndex(x) for x in h]") == [0, 1]
        # the same index gives the same handle
        assert child.eval(
            "ctypes.cast(pynvml.nvmlDeviceGetHandleByIndex(1), ctypes.c_void_p).value"
            " == ctypes.cast(h[1], ctypes.c_void_p).value"
        )
        expect_nvml_error(child, "pynvml.nvmlDeviceGetHandleByIndex(2)", "NVMLError_InvalidArgument")
        # init is reference counted: two inits need two shutdowns
        child.exec("pynvml.nvmlInit(); pynvml.nvmlShutdown()")
        assert child.eval("pynvml.nvmlDeviceGetPowerUsage(h[0])") == 70_000
        child.exec("pynvml.nvmlShutdown()")
        expect_nvml_error(child, "pynvml.nvmlDeviceGetPowerUsage(h[0])", "NVMLError_Uninitialized")
        expect_nvml_error(child, "pynvml.nvmlShutdown()", "NVMLError_Uninitialized")
        assert child.eval("pynvml.nvmlErrorString(15)") == "GPU is lost"


def test_calls_before_init_are_uninitialized(nvml_standin: NvmlStandin) -> None:
    scripted(nvml_standin, gpus=1)
    with nvml_standin.child() as child:
        # the library is loaded by pynvml only inside nvmlInit; load it without initialising
        child.exec("pynvml._LoadNvmlLibrary()")
        expect_nvml_error(child, "pynvml.nvmlDeviceGetCount()", "NVMLError_Uninitialized")


def test_init_errors(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=1)
    state.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with nvml_standin.child() as child:
        expect_nvml_error(child, "pynvml.nvmlInit()", "NVMLError_DriverNotLoaded")
        state.set_init_error(0)
        state.inject_error("nvmlInitWithFlags", pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        expect_nvml_error(child, "pynvml.nvmlInit()", "NVMLError_LibRmVersionMismatch")
        state.clear_error()
        child.exec("pynvml.nvmlInit()")
        assert child.eval("pynvml.nvmlDeviceGetCount()") == 1


def test_without_state_env_behaves_like_no_driver(nvml_standin: NvmlStandin) -> None:
    nvml_standin.require_scripted()
    env = dict(nvml_standin.env)
    del env["NVML_STANDIN_STATE"]
    with PythonChild(env) as child:
        expect_nvml_error(child, "pynvml.nvmlInit()", "NVMLError_DriverNotLoaded")
        assert "NVML_STANDIN_STATE is not set" in child.stderr_text()


# --------------------------------------------------------------------------------------- queries
def test_scalar_queries(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    state.set(
        1,
        utilization_gpu=96,
        utilization_memory=3,
        power_mw=20_500,
        power_limit_mw=500_000,
        temperature_c=61,
        clock_sm_mhz=1755,
        clock_graphics_mhz=1750,
        clock_mem_mhz=2619,
        supported_event_types=pynvml.nvmlEventTypeXidCriticalError,
    )
    with nvml_standin.child() as child:
        child.exec(OPEN)
        util = child.eval("pynvml.nvmlDeviceGetUtilizationRates(h[1])")
        assert util == {"gpu": 96, "memory": 3}
        assert child.eval("pynvml.nvmlDeviceGetPowerUsage(h[1])") == 20_500
        assert child.eval("pynvml.nvmlDeviceGetEnforcedPowerLimit(h[1])") == 500_000
        assert child.eval("pynvml.nvmlDeviceGetTemperature(h[1], pynvml.NVML_TEMPERATURE_GPU)") == 61
        assert child.eval("pynvml.nvmlDeviceGetTemperatureV(h[1], pynvml.NVML_TEMPERATURE_GPU)") == 61
        assert child.eval("pynvml.nvmlDeviceGetClockInfo(h[1], pynvml.NVML_CLOCK_SM)") == 1755
        assert child.eval("pynvml.nvmlDeviceGetClockInfo(h[1], pynvml.NVML_CLOCK_GRAPHICS)") == 1750
        assert child.eval("pynvml.nvmlDeviceGetClockInfo(h[1], pynvml.NVML_CLOCK_MEM)") == 2619
        assert child.eval("pynvml.nvmlDeviceGetSupportedEventTypes(h[1])") == pynvml.nvmlEventTypeXidCriticalError
        assert child.eval("pynvml.nvmlDeviceGetPowerUsage(h[0])") == 70_000  # other GPU: defaults
        # negative temperatures survive the signed field of nvmlTemperature_v1_t
        state.set(0, temperature_c=-5)
        assert child.eval("pynvml.nvmlDeviceGetTemperatureV(h[0], pynvml.NVML_TEMPERATURE_GPU)") == -5
        expect_nvml_error(
            child, "pynvml.nvmlDeviceGetTemperatureV(h[0], pynvml.NVML_TEMPERATURE_GPU_MAX)", "NVMLError_NotSupported"
        )


def test_absent_values_are_not_supported(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=1)
    state.set(0, power_mw=None, clock_video_mhz=None, utilization_memory=None)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetPowerUsage(h[0])", "NVMLError_NotSupported")
        expect_nvml_error(
            child, "pynvml.nvmlDeviceGetClockInfo(h[0], pynvml.NVML_CLOCK_VIDEO)", "NVMLError_NotSupported"
        )
        expect_nvml_error(child, "pynvml.nvmlDeviceGetUtilizationRates(h[0])", "NVMLError_NotSupported")
        assert child.eval("pynvml.nvmlDeviceGetEnforcedPowerLimit(h[0])") == 700_000


def test_pcie_link_current_and_max(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    state.set(1, pcie_link_gen_current=1, pcie_link_width_current=8, pcie_link_gen_max=4, pcie_link_width_max=16)
    link = ("[pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h[{i}]), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h[{i}]),"
            " pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h[{i}]), pynvml.nvmlDeviceGetMaxPcieLinkWidth(h[{i}])]")
    with nvml_standin.child() as child:
        child.exec(OPEN)
        assert child.eval(link.format(i=0)) == [5, 16, 5, 16]  # the default: PCIe 5.0 x16
        assert child.eval(link.format(i=1)) == [1, 8, 4, 16]  # an idle GPU's downshifted link, apart from its max
        state.set(1, pcie_link_gen_max=None, pcie_link_width_current=None)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h[1])", "NVMLError_NotSupported")
        expect_nvml_error(child, "pynvml.nvmlDeviceGetCurrPcieLinkWidth(h[1])", "NVMLError_NotSupported")
        assert child.eval("pynvml.nvmlDeviceGetMaxPcieLinkWidth(h[1])") == 16
        state.inject_error("nvmlDeviceGetMaxPcieLinkWidth", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetMaxPcieLinkWidth(h[0])", "NVMLError_GpuIsLost")


def test_throttled_gpu_clocks_and_reasons(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    thermal = pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    state.throttle(1, thermal, sm_clock_mhz=1140)
    reasons = ("[pynvml.nvmlDeviceGetCurrentClocksEventReasons(h[{i}]),"
               " pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h[{i}])]")
    clocks = ("[pynvml.nvmlDeviceGetClockInfo(h[{i}], pynvml.NVML_CLOCK_SM),"
              " pynvml.nvmlDeviceGetMaxClockInfo(h[{i}], pynvml.NVML_CLOCK_SM),"
              " pynvml.nvmlDeviceGetClockInfo(h[{i}], pynvml.NVML_CLOCK_GRAPHICS),"
              " pynvml.nvmlDeviceGetMaxClockInfo(h[{i}], pynvml.NVML_CLOCK_MEM)]")
    with nvml_standin.child() as child:
        child.exec(OPEN)
        assert child.eval(reasons.format(i=0)) == [0, 0]  # the default: nothing holds the clocks down
        assert child.eval(clocks.format(i=0)) == [1980, 1980, 1980, 2619]
        assert child.eval(reasons.format(i=1)) == [0x60, 0x60]  # both names, one bitmask
        assert child.eval(clocks.format(i=1)) == [1140, 1980, 1140, 2619]  # the SM clock below its maximum
        state.throttle(1, pynvml.nvmlClocksEventReasonGpuIdle, sm_clock_max_mhz=1755)
        assert child.eval(reasons.format(i=1)) == [1, 1]
        assert child.eval("pynvml.nvmlDeviceGetMaxClockInfo(h[1], pynvml.NVML_CLOCK_SM)") == 1755
        state.set(1, clocks_event_reasons=None, clock_sm_max_mhz=None)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetCurrentClocksEventReasons(h[1])", "NVMLError_NotSupported")
        expect_nvml_error(child, "pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h[1])", "NVMLError_NotSupported")
        expect_nvml_error(
            child, "pynvml.nvmlDeviceGetMaxClockInfo(h[1], pynvml.NVML_CLOCK_SM)", "NVMLError_NotSupported"
        )
        # a driver without the newer symbol, played by injection: only that name fails
        state.inject_error("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetCurrentClocksEventReasons(h[0])", "NVMLError_FunctionNotFound")
        assert child.eval("pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h[0])") == 0


def test_pcie_replay_counter_field_and_function(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    state.set_pcie_replays(1, 4242)
    replays = (f"[pynvml.nvmlDeviceGetFieldValues(h[{{i}}], [{FI_PCIE_REPLAY_COUNTER}])[0].value.ullVal,"
               " pynvml.nvmlDeviceGetPcieReplayCounter(h[{i}])]")
    with nvml_standin.child() as child:
        child.exec(OPEN)
        assert child.eval(replays.format(i=0)) == [0, 0]
        assert child.eval(replays.format(i=1)) == [4242, 4242]
        state.set_pcie_replays(1, None)
        assert child.eval(f"pynvml.nvmlDeviceGetFieldValues(h[1], [{FI_PCIE_REPLAY_COUNTER}])[0].nvmlReturn") == (
            pynvml.NVML_ERROR_NOT_SUPPORTED)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetPcieReplayCounter(h[1])", "NVMLError_NotSupported")
        state.set_field(1, FI_PCIE_REPLAY_COUNTER, error=pynvml.NVML_ERROR_UNKNOWN)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetPcieReplayCounter(h[1])", "NVMLError_Unknown")


def _nvml_h_defines() -> dict[str, int]:
    text = (find_nvml_include() / "nvml.h").read_text(encoding="utf-8", errors="replace")
    defines: dict[str, int] = {}
    for name, value in re.findall(r"^\s*#define\s+(\w+)\s+(0x[0-9A-Fa-f]+|\d+)(?:LL|ULL|U|L)?\b", text, re.M):
        defines[name] = int(value, 0)
    for name, alias in re.findall(r"^\s*#define\s+(\w+)\s+([A-Za-z_]\w*)\s*(?://.*)?$", text, re.M):
        if alias in defines:  # the deprecated nvmlClocksThrottleReason* names alias the newer ones
            defines.setdefault(name, defines[alias])
    return defines


def test_agent_clock_reason_bits_and_replay_field_match_nvml_h() -> None:
    """The agent's clocks event reason bits and the replay counter's field id, against NVIDIA's nvml.h itself."""
    from gpu_watchdog.sample import nvml

    defines = _nvml_h_defines()
    for ours, name in [
        (nvml.CLOCKS_EVENT_GPU_IDLE, "GpuIdle"),
        (nvml.CLOCKS_EVENT_APPLICATIONS_CLOCKS_SETTING, "ApplicationsClocksSetting"),
        (nvml.CLOCKS_EVENT_SW_POWER_CAP, "SwPowerCap"),
        (nvml.CLOCKS_EVENT_HW_SLOWDOWN, "HwSlowdown"),
        (nvml.CLOCKS_EVENT_SYNC_BOOST, "SyncBoost"),
        (nvml.CLOCKS_EVENT_SW_THERMAL_SLOWDOWN, "SwThermalSlowdown"),
        (nvml.CLOCKS_EVENT_HW_THERMAL_SLOWDOWN, "HwThermalSlowdown"),
        (nvml.CLOCKS_EVENT_HW_POWER_BRAKE_SLOWDOWN, "HwPowerBrakeSlowdown"),
        (nvml.CLOCKS_EVENT_DISPLAY_CLOCK_SETTING, "DisplayClockSetting"),
    ]:
        # nvml.h 13 spells some bits only as nvmlClocksThrottleReason*, the rest as nvmlClocksEventReason*
        header = defines.get(f"nvmlClocksEventReason{name}", defines.get(f"nvmlClocksThrottleReason{name}"))
        assert ours == header, name
    assert nvml.FI_PCIE_REPLAY_COUNTER == defines["NVML_FI_DEV_PCIE_REPLAY_COUNTER"] == FI_PCIE_REPLAY_COUNTER
    for fid, name in [(nvml.FI_NVLINK_TX_KIB, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"),
                      (nvml.FI_NVLINK_RX_KIB, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"),
                      (nvml.FI_PCIE_TX_BYTES, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES"),
                      (nvml.FI_PCIE_RX_BYTES, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES")]:
        assert fid == defines[name], name


def test_memory_info_v1_and_v2(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=1)
    state.set(0, memory_total=80 * GIB, memory_used=60 * GIB, memory_reserved=GIB // 2)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        v1 = child.eval("pynvml.nvmlDeviceGetMemoryInfo(h[0])")
        # v1 "used" includes the reserved memory (nvml.h); total = free + used
        assert v1 == {"total": 80 * GIB, "used": 60 * GIB + GIB // 2, "free": 20 * GIB - GIB // 2}
        v2 = child.eval("pynvml.nvmlDeviceGetMemoryInfo(h[0], version=pynvml.nvmlMemory_v2)")
        assert v2 == {
            "version": pynvml.nvmlMemory_v2,
            "total": 80 * GIB,
            "reserved": GIB // 2,
            "used": 60 * GIB,
            "free": 20 * GIB - GIB // 2,
        }
        # the versioned struct is checked like the real library does
        expect_nvml_error(
            child, "pynvml.nvmlDeviceGetMemoryInfo(h[0], version=0x01000028)", "NVMLError_ArgumentVersionMismatch"
        )


def test_field_values(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=1)
    with state.batch():
        state.set_field(0, 138, 10_000)
        state.set_field(0, 139, 2**63 + 5)  # wrapping counters use the full 64 bits
        state.set_field(0, 138, 7, scope=1)  # per-link entry answers scopeId 1 only
        state.set_field(0, 197, error=pynvml.NVML_ERROR_NOT_SUPPORTED)
        state.set_field(0, 198, 123_456)
        state.set_field(0, 140, 1.5)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        vals = child.eval("pynvml.nvmlDeviceGetFieldValues(h[0], [138, 139, 197, 198, (138, 1), 140, 250])")
        by_pos = [(v["fieldId"], v["scopeId"], v["nvmlReturn"], v["valueType"]) for v in vals]
        ull, dbl = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, pynvml.NVML_VALUE_TYPE_DOUBLE
        assert by_pos == [
            (138, 0, 0, ull),
            (139, 0, 0, ull),
            (197, 0, pynvml.NVML_ERROR_NOT_SUPPORTED, ull),
            (198, 0, 0, ull),
            (138, 1, 0, ull),
            (140, 0, 0, dbl),
            (250, 0, pynvml.NVML_ERROR_NOT_SUPPORTED, ull),
        ]
        assert [vals[i]["value"]["ullVal"] for i in (0, 1, 3, 4)] == [10_000, 2**63 + 5, 123_456, 7]
        assert vals[5]["value"]["dVal"] == 1.5
        assert abs(vals[0]["timestamp"] / 1e6 - time.time()) < 60  # microseconds since the epoch


def test_compute_processes(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        # no processes: pynvml's first (sizing) call gets NVML_SUCCESS and returns []
        assert child.eval("pynvml.nvmlDeviceGetComputeRunningProcesses(h[0])") == []
        with state.batch():
            state.place_process(0, pid=4242, mem_bytes=12 * GIB)
            state.place_process(0, pid=4343, mem_bytes=None)  # NVML_VALUE_NOT_AVAILABLE
        procs = child.eval("[vars(p) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h[0])]")
        assert procs == [
            {"pid": 4242, "usedGpuMemory": 12 * GIB, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF},
            # pynvml turns NOT_AVAILABLE (2**64-1) into None
            {"pid": 4343, "usedGpuMemory": None, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF},
        ]
        assert child.eval("pynvml.nvmlDeviceGetComputeRunningProcesses(h[1])") == []
        state.remove_process(0, 4242)
        assert child.eval("[p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h[0])]") == [4343]


def test_process_utilization(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=1)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        # no samples: NOT_FOUND, as documented in nvml.h
        expect_nvml_error(child, "pynvml.nvmlDeviceGetProcessUtilization(h[0], 0)", "NVMLError_NotFound")
        t1 = state.add_process_sample(0, pid=11, sm_util=97, mem_util=4, timestamp_us=1_000_000)
        state.add_process_sample(0, pid=12, sm_util=0, mem_util=0, timestamp_us=2_000_000)
        samples = child.eval("pynvml.nvmlDeviceGetProcessUtilization(h[0], 0)")
        assert [(s["pid"], s["smUtil"], s["memUtil"], s["timeStamp"]) for s in samples] == [
            (11, 97, 4, 1_000_000),
            (12, 0, 0, 2_000_000),
        ]
        # lastSeenTimeStamp filters older samples; nothing newer -> NOT_FOUND again
        assert [s["pid"] for s in child.eval(f"pynvml.nvmlDeviceGetProcessUtilization(h[0], {t1})")] == [12]
        expect_nvml_error(child, "pynvml.nvmlDeviceGetProcessUtilization(h[0], 2_000_000)", "NVMLError_NotFound")


# ---------------------------------------------------------------------------------------- events
def test_events_timeout_and_xid(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    with nvml_standin.child() as child:
        child.exec(
            OPEN + "es = pynvml.nvmlEventSetCreate()\n"
            "pynvml.nvmlDeviceRegisterEvents(h[1], pynvml.nvmlEventTypeXidCriticalError, es)\n"
        )
        t0 = time.monotonic()
        expect_nvml_error(child, "pynvml.nvmlEventSetWait(es, 100)", "NVMLError_Timeout")
        assert time.monotonic() - t0 >= 0.09  # it really waited for the timeout
        state.queue_xid(1, 79)
        data = child.eval(
            "(lambda d: (pynvml.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData,"
            " ctypes.cast(d.device, ctypes.c_void_p).value == ctypes.cast(h[1], ctypes.c_void_p).value,"
            " d.gpuInstanceId))(pynvml.nvmlEventSetWait(es, 1000))"
        )
        assert data == [1, pynvml.nvmlEventTypeXidCriticalError, 79, True, 0xFFFFFFFF]
        # delivered once: the next wait times out again
        expect_nvml_error(child, "pynvml.nvmlEventSetWait(es, 0)", "NVMLError_Timeout")
        # an event for a GPU the set has not registered stays queued until it is registered
        state.queue_xid(0, 48)
        expect_nvml_error(child, "pynvml.nvmlEventSetWait(es, 20)", "NVMLError_Timeout")
        child.exec("pynvml.nvmlDeviceRegisterEvents(h[0], pynvml.nvmlEventTypeXidCriticalError, es)")
        assert child.eval("pynvml.nvmlEventSetWait(es, 0).eventData") == 48
        child.exec("pynvml.nvmlEventSetFree(es)")


def test_xid_queued_during_wait_is_delivered(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=1)
    with nvml_standin.child() as child:
        child.exec(
            OPEN + "es = pynvml.nvmlEventSetCreate()\n"
            "pynvml.nvmlDeviceRegisterEvents(h[0], pynvml.nvmlEventTypeXidCriticalError, es)\n"
        )
        timer = threading.Timer(0.3, state.queue_xid, args=(0, 119))
        timer.start()
        t0 = time.monotonic()
        try:
            assert child.eval("pynvml.nvmlEventSetWait(es, 10_000).eventData") == 119
        finally:
            timer.join()
        assert 0.25 <= time.monotonic() - t0 < 3.0


def test_event_registration_errors(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=1)
    state.set(0, supported_event_types=pynvml.nvmlEventTypeXidCriticalError)
    with nvml_standin.child() as child:
        child.exec(OPEN + "es = pynvml.nvmlEventSetCreate()\n")
        expect_nvml_error(
            child,
            "pynvml.nvmlDeviceRegisterEvents(h[0], pynvml.nvmlEventTypeXidCriticalError"
            " | pynvml.nvmlEventTypeDoubleBitEccError, es)",
            "NVMLError_NotSupported",
        )
        state.set(0, supported_event_types=None)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetSupportedEventTypes(h[0])", "NVMLError_NotSupported")
        state.inject_error("nvmlEventSetWait_v2", pynvml.NVML_ERROR_GPU_IS_LOST)
        expect_nvml_error(child, "pynvml.nvmlEventSetWait(es, 0)", "NVMLError_GpuIsLost")


def test_event_wait_does_not_block_other_calls(nvml_standin: NvmlStandin) -> None:
    """ctypes drops the GIL and the library drops its lock while waiting: a sampler thread keeps
    running next to a thread blocked in nvmlEventSetWait (the agent's layout)."""
    scripted(nvml_standin, gpus=1)
    with nvml_standin.child() as child:
        child.exec(
            OPEN + "import threading, time\n"
            "es = pynvml.nvmlEventSetCreate()\n"
            "pynvml.nvmlDeviceRegisterEvents(h[0], pynvml.nvmlEventTypeXidCriticalError, es)\n"
            "def waiter():\n"
            "    try: pynvml.nvmlEventSetWait(es, 600)\n"
            "    except pynvml.NVMLError_Timeout: pass\n"
            "t = threading.Thread(target=waiter); t.start(); time.sleep(0.05)\n"
            "t0 = time.monotonic()\n"
            "powers = [pynvml.nvmlDeviceGetPowerUsage(h[0]) for _ in range(200)]\n"
            "took = time.monotonic() - t0; alive = t.is_alive(); t.join()\n"
        )
        assert child.eval("alive") is True
        assert child.eval("took") < 5.0  # a held GIL would block for the whole 600 s wait
        assert child.eval("set(powers)") == [70_000]


# ------------------------------------------------------------------------------ error injection
@pytest.mark.parametrize(
    ("code", "class_name"),
    [
        (pynvml.NVML_ERROR_NOT_SUPPORTED, "NVMLError_NotSupported"),
        (pynvml.NVML_ERROR_GPU_IS_LOST, "NVMLError_GpuIsLost"),
        (pynvml.NVML_ERROR_RESET_REQUIRED, "NVMLError_ResetRequired"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVMLError_Unknown"),
    ],
)
def test_error_injection_per_function_and_gpu(nvml_standin: NvmlStandin, code: int, class_name: str) -> None:
    state = scripted(nvml_standin, gpus=2)
    state.inject_error("nvmlDeviceGetPowerUsage", code, gpu=1)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        err = expect_nvml_error(child, "pynvml.nvmlDeviceGetPowerUsage(h[1])", class_name)
        assert err.value == code
        assert child.eval("pynvml.nvmlDeviceGetPowerUsage(h[0])") == 70_000  # other GPU unaffected
        assert child.eval("pynvml.nvmlDeviceGetTemperature(h[1], 0)") == 35  # other function unaffected


def test_error_injection_wildcard_and_clear(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        state.inject_error("*", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
        for expr in (
            "pynvml.nvmlDeviceGetMemoryInfo(h[0])",
            "pynvml.nvmlDeviceGetUUID(h[0])",
            "pynvml.nvmlDeviceGetFieldValues(h[0], [138])",
            "pynvml.nvmlDeviceGetComputeRunningProcesses(h[0])",
            "pynvml.nvmlDeviceGetHandleByIndex(0)",
        ):
            expect_nvml_error(child, expr, "NVMLError_GpuIsLost")
        assert child.eval("pynvml.nvmlDeviceGetCount()") == 2  # not device-specific: unaffected
        assert child.eval("pynvml.nvmlDeviceGetUUID(h[1])").startswith("GPU-")
        # the newest matching entry wins over the wildcard
        state.inject_error("nvmlDeviceGetUUID", pynvml.NVML_ERROR_RESET_REQUIRED, gpu=0)
        expect_nvml_error(child, "pynvml.nvmlDeviceGetUUID(h[0])", "NVMLError_ResetRequired")
        state.clear_error()
        assert child.eval("pynvml.nvmlDeviceGetUUID(h[0])").startswith("GPU-")


# ------------------------------------------------------------------------------ live state changes
def test_state_changes_reach_a_running_process(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=2)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        seen = []
        for watts in (100, 101, 102, 103, 104):  # back-to-back writes of equal size must all be seen
            state.set(0, power_mw=watts * 1000)
            seen.append(child.eval("pynvml.nvmlDeviceGetPowerUsage(h[0])"))
        assert seen == [100_000, 101_000, 102_000, 103_000, 104_000]
        state.set(0, utilization_gpu=0, memory_used=70 * GIB)
        assert child.eval("pynvml.nvmlDeviceGetUtilizationRates(h[0]).gpu") == 0
        assert child.eval("pynvml.nvmlDeviceGetMemoryInfo(h[0]).used") == 70 * GIB
        # a GPU that drops out of the device count: its old handle reports GPU_IS_LOST
        state.set_device_count(1)
        assert child.eval("pynvml.nvmlDeviceGetCount()") == 1
        expect_nvml_error(child, "pynvml.nvmlDeviceGetPowerUsage(h[1])", "NVMLError_GpuIsLost")
        state.set_device_count(None)
        assert child.eval("pynvml.nvmlDeviceGetPowerUsage(h[1])") == 70_000


def test_bad_state_file_fails_loudly(nvml_standin: NvmlStandin) -> None:
    state = scripted(nvml_standin, gpus=1)
    with nvml_standin.child() as child:
        child.exec(OPEN)
        good = state.path.read_text()
        for bad, needle in (
            ("{not json", "bad state file"),
            ('{"version": 1, "gpus": [{"powr_mw": 5}]}', 'unknown gpu key (at key "powr_mw")'),
        ):
            tmp = state.path.with_suffix(".tmp")
            tmp.write_text(bad)
            os.replace(tmp, state.path)
            expect_nvml_error(child, "pynvml.nvmlDeviceGetPowerUsage(h[0])", "NVMLError_Unknown")
            assert needle in child.stderr_text()
        state.write()  # a good file again: the same process recovers
        assert state.path.read_text() == good
        assert child.eval("pynvml.nvmlDeviceGetPowerUsage(h[0])") == 70_000


def test_state_helpers_validate(tmp_path: Path) -> None:
    state = StandinState(tmp_path / "s.json")
    gpu = state.add_gpu()
    with pytest.raises(KeyError, match="powr_mw"):
        state.set(gpu, powr_mw=5)
    with pytest.raises(TypeError):
        state.set(gpu, power_mw=1.5)
    with pytest.raises(ValueError):
        state.set(gpu, pcie_link_width_max=-16)
    with pytest.raises(ValueError):
        state.throttle(gpu, -1)
    with pytest.raises(TypeError):
        state.throttle(gpu, 0x20, sm_clock_mhz=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        state.set_pcie_replays(gpu, -3)
    with pytest.raises(ValueError):
        state.set_field(gpu, 138, -1)
    with pytest.raises(IndexError):
        state.queue_xid(3, 79)
    with pytest.raises(ValueError):
        state.set_device_count(2)
    # a batch is one write
    before = state.path.stat().st_mtime_ns
    with state.batch():
        state.set(gpu, power_mw=1)
        assert state.path.stat().st_mtime_ns == before
        state.set(gpu, power_mw=2)
    assert '"power_mw": 2' in state.path.read_text()


# ------------------------------------------------------------------------------ in-process loading
def test_load_in_process_matches_soname(nvml_standin: NvmlStandin) -> None:
    """Without LD_LIBRARY_PATH, a preload by absolute path satisfies pynvml's CDLL("libnvidia-ml.so.1")
    (glibc matches the SONAME).  Run in a subprocess: a loaded library cannot be unloaded."""
    scripted(nvml_standin, gpus=3)
    assert nvml_standin.lib_path is not None
    env = dict(nvml_standin.env)
    env.pop("LD_LIBRARY_PATH")
    tests_dir = str(TESTS / "support")
    code = (
        f"import sys; sys.path.insert(0, {tests_dir!r})\n"
        "from nvml_standin import load_in_process\n"
        f"lib = load_in_process({str(nvml_standin.lib_path)!r})\n"
        "import pynvml\n"
        "pynvml.nvmlInit(); n = pynvml.nvmlDeviceGetCount()\n"
        "lib.nvml_standin_reset()  # forgets the init refcount\n"
        "try: pynvml.nvmlDeviceGetCount(); print('still initialised')\n"
        "except pynvml.NVMLError_Uninitialized: pass\n"
        "maps = [l.split()[-1] for l in open('/proc/self/maps') if 'libnvidia-ml' in l]\n"
        "print(n, sorted(set(maps)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == f"3 {[os.path.realpath(nvml_standin.lib_path)]}"


# --------------------------------------------------------------------- contract (stand-in or real)
def test_contract_shapes(nvml_standin: NvmlStandin) -> None:
    """Runs against the stand-in, or against the real driver with NVML_STANDIN_REAL=1: the types
    and invariants the agent relies on, whatever the values."""
    if nvml_standin.state is not None:
        nvml_standin.state.add_gpu()
    with nvml_standin.child() as child:
        child.exec(OPEN)
        assert child.eval("len(h)") >= 1
        assert isinstance(child.eval("pynvml.nvmlSystemGetDriverVersion()"), str)
        for i in range(child.eval("len(h)")):
            assert child.eval(f"pynvml.nvmlDeviceGetUUID(h[{i}])").startswith(("GPU-", "MIG-"))
            mem = child.eval(f"pynvml.nvmlDeviceGetMemoryInfo(h[{i}])")
            assert mem["total"] > 0 and mem["used"] + mem["free"] <= mem["total"]
            util = child.eval(f"pynvml.nvmlDeviceGetUtilizationRates(h[{i}])")
            assert 0 <= util["gpu"] <= 100 and 0 <= util["memory"] <= 100
            assert isinstance(child.eval(f"pynvml.nvmlDeviceGetComputeRunningProcesses(h[{i}])"), list)
            vals = child.eval(f"pynvml.nvmlDeviceGetFieldValues(h[{i}], [138, 139, 197, 198])")
            assert [v["fieldId"] for v in vals] == [138, 139, 197, 198]
        child.exec("es = pynvml.nvmlEventSetCreate()")
        expect_nvml_error(child, "pynvml.nvmlEventSetWait(es, 1)", "NVMLError_Timeout")
        child.exec("pynvml.nvmlEventSetFree(es); pynvml.nvmlShutdown()")
