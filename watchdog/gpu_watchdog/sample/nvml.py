"""With gpu_watchdog.sample.xid (the Xid event thread), the only module that talks to nvidia-ml-py. Every NVML call
of the per-tick reader goes through ``NvmlReader._query``; both map GPU faults with ``fault_of``.

Error mapping (RESEARCH §4):
- NotSupported → the value is None and the metric is listed in ``DeviceSample.unsupported``; carry on.
- GPU is lost / reset required → a ``GpuFault`` in that device's sample; never an exception out of a tick.
- driver not loaded, library missing, RM version mismatch, no permission at init → ``BackendUnavailable``.
- anything else → None plus a ``SampleError`` (counted by error class in metrics).

The PCIe link's capacity is read once per GPU (``NvmlReader._pcie_link``): its maximum is fixed by the GPU and slot.

The pynvml module is injectable (``lib=``) so tests can drive this layer with the real error classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_watchdog.errors import BackendUnavailable
from gpu_watchdog.model import DeviceSample, GpuFault, GpuProcess, SampleError

# NVML field ids (nvml.h): NVLink data throughput counters (KiB) and PCIe byte counters.
FI_NVLINK_TX_KIB = 138
FI_NVLINK_RX_KIB = 139
FI_PCIE_TX_BYTES = 197
FI_PCIE_RX_BYTES = 198
TRAFFIC_FIELDS = (FI_NVLINK_TX_KIB, FI_NVLINK_RX_KIB, FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES)

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


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str
    last_process_ts: int = 0  # for nvmlDeviceGetProcessUtilization's "since" argument
    # (bytes/s or None, NVML said NotSupported) once NvmlReader._pcie_link got an answer; None until then.
    pcie_link: tuple[float | None, bool] | None = None


class NvmlReader:
    """Reads every GPU once per tick into DeviceSamples."""

    def __init__(self, lib: Any | None = None) -> None:
        self.nvml = lib if lib is not None else _load_pynvml()
        self._devices: list[_Device] = []
        self._init_faults: dict[int, GpuFault] = {}
        self.driver_version = ""

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
        except self.nvml.NVMLError_NotSupported:
            unsupported.append(what)
        except self.nvml.NVMLError as e:
            fault = self._fault_of(e, dev.index)
            if fault is not None:
                raise _DeviceFault(fault) from None
            errors.append(SampleError(type(e).__name__, f"{fn.__name__} gpu {dev.index}"))
        return None

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
        fields = q(n.nvmlDeviceGetFieldValues, dev, "traffic", uns, errors, list(TRAFFIC_FIELDS))
        procs = q(n.nvmlDeviceGetComputeRunningProcesses, dev, "processes", uns, errors)
        traffic = _field_counters(fields, n.NVML_SUCCESS) if fields is not None else {}
        if fields is not None and not traffic:
            uns.append("traffic")
        proc_util = self._process_util(dev, uns, errors)
        link = self._pcie_link(dev, uns, errors)
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
            pcie_tx_bytes_total=traffic.get(FI_PCIE_TX_BYTES),
            pcie_rx_bytes_total=traffic.get(FI_PCIE_RX_BYTES),
            nvlink_tx_bytes_total=nv_tx * 1024 if nv_tx is not None else None,
            nvlink_rx_bytes_total=nv_rx * 1024 if nv_rx is not None else None,
            pcie_link_bytes_per_s=link,
            processes=processes,
            unsupported=tuple(uns),
        )

    def _pcie_link(self, dev: _Device, uns: list[str], errors: list[SampleError]) -> float | None:
        """What the GPU's PCIe link carries per direction: its maximum generation x maximum width, read once.

        The maximum, not the current link: NVML's current generation and width "may be reduced when the GPU is
        not in use" (nvidia-smi --help-query-gpu), and a value read once, at an agent start on an idle GPU, would
        understate the link for good. The maximum is what the GPU and its slot both support (an x16 card in an
        x8 slot: 8). The price: a link that trained below it (a bad riser left at x8) is overstated.
        """
        if dev.pcie_link is None:
            n, n_errors = self.nvml, len(errors)
            link_uns: list[str] = []
            gen = self._query(n.nvmlDeviceGetMaxPcieLinkGeneration, dev, "pcie_link", link_uns, errors)
            width = (self._query(n.nvmlDeviceGetMaxPcieLinkWidth, dev, "pcie_link", link_uns, errors)
                     if gen is not None else None)
            if len(errors) > n_errors:
                return None  # a passing error (SampleError): asked again next tick
            lane = PCIE_LANE_BYTES_PER_S.get(gen) if gen is not None else None
            dev.pcie_link = (lane * width if lane is not None and width else None, bool(link_uns))
        capacity, unsupported = dev.pcie_link
        if unsupported:
            uns.append("pcie_link")
        return capacity

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


# NVML_VALUE_NOT_AVAILABLE as an unsigned long long: pynvml turns it into None, older versions return it raw.
_NOT_AVAILABLE = (1 << 64) - 1


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
