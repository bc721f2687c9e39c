"""A scriptable stand-in for ``libnvidia-ml.so.1`` (test code only; never packaged).

``standin.c`` is compiled at test time against NVIDIA's real ``nvml.h`` (PyPI ``nvidia-nvml-dev``) and
loaded by the real ``pynvml``, so the agent's NVML code runs unchanged on a machine without a GPU.
GPU state is a JSON file named by ``$NVML_STANDIN_STATE``; the library re-reads it whenever it changes,
so a test can change state while the process under test keeps running.  See ``docs/nvml-standin.md``.

Typical use (from a test, through the ``nvml_standin`` fixture in ``fixtures.py``)::

    gpu = nvml_standin.state.add_gpu(power_mw=250_000)
    nvml_standin.state.place_process(gpu, pid=1234, mem_bytes=8 << 30)
    with nvml_standin.child() as child:          # a Python subprocess with the stand-in env
        child.exec("pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)")
        assert child.eval("pynvml.nvmlDeviceGetPowerUsage(h)") == 250_000
        nvml_standin.state.inject_error("nvmlDeviceGetPowerUsage", 15, gpu=gpu)
        with pytest.raises(ChildError) as err:
            child.eval("pynvml.nvmlDeviceGetPowerUsage(h)")
        assert err.value.type_name == "NVMLError_GpuIsLost"
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "REQUIRED_SYMBOLS",
    "SOURCE",
    "LIB_NAME",
    "StandinBuildError",
    "StandinState",
    "ChildError",
    "PythonChild",
    "NvmlStandin",
    "find_nvml_include",
    "build_standin",
    "standin_env",
    "load_in_process",
]

SOURCE = Path(__file__).with_name("standin.c")
LIB_NAME = "libnvidia-ml.so.1"

#: Every NVML symbol the agent reaches through pynvml.  pynvml resolves symbols lazily (at the first
#: call of each wrapper, not at nvmlInit), and a missing one surfaces only as NVMLError_FunctionNotFound
#: from that call, which an agent may well treat as "feature absent".  test_nvml_standin.py therefore
#: checks that the built library exports all of these.
REQUIRED_SYMBOLS: tuple[str, ...] = (
    "nvmlInitWithFlags",
    "nvmlInit_v2",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetIndex",
    "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    # The deprecated name of the same bitmask: the agent falls back to it where a driver lacks the newer symbol.
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    # The agent reads the replay counter as a field value (NVML_FI_DEV_PCIE_REPLAY_COUNTER); the function answers
    # the same counter, for tests that compare the two.
    "nvmlDeviceGetPcieReplayCounter",
)

#: Exported besides REQUIRED_SYMBOLS: resets the library's process-local state (in-process use only).
RESET_SYMBOL = "nvml_standin_reset"

# A few NVML constants the helpers need (values from nvml.h; tests should prefer pynvml's names).
EVENT_XID_CRITICAL_ERROR = 0x0000000000000008
DEFAULT_SUPPORTED_EVENTS = 0x1 | 0x2 | 0x4 | 0x8 | 0x10  # SBE, DBE, PState, Xid, Clock
FI_NVLINK_THROUGHPUT_DATA_TX = 138
FI_NVLINK_THROUGHPUT_DATA_RX = 139
FI_PCIE_COUNT_TX_BYTES = 197
FI_PCIE_COUNT_RX_BYTES = 198
FI_PCIE_REPLAY_COUNTER = 94  # NVML_FI_DEV_PCIE_REPLAY_COUNTER; nvmlDeviceGetPcieReplayCounter answers it too

#: Per-GPU scalar keys.  Absent or null means the query returns NVML_ERROR_NOT_SUPPORTED.
SCALAR_KEYS = frozenset(
    {
        "memory_total",
        "memory_used",
        "memory_reserved",
        "utilization_gpu",
        "utilization_memory",
        "power_mw",
        "power_limit_mw",
        "temperature_c",
        "clock_graphics_mhz",
        "clock_sm_mhz",
        "clock_mem_mhz",
        "clock_video_mhz",
        "supported_event_types",
        "pcie_link_gen_current",
        "pcie_link_gen_max",
        "pcie_link_width_current",
        "pcie_link_width_max",
        "clock_graphics_max_mhz",
        "clock_sm_max_mhz",
        "clock_mem_max_mhz",
        "clock_video_max_mhz",
        "clocks_event_reasons",
    }
)
GPU_KEYS = SCALAR_KEYS | {"uuid", "name", "fields", "processes", "process_samples"}

GIB = 1 << 30


class StandinBuildError(RuntimeError):
    """The stand-in could not be compiled (no compiler, no nvml.h, or a compile error)."""


# --------------------------------------------------------------------------------------- build
def find_nvml_include() -> Path:
    """Directory holding NVIDIA's ``nvml.h`` from the ``nvidia-nvml-dev`` wheel (``$NVML_STANDIN_INCLUDE``
    overrides).  The wheel installs into the ``nvidia`` namespace package, e.g. ``nvidia/cu13/include``."""
    override = os.environ.get("NVML_STANDIN_INCLUDE")
    if override:
        if not (Path(override) / "nvml.h").is_file():
            raise StandinBuildError(f"NVML_STANDIN_INCLUDE={override} has no nvml.h")
        return Path(override)
    try:
        import nvidia  # namespace package provided by nvidia-nvml-dev (and other nvidia-* wheels)
    except ImportError as exc:
        raise StandinBuildError("nvml.h not found: install the test extra (PyPI nvidia-nvml-dev)") from exc
    candidates = [p for base in nvidia.__path__ for p in Path(base).glob("*/include/nvml.h")]
    if not candidates:
        raise StandinBuildError(f"no */include/nvml.h under {list(nvidia.__path__)}: install nvidia-nvml-dev")
    return sorted(candidates, reverse=True)[0].parent  # newest CUDA major first (cu13 > cu12)


def build_standin(
    out_dir: str | os.PathLike[str], *, cc: str | None = None, extra_cflags: Sequence[str] | None = None
) -> Path:
    """Compile ``standin.c`` into ``out_dir/libnvidia-ml.so.1`` and return that path.

    ``cc`` defaults to ``$CC`` or gcc; ``extra_cflags`` to ``$NVML_STANDIN_CFLAGS`` (e.g. sanitizers).

    Warnings are errors, and ``-Wmissing-prototypes`` makes every exported function need a prototype
    from nvml.h, so a misspelt symbol or a signature that drifts from the header fails the build.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    include = find_nvml_include()
    compiler = cc or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise StandinBuildError("no C compiler (gcc) on PATH; the NVML stand-in is compiled at test time")
    target = out / LIB_NAME
    tmp = out / f".{LIB_NAME}.{os.getpid()}.tmp"
    cmd = [
        compiler, "-std=c11", "-O2", "-g",
        "-Wall", "-Wextra", "-Werror", "-Wmissing-prototypes", "-Wstrict-prototypes", "-Wshadow",
        "-fPIC", "-shared", "-pthread",
        "-isystem", str(include),
        f"-Wl,-soname,{LIB_NAME}", "-Wl,--no-undefined",
        "-o", str(tmp), str(SOURCE),
    ]  # fmt: skip
    if extra_cflags is None:
        extra_cflags = shlex.split(os.environ.get("NVML_STANDIN_CFLAGS", ""))
    cmd[1:1] = list(extra_cflags)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise StandinBuildError(f"{' '.join(cmd)}\nfailed ({proc.returncode}):\n{proc.stderr}")
    os.replace(tmp, target)
    return target


