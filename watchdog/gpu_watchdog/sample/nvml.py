"""With gpu_watchdog.sample.xid (the Xid event thread), the only module that talks to nvidia-ml-py. Every NVML call
of the per-tick reader goes through ``NvmlReader._query``; both map GPU faults with ``fault_of``.

Error mapping (RESEARCH §4):
- NotSupported → the value is None and the metric is listed in ``DeviceSample.unsupported``; carry on.
- GPU is lost / reset required → a ``GpuFault`` in that device's sample; never an exception out of a tick.
- driver not loaded, library missing, RM version mismatch, no permission at init → ``BackendUnavailable``.
- anything else → None plus a ``SampleError`` (counted by error class in metrics).

The PCIe link's maxima (``NvmlReader._pcie_link``) and the SM clock's maximum (``NvmlReader._sm_clock_max``) are
read once per GPU: they are fixed by the GPU and its slot. The current link and the clocks event reasons, per tick.
``clock_slowdowns`` names the slowdowns a sample's clocks event reasons report.

The pynvml module is injectable (``lib=``) so tests can drive this layer with the real error classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from gpu_watchdog.errors import BackendUnavailable
from gpu_watchdog.model import DeviceSample, GpuFault, GpuProcess, SampleError

# NVML field ids (nvml.h): NVLink data throughput counters (KiB), PCIe byte counters and the PCIe replay counter
# (NVML_FI_DEV_PCIE_REPLAY_COUNTER), all asked in one nvmlDeviceGetFieldValues call per tick.
FI_NVLINK_TX_KIB = 138
FI_NVLINK_RX_KIB = 139
FI_PCIE_TX_BYTES = 197
FI_PCIE_RX_BYTES = 198
FI_PCIE_REPLAY_COUNTER = 94
TRAFFIC_FIELDS = (FI_NVLINK_TX_KIB, FI_NVLINK_RX_KIB, FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES, FI_PCIE_REPLAY_COUNTER)

# Clocks event reasons (nvml.h group nvmlClocksEventReasons; the nvmlClocksThrottleReason* names are the same bits):
# why the clocks are below their maximum. Idle and the applications clocks setting are not slowdowns.
CLOCKS_EVENT_GPU_IDLE = 0x1
CLOCKS_EVENT_APPLICATIONS_CLOCKS_SETTING = 0x2
CLOCKS_EVENT_SW_POWER_CAP = 0x4
CLOCKS_EVENT_HW_SLOWDOWN = 0x8
CLOCKS_EVENT_SYNC_BOOST = 0x10
CLOCKS_EVENT_SW_THERMAL_SLOWDOWN = 0x20
CLOCKS_EVENT_HW_THERMAL_SLOWDOWN = 0x40
CLOCKS_EVENT_HW_POWER_BRAKE_SLOWDOWN = 0x80
CLOCKS_EVENT_DISPLAY_CLOCK_SETTING = 0x100
SLOWDOWN_REASONS: tuple[tuple[str, int], ...] = (
    ("thermal", CLOCKS_EVENT_SW_THERMAL_SLOWDOWN | CLOCKS_EVENT_HW_THERMAL_SLOWDOWN),
    ("power brake", CLOCKS_EVENT_HW_POWER_BRAKE_SLOWDOWN),
    ("power cap", CLOCKS_EVENT_SW_POWER_CAP),
    ("hw slowdown", CLOCKS_EVENT_HW_SLOWDOWN),
    ("sync boost", CLOCKS_EVENT_SYNC_BOOST),
    ("display clocks", CLOCKS_EVENT_DISPLAY_CLOCK_SETTING),
)

# Bytes/s one PCIe lane carries per direction, by generation: the transfer rate less the line encoding (PCI-SIG
# base specifications; Wikipedia "PCI Express", table "PCI Express link performance"). Gen 1-2: 2.5 / 5 GT/s,
# 8b/10b. Gen 3-5: 8 / 16 / 32 GT/s, 128b/130b. Gen 6: 64 GT/s in 256-byte FLITs, of which 242 carry TLP and
# DLLP bytes and 14 the CRC and FEC. A generation not listed (newer) gives no capacity rather than a guess.
PCIE_LANE_BYTES_PER_S: dict[int, float] = {
    1: 2.5e9 * 8 / 10 / 8,
    2: 5e9 * 8 / 10 / 8,
    3: 8e9 * 128 / 130 / 8,
    4: 16e9 * 128 / 130 / 8,
    5: 32e9 * 128 / 130 / 8,
    6: 64e9 * 242 / 256 / 8,
}


class _DeviceFault(Exception):
    def __init__(self, fault: GpuFault) -> None:
        super().__init__(fault.detail)
        self.fault = fault


def _load_pynvml() -> Any:
    import pynvml  # imported lazily so `import gpu_watchdog` never loads libnvidia-ml

    return pynvml


class _LinkMax(NamedTuple):
    bytes_per_s: float | None  # what the link carries per direction at its maximum
    unsupported: bool  # NVML said NotSupported
    gen: int | None
    width: int | None


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str
    last_process_ts: int = 0  # for nvmlDeviceGetProcessUtilization's "since" argument
    # Read once, set when NvmlReader._pcie_link / _sm_clock_max got an answer; None until then.
    pcie_link: _LinkMax | None = None
    sm_clock_max: tuple[float | None, bool] | None = None  # (MHz or None, NVML said NotSupported)


class NvmlReader:
    """Reads every GPU once per tick into DeviceSamples."""

    def __init__(self, lib: Any | None = None) -> None:
        self.nvml = lib if lib is not None else _load_pynvml()
        self._devices: list[_Device] = []
        self._init_faults: dict[int, GpuFault] = {}
        self.driver_version = ""
        self._reasons_fn: Any = None  # the clocks event reasons function, chosen at its first call

    # -- startup -------------------------------------------------------------------------------------
    def start(self) -> int:
        """Initialise NVML and enumerate the GPUs; returns their count. Raises BackendUnavailable."""
        n = self.nvml
        try:
            n.nvmlInit()
        except n.NVMLError as e:
            raise BackendUnavailable(f"NVML cannot start: {self._init_reason(e)}") from None
        try:
            self.driver_version = _text(n.nvmlSystemGetDriverVersion())
            count = n.nvmlDeviceGetCount()
        except n.NVMLError as e:
            raise BackendUnavailable(f"NVML cannot list GPUs: {_describe(e)}") from None
        self._devices = []
        for i in range(count):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                self._devices.append(_Device(i, h, _text(n.nvmlDeviceGetUUID(h)), _text(n.nvmlDeviceGetName(h))))
            except n.NVMLError as e:
                fault = self._fault_of(e, i)
                if fault is None:
                    raise BackendUnavailable(f"NVML cannot open GPU {i}: {_describe(e)}") from None
                self._init_faults[i] = fault  # a lost GPU is reported, not fatal to the agent
                self._devices.append(_Device(i, None, f"GPU-unknown-{i}", "unknown"))
        return count

    def _init_reason(self, e: Exception) -> str:
        n = self.nvml
        reasons = (
            ("NVMLError_LibraryNotFound", "libnvidia-ml.so.1 not found (is the NVIDIA driver installed?)"),
            ("NVMLError_DriverNotLoaded", "the NVIDIA kernel driver is not loaded"),
            ("NVMLError_LibRmVersionMismatch", "driver/library version mismatch (reboot or reload the driver)"),
            ("NVMLError_NoPermission", "no permission to open /dev/nvidia* (run as root or fix device modes)"),
        )
        for cls_name, text in reasons:
            cls = getattr(n, cls_name, None)
            if cls is not None and isinstance(e, cls):
                return text
        return _describe(e)

    def shutdown(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    def handles(self) -> list[tuple[int, str, Any]]:
        """(index, uuid, handle) of every GPU that opened at start (for gpu_watchdog.sample.xid)."""
        return [(d.index, d.uuid, d.handle) for d in self._devices if d.handle is not None]

    # -- per tick ------------------------------------------------------------------------------------
    def _fault_of(self, e: Exception, index: int) -> GpuFault | None:
        return fault_of(self.nvml, e, index)

    def _query(self, fn: Any, dev: _Device, what: str, unsupported: list[str], errors: list[SampleError],
               *args: Any) -> Any:
        try:
            return fn(dev.handle, *args)
        except self.nvml.NVMLError as e:
            self._failed(e, fn, dev, what, unsupported, errors)
        return None

    def _failed(self, e: Exception, fn: Any, dev: _Device, what: str, unsupported: list[str],
                errors: list[SampleError]) -> None:
        """An NVML error of one query: NotSupported is listed, a GPU fault raised, anything else a SampleError."""
        if isinstance(e, self.nvml.NVMLError_NotSupported):
            unsupported.append(what)
            return
        fault = self._fault_of(e, dev.index)
        if fault is not None:
            raise _DeviceFault(fault) from None
        errors.append(SampleError(type(e).__name__, f"{fn.__name__} gpu {dev.index}"))

    def read_all(self) -> tuple[list[DeviceSample], list[SampleError]]:
        errors: list[SampleError] = []
        out = []
        for dev in self._devices:
            fault = self._init_faults.get(dev.index)
            if fault is not None:
                out.append(DeviceSample(dev.index, dev.uuid, dev.name, fault=fault))
                continue
            try:
                out.append(self._read(dev, errors))
            except _DeviceFault as f:
                out.append(DeviceSample(dev.index, dev.uuid, dev.name, fault=f.fault))
        return out, errors

    def _read(self, dev: _Device, errors: list[SampleError]) -> DeviceSample:
        n = self.nvml
        uns: list[str] = []
        q = self._query
        util = q(n.nvmlDeviceGetUtilizationRates, dev, "utilization", uns, errors)
        mem = q(n.nvmlDeviceGetMemoryInfo, dev, "memory", uns, errors)
        power = q(n.nvmlDeviceGetPowerUsage, dev, "power", uns, errors)
        limit = q(n.nvmlDeviceGetEnforcedPowerLimit, dev, "power_limit", uns, errors)
        temp = q(n.nvmlDeviceGetTemperature, dev, "temperature", uns, errors, n.NVML_TEMPERATURE_GPU)
        clock = q(n.nvmlDeviceGetClockInfo, dev, "sm_clock", uns, errors, n.NVML_CLOCK_SM)
        reasons = self._clock_event_reasons(dev, uns, errors)
        n_uns = len(uns)
        fields = q(n.nvmlDeviceGetFieldValues, dev, "traffic", uns, errors, list(TRAFFIC_FIELDS))
        traffic = _field_counters(fields, n.NVML_SUCCESS) if fields is not None else {}
        replays = traffic.pop(FI_PCIE_REPLAY_COUNTER, None)
        if fields is not None and not traffic:
            uns.append("traffic")
        if replays is None and (fields is not None or len(uns) > n_uns):
            uns.append("pcie_replay")  # its field did not answer, or the whole call was NotSupported
        procs = q(n.nvmlDeviceGetComputeRunningProcesses, dev, "processes", uns, errors)
        proc_util = self._process_util(dev, uns, errors)
        link = self._pcie_link(dev, uns, errors)
        clock_max = self._sm_clock_max(dev, uns, errors)
        link_uns: list[str] = []
        link_gen = q(n.nvmlDeviceGetCurrPcieLinkGeneration, dev, "pcie_link_current", link_uns, errors)
        link_width = q(n.nvmlDeviceGetCurrPcieLinkWidth, dev, "pcie_link_current", link_uns, errors)
        if link_uns:
            uns.append("pcie_link_current")  # once, whichever of the two NVML does not answer
        util_of = proc_util.get
        # The hot loop at 64 GPUs x 512 processes: a list comprehension, the memory check inlined.
        processes = tuple([GpuProcess(p.pid, None if (m := p.usedGpuMemory) is None or m >= _NOT_AVAILABLE
                                      else int(m), util_of(p.pid)) for p in procs]) if procs else ()
        nv_tx, nv_rx = traffic.get(FI_NVLINK_TX_KIB), traffic.get(FI_NVLINK_RX_KIB)
        return DeviceSample(
            index=dev.index, uuid=dev.uuid, name=dev.name,
            util_percent=float(util.gpu) if util is not None else None,
            mem_util_percent=float(util.memory) if util is not None else None,
            mem_used_bytes=int(mem.used) if mem is not None else None,
            mem_total_bytes=int(mem.total) if mem is not None else None,
            power_w=power / 1000.0 if power is not None else None,
            power_limit_w=limit / 1000.0 if limit is not None else None,
            temperature_c=float(temp) if temp is not None else None,
            sm_clock_mhz=float(clock) if clock is not None else None,
            sm_clock_max_mhz=clock_max,
            clock_event_reasons=reasons,
            pcie_tx_bytes_total=traffic.get(FI_PCIE_TX_BYTES),
            pcie_rx_bytes_total=traffic.get(FI_PCIE_RX_BYTES),
            nvlink_tx_bytes_total=nv_tx * 1024 if nv_tx is not None else None,
            nvlink_rx_bytes_total=nv_rx * 1024 if nv_rx is not None else None,
            pcie_link_bytes_per_s=link.bytes_per_s,
            pcie_link_gen=int(link_gen) if link_gen is not None else None,
            pcie_link_width=int(link_width) if link_width is not None else None,
            pcie_link_gen_max=link.gen,
            pcie_link_width_max=link.width,
            pcie_replay_total=replays,
            processes=processes,
            unsupported=tuple(uns),
        )

    def _pcie_link(self, dev: _Device, uns: list[str], errors: list[SampleError]) -> _LinkMax:
        """The PCIe link's maximum generation and width, read once, and what it carries per direction at them.

        The maximum, not the current link: NVML's current generation and width "may be reduced when the GPU is
        not in use" (nvidia-smi --help-query-gpu), and a value read once, at an agent start on an idle GPU, would
        understate the link for good. The maximum is what the GPU and its slot both support (an x16 card in an
        x8 slot: 8). The price: a link that trained below it (a bad riser left at x8) is overstated; the sample's
        current generation and width (read every tick) show such a link.
        """
        link = dev.pcie_link
        if link is None:
            n, n_errors = self.nvml, len(errors)
            link_uns: list[str] = []
            gen = self._query(n.nvmlDeviceGetMaxPcieLinkGeneration, dev, "pcie_link", link_uns, errors)
            width = (self._query(n.nvmlDeviceGetMaxPcieLinkWidth, dev, "pcie_link", link_uns, errors)
                     if gen is not None else None)
            if len(errors) > n_errors:
                return _NO_LINK  # a passing error (SampleError): asked again next tick
            lane = PCIE_LANE_BYTES_PER_S.get(gen) if gen is not None else None
            link = dev.pcie_link = _LinkMax(lane * width if lane is not None and width else None, bool(link_uns),
                                            int(gen) if gen is not None else None,
                                            int(width) if width is not None else None)
        if link.unsupported:
            uns.append("pcie_link")
        return link

    def _sm_clock_max(self, dev: _Device, uns: list[str], errors: list[SampleError]) -> float | None:
        """The SM clock's maximum (MHz), read once like the link's maximum; a passing error asks again next tick."""
        cached = dev.sm_clock_max
        if cached is None:
            n, n_errors = self.nvml, len(errors)
            max_uns: list[str] = []
            mhz = self._query(n.nvmlDeviceGetMaxClockInfo, dev, "sm_clock_max", max_uns, errors, n.NVML_CLOCK_SM)
            if len(errors) > n_errors:
                return None
            cached = dev.sm_clock_max = (float(mhz) if mhz is not None else None, bool(max_uns))
        mhz_max, unsupported = cached
        if unsupported:
            uns.append("sm_clock_max")
        return mhz_max

    def _clock_event_reasons(self, dev: _Device, uns: list[str], errors: list[SampleError]) -> int | None:
        """The clocks event reasons bitmask. The first call picks the function: nvmlDeviceGetCurrentClocksEventReasons
        (the newer name), or the deprecated nvmlDeviceGetCurrentClocksThrottleReasons (the same bits) where pynvml
        lacks the newer wrapper or the driver its symbol (NVMLError_FunctionNotFound)."""
        fn = self._reasons_fn
        if fn is None:
            n = self.nvml
            newer = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
            older = getattr(n, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
            if newer is None or older is None:
                fn = self._reasons_fn = newer or older
            else:
                try:
                    value = newer(dev.handle)
                except n.NVMLError_FunctionNotFound:
                    fn = self._reasons_fn = older
                except n.NVMLError as e:
                    self._reasons_fn = newer
                    self._failed(e, newer, dev, "clock_event_reasons", uns, errors)
                    return None
                else:
                    self._reasons_fn = newer
                    return int(value)
            if fn is None:  # a pynvml with neither wrapper
                uns.append("clock_event_reasons")
                return None
        value = self._query(fn, dev, "clock_event_reasons", uns, errors)
        return int(value) if value is not None else None

    def _process_util(self, dev: _Device, uns: list[str], errors: list[SampleError]) -> dict[int, float]:
        n = self.nvml
        try:
            samples = n.nvmlDeviceGetProcessUtilization(dev.handle, dev.last_process_ts)
        except n.NVMLError_NotFound:
            return {}  # no samples since the last read: nothing ran
        except n.NVMLError_NotSupported:
            uns.append("process_utilization")
            return {}
        except n.NVMLError as e:
            fault = self._fault_of(e, dev.index)
            if fault is not None:
                raise _DeviceFault(fault) from None
            errors.append(SampleError(type(e).__name__, f"nvmlDeviceGetProcessUtilization gpu {dev.index}"))
            return {}
        if not samples:
            return {}
        dev.last_process_ts = max(dev.last_process_ts, max(int(s.timeStamp) for s in samples))
        return {s.pid: float(s.smUtil) for s in samples}  # several samples of a pid: the last one wins


def clock_slowdowns(dev: DeviceSample) -> tuple[str, ...]:
    """The slowdowns the device's clocks event reasons report, in ``SLOWDOWN_REASONS`` order: "thermal" (SW or HW
    thermal slowdown), "power brake", "power cap" (SW power cap), "hw slowdown", "sync boost", "display clocks".
    Empty when nothing slows the clocks, when only GPU idle or the applications clocks setting is set (not
    slowdowns), or when the reasons are unknown. NVML sets HW slowdown together with HW thermal or power brake
    slowdown, so a hot GPU may name both "thermal" and "hw slowdown"."""
    reasons = dev.clock_event_reasons
    if not reasons:
        return ()
    return tuple(name for name, bits in SLOWDOWN_REASONS if reasons & bits)


def fault_of(nvml: Any, e: BaseException, index: int) -> GpuFault | None:
    """The hardware fault an NVML error means for GPU ``index`` (lost, reset required), or None.

    Shared by the per-tick reader and the Xid event watcher (gpu_watchdog.sample.xid), so both map errors alike.
    """
    if isinstance(e, nvml.NVMLError_GpuIsLost):
        return GpuFault("gpu_lost", f"GPU {index} is lost (fell off the bus?)")
    if isinstance(e, nvml.NVMLError_ResetRequired):
        return GpuFault("reset_required", f"GPU {index} requires a reset")
    return None


def _field_counters(values: Any, success: int) -> dict[int, int]:
    # NVML answers in the order asked (TRAFFIC_FIELDS), so fieldId need not be read back: every attribute of
    # a pynvml struct goes through its Python-level __getattribute__, a visible share of a tick.
    pairs = zip(TRAFFIC_FIELDS, values, strict=False)
    return {fid: int(v.value.ullVal) for fid, v in pairs if v.nvmlReturn == success}


_NO_LINK = _LinkMax(None, False, None, None)

# NVML_VALUE_NOT_AVAILABLE as an unsigned long long: pynvml turns it into None, older versions return it raw.
_NOT_AVAILABLE = (1 << 64) - 1


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
