"""NVML Xid events on a dedicated thread, turned into ``GpuFault``s that the sampler attaches to its samples.

``XidWatcher`` creates one NVML event set, registers every GPU for ``nvmlEventTypeXidCriticalError``
(a GPU that answers NotSupported is logged and skipped), and waits on the set in a loop with a timeout of
``wait_ms`` (pynvml's ``nvmlEventSetWait``, which calls the library's v2 wait), so ``stop()`` returns within
about one timeout; the set is freed after the thread has left the wait. What the thread sees goes to a
thread-safe queue that the sampling loop drains once per tick (``drain()``):

- an Xid event → ``GpuFault("xid", …, xid=N)`` on that GPU's UUID, or ``GpuFault("xid_application", …)``
  when N is in ``faults.application_xids`` (an application error: an incident, but no drain);
- GPU lost / reset required from the wait (mapped by ``gpu_watchdog.sample.nvml.fault_of``, as the per-tick reader
  maps them) → that fault on the GPUs that fail a probe, or on every registered GPU when none can be told
  apart (the node needs draining either way); reported once per GPU and kind;
- any other NVML error → a ``SampleError`` (counted in metrics), then a pause of one timeout.

pynvml is injectable (``lib=``) like ``NvmlReader``; only this module and ``gpu_watchdog.sample.nvml`` touch it.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from gpu_watchdog.model import DeviceSample, GpuFault, SampleError
from gpu_watchdog.sample.nvml import fault_of

log = logging.getLogger("gpu_watchdog.sample.xid")

XID = "xid"
XID_APPLICATION = "xid_application"
# Fault kinds (= gpu_fault finding signatures) after which the node is drained.
DRAINING_KINDS = ("gpu_lost", "reset_required", XID)

# Short names for the Xids seen most in the field (NVIDIA's Xid catalogue), for readable incidents.
XID_NAMES = {
    8: "GPU stopped processing (idle timeout)", 13: "graphics engine exception", 31: "GPU memory page fault",
    43: "GPU stopped processing", 45: "preemptive cleanup after an earlier error", 48: "double-bit ECC error",
    61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
    63: "ECC page retirement / row remapping recorded", 64: "ECC page retirement / row remapping failure",
    68: "video processor (NVDEC) exception", 69: "graphics engine class error", 74: "NVLink error",
    79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 109: "context switch timeout", 119: "GSP RPC timeout", 120: "GSP error",
}


def is_draining(kind: str) -> bool:
    """Whether a gpu_fault of this kind (finding signature) drains the node: lost, reset required, or an Xid
    that is not an application error."""
    return kind in DRAINING_KINDS


def xid_fault(xid: int, index: int, uuid: str, application_xids: Iterable[int]) -> GpuFault:
    name = XID_NAMES.get(xid, "see NVIDIA's Xid catalogue")
    if xid in set(application_xids):
        return GpuFault(XID_APPLICATION, f"Xid {xid} ({name}) on GPU {index} {uuid}: an application error "
                                         "(faults.application_xids), no drain", xid=xid)
    return GpuFault(XID, f"Xid {xid} ({name}) on GPU {index} {uuid}", xid=xid)


def _addr(handle: Any) -> int | None:
    """A device handle's address, to match an event's ``device`` with a registered GPU without an NVML call
    (a lost GPU may not answer one)."""
    if isinstance(handle, int):
        return handle
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class XidWatcher:
    """Watches Xid events of the given GPUs on a daemon thread. ``start()``, then ``drain()`` every tick,
    ``stop()`` at the end (before ``nvmlShutdown``). NVML must already be initialised."""

    def __init__(self, devices: Sequence[tuple[int, str, Any]], lib: Any | None = None, *, wait_ms: int = 500,
                 application_xids: Iterable[int] = ()) -> None:
        if lib is None:
            from gpu_watchdog.sample.nvml import _load_pynvml

            lib = _load_pynvml()
        self.nvml = lib
        self.devices = list(devices)  # (index, uuid, handle)
        self.wait_ms = int(wait_ms)
        self.application_xids = frozenset(application_xids)
        self.registered: list[tuple[int, str, Any]] = []
        self.skipped: dict[int, str] = {}  # index → why it is not watched
        self._queue: queue.SimpleQueue[tuple[str, GpuFault] | SampleError] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set: Any = None
        self._reported: set[tuple[str, str]] = set()  # (uuid, kind) of wait-error faults already queued
        self._error_logged: set[str] = set()

    @classmethod
    def for_reader(cls, reader: Any, **kwargs: Any) -> XidWatcher:
        """A watcher for the GPUs an ``NvmlReader`` opened, through the same pynvml."""
        return cls(reader.handles(), reader.nvml, **kwargs)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> int:
        """Create the event set, register the GPUs and start the thread; returns how many GPUs are watched.
        Raises the NVMLError of ``nvmlEventSetCreate`` (the caller decides whether that matters)."""
        n = self.nvml
        self._set = n.nvmlEventSetCreate()
        for index, uuid, handle in self.devices:
            try:
                n.nvmlDeviceRegisterEvents(handle, n.nvmlEventTypeXidCriticalError, self._set)
            except n.NVMLError_NotSupported:
                self.skipped[index] = "Xid events not supported"
                log.info("GPU %d (%s): Xid events not supported; not watched", index, uuid)
                continue
            except n.NVMLError as e:
                fault = fault_of(n, e, index)
                if fault is not None:
                    self._put_fault(uuid, fault)
                self.skipped[index] = f"{type(e).__name__}: {e}"
                log.warning("GPU %d (%s): cannot register for Xid events: %s", index, uuid, self.skipped[index])
                continue
            self.registered.append((index, uuid, handle))
        if not self.registered:
            self._free()
            return 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="xid-events", daemon=True)
        self._thread.start()
        return len(self.registered)

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the thread (within about one wait timeout) and free the event set; False if the thread did
        not leave its wait in time (then the set is left alone: freeing it under a waiter is unsafe)."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout_s if timeout_s is not None else self.wait_ms / 1000.0 + 2.0)
            if t.is_alive():
                log.warning("Xid event thread did not stop within its timeout")
                return False
            self._thread = None
        self._free()
        return True

    def _free(self) -> None:
        if self._set is None:
            return
        try:
            self.nvml.nvmlEventSetFree(self._set)
        except self.nvml.NVMLError as e:
            log.debug("nvmlEventSetFree: %s", e)
        self._set = None

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        n = self.nvml
        pause = self.wait_ms / 1000.0
        while not self._stop.is_set():
            try:
                data = n.nvmlEventSetWait(self._set, self.wait_ms)
            except n.NVMLError_Timeout:
                continue
            except n.NVMLError as e:
                self._on_wait_error(e)
                self._stop.wait(pause)  # a lost GPU answers every wait at once: do not spin
                continue
            except Exception as e:  # never let the thread die silently
                log.exception("Xid event wait failed")
                self._queue.put(SampleError(type(e).__name__, "nvmlEventSetWait"))
                self._stop.wait(pause)
                continue
            self._on_event(data)

    def _device_of(self, handle: Any) -> tuple[int, str] | None:
        a = _addr(handle)
        for index, uuid, h in self.registered:
            if a is not None and _addr(h) == a:
                return index, uuid
        try:  # a handle we cannot compare: ask NVML which GPU it is
            i = int(self.nvml.nvmlDeviceGetIndex(handle))
        except Exception:
            return None
        return next(((index, uuid) for index, uuid, _h in self.registered if index == i), None)

    def _on_event(self, data: Any) -> None:
        if not int(data.eventType) & self.nvml.nvmlEventTypeXidCriticalError:
            return
        xid = int(data.eventData)
        dev = self._device_of(data.device)
        if dev is None:
            log.warning("Xid %d on a GPU that is not watched; ignored", xid)
            return
        index, uuid = dev
        fault = xid_fault(xid, index, uuid, self.application_xids)
        log.warning("%s", fault.detail)
        self._put_fault(uuid, fault)

    def _on_wait_error(self, e: Exception) -> None:
        n = self.nvml
        if fault_of(n, e, 0) is None:
            name = type(e).__name__
            if name not in self._error_logged:
                self._error_logged.add(name)
                log.warning("Xid event wait failed: %s: %s", name, e)
            self._queue.put(SampleError(name, "nvmlEventSetWait"))
            return
        # Which GPU? Ask each one something cheap; the ones that fail the same way are the faulty ones.
        hit = []
        for index, uuid, handle in self.registered:
            try:
                n.nvmlDeviceGetIndex(handle)
            except n.NVMLError as pe:
                f = fault_of(n, pe, index)
                if f is not None:
                    hit.append((uuid, f))
        if not hit:  # none can be told apart: the node needs draining anyway, so blame every watched GPU
            for index, uuid, _h in self.registered:
                f = fault_of(n, e, index)
                if f is not None:
                    hit.append((uuid, f))
        for uuid, f in hit:
            if (uuid, f.kind) not in self._reported:
                self._reported.add((uuid, f.kind))
                log.warning("Xid event wait: %s", f.detail)
                self._put_fault(uuid, replace(f, detail=f"{f.detail} (seen by the Xid event wait)"))

    def _put_fault(self, uuid: str, fault: GpuFault) -> None:
        self._queue.put((uuid, fault))

    # -- the sampling side ---------------------------------------------------------------------------
    def drain(self) -> tuple[list[tuple[str, GpuFault]], list[SampleError]]:
        """Everything queued since the last call: (uuid, fault) pairs and sampling errors. Never blocks."""
        faults: list[tuple[str, GpuFault]] = []
        errors: list[SampleError] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return faults, errors
            if isinstance(item, SampleError):
                errors.append(item)
            else:
                faults.append(item)


def attach_faults(devices: Sequence[DeviceSample], faults: Sequence[tuple[str, GpuFault]]) -> list[DeviceSample]:
    """Put queued Xid faults into this tick's device samples: a draining fault wins over an application one,
    and a fault the reader itself saw (GPU lost on a query) is kept. Faults for unknown UUIDs are dropped."""
    best: dict[str, GpuFault] = {}
    for uuid, f in faults:
        old = best.get(uuid)
        if old is None or (is_draining(f.kind) and not is_draining(old.kind)):
            best[uuid] = f
    known = {d.uuid for d in devices}
    for uuid in set(best) - known:
        log.warning("fault on unknown GPU %s dropped: %s", uuid, best[uuid].detail)
    return [replace(d, fault=best[d.uuid]) if d.fault is None and d.uuid in best else d for d in devices]


def start_watcher(reader: Any, *, wait_ms: int = 500, application_xids: Iterable[int] = ()) -> tuple[
        XidWatcher | None, str]:
    """Start watching the reader's GPUs; returns the watcher (None when nothing is watched) and a short note
    for the backend's one-line description. Failing to watch never stops sampling."""
    w = XidWatcher.for_reader(reader, wait_ms=wait_ms, application_xids=application_xids)
    try:
        count = w.start()
    except Exception as e:  # NVMLError from nvmlEventSetCreate, or a pynvml without events
        w.stop()
        log.warning("Xid events unavailable: %s: %s", type(e).__name__, e)
        return None, f"Xid events unavailable ({type(e).__name__})"
    if count == 0:
        why = "; ".join(sorted(set(w.skipped.values()))) or "no GPU"
        return None, f"Xid events unavailable ({why})"
    return w, f"Xid events on {count} GPU(s)"