def standin_env(
    lib_dir: str | os.PathLike[str],
    state_path: str | os.PathLike[str],
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a subprocess whose ``CDLL("libnvidia-ml.so.1")`` should find the stand-in."""
    env = dict(os.environ if base is None else base)
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = f"{os.fspath(lib_dir)}:{old}" if old else os.fspath(lib_dir)
    env["NVML_STANDIN_STATE"] = os.fspath(state_path)
    return env


def load_in_process(lib_path: str | os.PathLike[str]) -> ctypes.CDLL:
    """Make the *current* process's pynvml use the stand-in, without LD_LIBRARY_PATH.

    The library is built with SONAME ``libnvidia-ml.so.1``; once loaded by absolute path, glibc
    answers pynvml's later ``CDLL("libnvidia-ml.so.1")`` with this same object.  It cannot be unloaded,
    so prefer subprocesses (``standin_env`` / ``NvmlStandin.child``); in-process, also set
    ``NVML_STANDIN_STATE`` (e.g. with ``monkeypatch.setenv``) and call ``lib.nvml_standin_reset()``
    between tests.  Refuses if pynvml already loaded some other NVML library.
    """
    import pynvml

    lib = ctypes.CDLL(os.fspath(lib_path), mode=ctypes.RTLD_GLOBAL)
    lib.nvml_standin_reset.restype = None
    lib.nvml_standin_reset.argtypes = []
    loaded = pynvml.nvmlLib
    if loaded is not None:

        def addr(dll: ctypes.CDLL) -> int | None:
            try:
                return ctypes.cast(getattr(dll, RESET_SYMBOL), ctypes.c_void_p).value
            except AttributeError:
                return None

        if addr(loaded) != addr(lib):
            raise RuntimeError("pynvml already loaded a different libnvidia-ml.so.1 in this process")
    return lib


# --------------------------------------------------------------------------------------- state
def _default_uuid(index: int) -> str:
    return f"GPU-5eed{index:04x}-0000-4000-8000-{index:012x}"


def _check_scalar(key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be an int or None, not {value!r}")
    if value < 0 and key != "temperature_c":
        raise ValueError(f"{key} must be >= 0, not {value}")


def _check_field_value(field_id: Any, value: Any) -> None:
    if isinstance(value, dict):
        if set(value) != {"error"} or not isinstance(value["error"], int) or value["error"] <= 0:
            raise ValueError(f"field {field_id}: an error entry is {{'error': <non-zero code>}}, not {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"field {field_id}: value must be a non-negative int/float, not {value!r}")


class StandinState:
    """The stand-in's GPU state, written as JSON atomically (temp file + rename) after every change.

    Use ``with state.batch():`` to apply several changes as one write (the library then never sees
    the half-way state).  ``data`` is the raw document (schema in docs/nvml-standin.md).
    """

    _tmp_counter = itertools.count()

    def __init__(self, path: str | os.PathLike[str], *, driver_version: str = "580.65.06") -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {
            "version": 1,
            "driver_version": driver_version,
            "init_error": 0,
            "device_count": None,
            "gpus": [],
            "errors": [],
            "events": [],
        }
        self._next_seq = 1
        self._batch_depth = 0
        self._mtime_ns = 0
        self.write()

    # -- writing
    def write(self) -> None:
        """Write the document now (a no-op inside ``batch()``; the batch writes once at its end)."""
        if self._batch_depth:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{next(self._tmp_counter)}.tmp")
        with open(tmp, "w", encoding="ascii") as fh:
            json.dump(self.data, fh, indent=1)
        # The library notices changes by (inode, size, mtime).  Inodes get reused and kernels
        # without fine-grained timestamps tick every few ms, so stamp a strictly increasing mtime.
        self._mtime_ns = max(time.time_ns(), self._mtime_ns + 1000)
        os.utime(tmp, ns=(self._mtime_ns, self._mtime_ns))
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def batch(self) -> Iterator[StandinState]:
        self._batch_depth += 1
        try:
            yield self
        finally:
            self._batch_depth -= 1
            self.write()

    # -- globals
    def set_driver_version(self, version: str) -> None:
        self.data["driver_version"] = version
        self.write()

    def set_init_error(self, code: int) -> None:
        """Make nvmlInit (both symbols) return ``code`` (0 clears), e.g. 9 = DRIVER_NOT_LOADED."""
        self.data["init_error"] = int(code)
        self.write()

    def set_device_count(self, count: int | None) -> None:
        """Report fewer devices than listed (None: all).  Handles to hidden GPUs get GPU_IS_LOST."""
        if count is not None and not 0 <= count <= len(self.data["gpus"]):
            raise ValueError(f"device_count must be within 0..{len(self.data['gpus'])}")
        self.data["device_count"] = count
        self.write()

    # -- GPUs
    def add_gpu(self, **fields: Any) -> int:
        """Append a GPU (an H100-like default, overridden by ``fields``); returns its index."""
        index = len(self.data["gpus"])
        gpu: dict[str, Any] = {
            "uuid": _default_uuid(index),
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total": 80 * GIB,
            "memory_used": 0,
            "memory_reserved": 0,
            "utilization_gpu": 0,
            "utilization_memory": 0,
            "power_mw": 70_000,
            "power_limit_mw": 700_000,
            "temperature_c": 35,
            "clock_graphics_mhz": 1980,
            "clock_sm_mhz": 1980,
            "clock_mem_mhz": 2619,
            "clock_video_mhz": 1545,
            "clock_graphics_max_mhz": 1980,  # an H100 SXM's boost clocks: the current ones run at them
            "clock_sm_max_mhz": 1980,
            "clock_mem_max_mhz": 2619,
            "clock_video_max_mhz": 1545,
            "clocks_event_reasons": 0,  # nothing holds the clocks down
            "supported_event_types": DEFAULT_SUPPORTED_EVENTS,
            "pcie_link_gen_current": 5,  # an H100 SXM's link: PCIe 5.0 x16
            "pcie_link_gen_max": 5,
            "pcie_link_width_current": 16,
            "pcie_link_width_max": 16,
            "fields": {
                str(FI_NVLINK_THROUGHPUT_DATA_TX): 0,
                str(FI_NVLINK_THROUGHPUT_DATA_RX): 0,
                str(FI_PCIE_COUNT_TX_BYTES): 0,
                str(FI_PCIE_COUNT_RX_BYTES): 0,
                str(FI_PCIE_REPLAY_COUNTER): 0,
            },
            "processes": [],
            "process_samples": [],
        }
        self.data["gpus"].append(gpu)
        try:
            self.set(index, **fields)  # validates and writes
        except Exception:
            self.data["gpus"].pop()
            raise
        return index

    def gpu(self, gpu: int) -> dict[str, Any]:
        """The raw dict of one GPU (mutate it, then call ``write()``, for anything the helpers lack)."""
        return self.data["gpus"][gpu]

    def set(self, gpu: int, **fields: Any) -> None:
        """Update GPU ``gpu``'s keys; a scalar set to None makes its query return NOT_SUPPORTED."""
        g = self.gpu(gpu)
        unknown = set(fields) - GPU_KEYS
        if unknown:
            raise KeyError(f"unknown GPU keys {sorted(unknown)}; known: {sorted(GPU_KEYS)}")
        for key, value in fields.items():
            if key in SCALAR_KEYS:
                _check_scalar(key, value)
            elif key in ("uuid", "name") and not isinstance(value, str):
                raise TypeError(f"{key} must be a str")
            elif key == "fields":
                for fid, fval in value.items():
                    _check_field_value(fid, fval)
                value = {str(k): v for k, v in value.items()}
        g.update(fields)
        self.write()

    def set_field(
        self,
        gpu: int,
        field_id: int,
        value: int | float | None = None,
        *,
        scope: int | None = None,
        error: int | None = None,
    ) -> None:
        """Set one field value (``nvmlDeviceGetFieldValues``), or its per-field nvmlReturn with
        ``error=code``; ``value=None`` and no error removes it (-> NOT_SUPPORTED).  ``scope`` makes an
        entry that only answers requests with that scopeId (e.g. an NVLink link id)."""
        key = str(field_id) if scope is None else f"{field_id}:{scope}"
        fields = self.gpu(gpu)["fields"]
        if error is not None:
            fields[key] = {"error": int(error)}
        elif value is None:
            fields.pop(key, None)
        else:
            _check_field_value(key, value)
            fields[key] = value
        self.write()

    def throttle(
        self,
        gpu: int,
        reasons: int,
        *,
        sm_clock_mhz: int | None = None,
        sm_clock_max_mhz: int | None = None,
    ) -> None:
        """Play a GPU whose clocks are held down: ``clocks_event_reasons`` (both clocks event reasons functions)
        becomes ``reasons``, an nvmlClocksEventReason* bitmask (prefer pynvml's names, e.g.
        ``pynvml.nvmlClocksEventReasonSwThermalSlowdown``; 0 clears), and, when given, the SM clock (the graphics
        clock follows it, as on a real GPU) and its maximum.  One write."""
        fields: dict[str, Any] = {"clocks_event_reasons": reasons}
        if sm_clock_mhz is not None:
            fields.update(clock_sm_mhz=sm_clock_mhz, clock_graphics_mhz=sm_clock_mhz)
        if sm_clock_max_mhz is not None:
            fields["clock_sm_max_mhz"] = sm_clock_max_mhz
        self.set(gpu, **fields)

    def set_pcie_replays(self, gpu: int, count: int | None) -> None:
        """The GPU's cumulative PCIe replay count (field NVML_FI_DEV_PCIE_REPLAY_COUNTER and
        ``nvmlDeviceGetPcieReplayCounter``); None: NOT_SUPPORTED."""
        self.set_field(gpu, FI_PCIE_REPLAY_COUNTER, count)

    # -- processes
    def place_process(self, gpu: int, pid: int, mem_bytes: int | None) -> None:
        """Add or update a compute process; ``mem_bytes=None`` reports NVML_VALUE_NOT_AVAILABLE."""
        if mem_bytes is not None and mem_bytes < 0:
            raise ValueError("mem_bytes must be >= 0 or None")
        procs = self.gpu(gpu)["processes"]
        procs[:] = [p for p in procs if p["pid"] != pid]
        procs.append({"pid": int(pid), "used_memory": mem_bytes})
        self.write()

    def remove_process(self, gpu: int, pid: int) -> None:
        procs = self.gpu(gpu)["processes"]
        procs[:] = [p for p in procs if p["pid"] != pid]
        self.write()

    def add_process_sample(
        self,
        gpu: int,
        pid: int,
        sm_util: int,
        mem_util: int = 0,
        *,
        enc_util: int = 0,
        dec_util: int = 0,
        timestamp_us: int | None = None,
    ) -> int:
        """Append a per-process utilization sample (``nvmlDeviceGetProcessUtilization``); the
        timestamp defaults to now in microseconds since the epoch, as NVML reports it.  Returns it."""
        ts = int(time.time() * 1e6) if timestamp_us is None else int(timestamp_us)
        self.gpu(gpu)["process_samples"].append(
            {
                "pid": int(pid),
                "sm_util": sm_util,
                "mem_util": mem_util,
                "enc_util": enc_util,
                "dec_util": dec_util,
                "timestamp_us": ts,
            }
        )
        self.write()
        return ts

    def clear_process_samples(self, gpu: int) -> None:
        self.gpu(gpu)["process_samples"].clear()
        self.write()

    # -- errors and events
    def inject_error(self, function: str, code: int, gpu: int | None = None) -> None:
        """Make ``function`` (an NVML symbol name as exported, e.g. ``nvmlDeviceGetPowerUsage`` or
        ``nvmlInitWithFlags``; ``"*"`` = every function) return ``code``, for one GPU index or all.
        The newest matching entry wins."""
        if not code:
            raise ValueError("code must be a non-zero nvmlReturn_t")
        self.clear_error(function, gpu)
        self.data["errors"].insert(0, {"function": function, "code": int(code), "gpu": gpu})
        self.write()

    def clear_error(self, function: str | None = None, gpu: int | None = None) -> None:
        """Remove the entry for (function, gpu); ``function=None`` removes every entry."""
        if function is None:
            self.data["errors"].clear()
        else:
            self.data["errors"][:] = [e for e in self.data["errors"] if (e["function"], e["gpu"]) != (function, gpu)]
        self.write()

    def queue_event(self, gpu: int, event_type: int, data: int = 0) -> int:
        """Queue an event for ``nvmlEventSetWait``; returns its sequence number.  Each queued event
        is delivered once per process, to a set that registered ``gpu`` for ``event_type``."""
        self.gpu(gpu)  # IndexError for an unknown GPU
        seq = self._next_seq
        self._next_seq += 1
        self.data["events"].append({"seq": seq, "gpu": gpu, "type": int(event_type), "data": int(data)})
        self.write()
        return seq

    def queue_xid(self, gpu: int, xid: int) -> int:
        """Queue an Xid critical error event (eventData = ``xid``)."""
        return self.queue_event(gpu, EVENT_XID_CRITICAL_ERROR, xid)


# --------------------------------------------------------------------------------- subprocess
_CHILD_SERVER = r"""
import ctypes, json, os, sys, traceback
_out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)                 # snippets that print go to stderr, not into the protocol
sys.stdout = sys.stderr
ns = {"__name__": "__child__"}
exec("import pynvml", ns)

def _default(o):
    if isinstance(o, (ctypes.Structure, ctypes.Union)):
        return {f[0]: getattr(o, f[0]) for f in o._fields_}
    if isinstance(o, ctypes.Array):
        return list(o)
    if isinstance(o, bytes):
        return o.decode("utf-8", "replace")
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if hasattr(o, "__dict__"):
        return dict(vars(o))
    return repr(o)

for line in sys.stdin:
    req = json.loads(line)
    try:
        if req["mode"] == "exec":
            exec(req["code"], ns)
            res = {"ok": None}
        else:
            res = {"ok": eval(req["code"], ns)}
        text = json.dumps(res, default=_default)
    except BaseException as e:
        value = getattr(e, "value", None)
        text = json.dumps({
            "error": type(e).__name__,
            "module": type(e).__module__,
            "value": value if isinstance(value, int) else None,
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__],
            "message": str(e),
            "traceback": traceback.format_exc(),
        })
    _out.write(text + "\n")
    _out.flush()
"""


class ChildError(Exception):
    """An exception raised inside a ``PythonChild`` snippet, e.g. ``pynvml.NVMLError_GpuIsLost``."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.type_name: str = info["error"]
        self.module: str = info["module"]
        self.value: int | None = info["value"]  # NVMLError.value (the nvmlReturn_t) when present
        self.mro: list[str] = info["mro"]
        self.child_traceback: str = info["traceback"]
        super().__init__(f"{self.module}.{self.type_name}: {info['message']}\n{self.child_traceback}")

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.type_name}"

    def isinstance_of(self, qualname: str) -> bool:
        """True if the child's exception class is, or derives from, ``qualname`` (e.g. 'pynvml.NVMLError')."""
        return qualname in self.mro


class PythonChild:
    """A long-lived Python subprocess that runs snippets sent from the test, in one namespace where
    ``pynvml`` is already imported.  Results come back as JSON (ctypes structs become dicts, bytes
    become str); an exception in the child is raised here as ``ChildError``."""

    def __init__(self, env: Mapping[str, str], *, timeout: float = 30.0, python: str | None = None) -> None:
        self.timeout = timeout
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [python or sys.executable, "-c", _CHILD_SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=dict(env),
        )
        self._buf = b""

    def _request(self, mode: str, code: str, timeout: float | None) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"mode": mode, "code": code}) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"child did not answer {code!r} in time; stderr:\n{self.stderr_text()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"child exited ({self.proc.wait()}); stderr:\n{self.stderr_text()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise ChildError(reply)
        return reply["ok"]

    def eval(self, expr: str, *, timeout: float | None = None) -> Any:
        return self._request("eval", expr, timeout)

    def exec(self, code: str, *, timeout: float | None = None) -> None:
        self._request("exec", code, timeout)

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def __enter__(self) -> PythonChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------- fixture object
@dataclass
class NvmlStandin:
    """What the ``nvml_standin`` fixture yields.  In real-NVML mode (``NVML_STANDIN_REAL=1`` on a GPU
    box) ``real`` is True, ``state``/``lib_dir``/``lib_path`` are None and ``env`` is the plain
    environment; tests that script GPU state call ``require_scripted()`` to skip there."""

    lib_dir: Path | None
    lib_path: Path | None
    state: StandinState | None
    env: dict[str, str]
    real: bool = False
    _children: list[PythonChild] = field(default_factory=list, repr=False)

    @property
    def state_path(self) -> Path | None:
        return self.state.path if self.state else None

    def require_scripted(self) -> StandinState:
        if self.state is None:
            import pytest

            pytest.skip("needs the scripted NVML stand-in (NVML_STANDIN_REAL=1 selects the real driver)")
        return self.state

    def child(self, *, timeout: float = 30.0) -> PythonChild:
        """A ``PythonChild`` running with ``env``; closed at the end of the test if not before."""
        c = PythonChild(self.env, timeout=timeout)
        self._children.append(c)
        return c

    def run_python(self, code: str, *, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``python -c code`` with ``env``; raises with its output if it fails and ``check``."""
        proc = subprocess.run(
            [sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def close(self) -> None:
        for c in self._children:
            c.close()
        self._children.clear()
