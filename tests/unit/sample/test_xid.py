"""GPU faults: the Xid event watcher, its way into samples and findings, and what ``launch`` does about them.

The watcher is driven through an injected pynvml that carries the REAL ``pynvml.NVMLError_*`` classes,
constants and ``c_nvmlEventData_t`` structs with real ``c_nvmlDevice_t`` handles (``EventNvml``); the
fault policy runs against a real child process and a real drain script that records its argv. The last
tests run the agent's genuine pynvml against the NVML stand-in (``tests/nvml_standin``) in subprocesses: a
queued Xid reaches the watcher, and ``gpu-watchdog launch --backend nvml`` drains and exits 74 for Xid 79
but only records an application Xid.
"""

from __future__ import annotations

import ctypes
import io
import json
import subprocess
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pynvml
import pytest
from fake_nvml import FakeNvml, started
from gpu_watchdog.config.load import load_config
from gpu_watchdog.config.schema import AgentConfig, Config, FaultsConfig, HookSpec, RecoveryConfig
from gpu_watchdog.detect.detector import DetectorState, step
from gpu_watchdog.errors import EXIT_GPU_FAULT, ConfigError
from gpu_watchdog.launch.launcher import Launcher
from gpu_watchdog.model import DeviceSample, GpuFault, GpuProcess, JobIdentity, NodeSample, ProcessSample
from gpu_watchdog.policy.drain import drain_reason
from gpu_watchdog.policy.ladder import FallbackDecision
from gpu_watchdog.sample.backends import NvmlBackend, choose_backend
from gpu_watchdog.sample.processes import JOB_ID_ENV, ProcessScanner
from gpu_watchdog.sample.xid import (
    XID,
    XID_APPLICATION,
    XidWatcher,
    attach_faults,
    is_draining,
    start_watcher,
    xid_fault,
)
from launch_harness import base_env, start_launch, write_config
from nvml_standin import NvmlStandin
from nvml_standin.fixtures import nvml_standin as _nvml_standin_fixture  # noqa: F401
from nvml_standin.fixtures import nvml_standin_lib as _nvml_standin_lib_fixture  # noqa: F401
from waiting import wait_for

GIB = 1 << 30
CLI = str(Path(sys.executable).with_name("gpu-watchdog"))
XID_EVENT = pynvml.nvmlEventTypeXidCriticalError


def _addr(h: Any) -> int | None:
    return ctypes.cast(h, ctypes.c_void_p).value


class EventNvml(types.SimpleNamespace):
    """A pynvml stand-in for the event calls: real error classes, constants, event struct and handle type.

    ``push(item)`` queues a ``c_nvmlEventData_t`` or an exception for ``nvmlEventSetWait``; with nothing
    queued a wait blocks for its timeout and raises the real ``NVMLError_Timeout``. ``wait_error`` makes
    every wait raise (a GPU that stays lost). Errors per GPU: ``register_errors`` / ``probe_errors``.
    """

    def __init__(self, n_gpus: int = 2) -> None:
        super().__init__(**{k: getattr(pynvml, k) for k in dir(pynvml)
                            if k.startswith(("NVMLError", "NVML_", "nvmlEventType"))})
        self._mem = [ctypes.create_string_buffer(16) for _ in range(n_gpus)]  # distinct handle addresses
        self.handles = [ctypes.cast(m, pynvml.c_nvmlDevice_t) for m in self._mem]
        self.register_errors: dict[int, BaseException] = {}
        self.probe_errors: dict[int, BaseException] = {}
        self.wait_error: BaseException | None = None
        self.registered: list[tuple[int, int]] = []
        self.waits = 0
        self.freed: list[Any] = []
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._set = ctypes.c_void_p(0xE5)

    def devices(self) -> list[tuple[int, str, Any]]:
        return [(i, f"GPU-ev-{i}", h) for i, h in enumerate(self.handles)]

    def _index(self, h: Any) -> int:
        return next(i for i, x in enumerate(self.handles) if _addr(x) == _addr(h))

    def nvmlEventSetCreate(self) -> Any:  # noqa: N802 - pynvml's names
        return self._set

    def nvmlDeviceRegisterEvents(self, h: Any, types_: int, es: Any) -> None:  # noqa: N802
        assert types_ == XID_EVENT and es is self._set
        i = self._index(h)
        if i in self.register_errors:
            raise self.register_errors[i]
        self.registered.append((i, types_))

    def nvmlEventSetWait(self, es: Any, timeout_ms: int) -> Any:  # noqa: N802
        assert es is self._set and timeout_ms > 0
        with self._cond:
            self.waits += 1
            if self.wait_error is not None:
                raise self.wait_error
            if not self._items:
                self._cond.wait(timeout_ms / 1000.0)
            if not self._items:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def nvmlEventSetFree(self, es: Any) -> None:  # noqa: N802
        self.freed.append(es)

    def nvmlDeviceGetIndex(self, h: Any) -> int:  # noqa: N802
        i = self._index(h)
        if i in self.probe_errors:
            raise self.probe_errors[i]
        return i

    def push(self, item: Any) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def xid(self, gpu: int, xid: int, event_type: int = XID_EVENT) -> pynvml.c_nvmlEventData_t:
        return pynvml.c_nvmlEventData_t(device=self.handles[gpu], eventType=event_type, eventData=xid,
                                        gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)


@pytest.fixture
def ev() -> EventNvml:
    return EventNvml()


@pytest.fixture
def watcher(ev: EventNvml) -> Iterator[XidWatcher]:
    w = XidWatcher(ev.devices(), ev, wait_ms=50, application_xids=(13, 31, 43, 45, 68, 94))
    yield w
    w.stop()


def collect(w: XidWatcher, n: int, timeout: float = 5.0) -> list[tuple[str, GpuFault]]:
    got: list[tuple[str, GpuFault]] = []

    def enough() -> bool:
        got.extend(w.drain()[0])
        return len(got) >= n

    wait_for(enough, timeout, f"{n} fault(s)", poll=0.01)
    return got


# == the watcher =============================================================================================
def test_an_xid_event_becomes_a_fault_on_that_gpu(ev: EventNvml, watcher: XidWatcher) -> None:
    assert watcher.start() == 2 and watcher.running
    assert ev.registered == [(0, XID_EVENT), (1, XID_EVENT)]
    ev.push(ev.xid(1, 79))
    [(uuid, fault)] = collect(watcher, 1)
    assert uuid == "GPU-ev-1"
    assert (fault.kind, fault.xid) == (XID, 79)
    assert "Xid 79 (GPU has fallen off the bus) on GPU 1 GPU-ev-1" in fault.detail
    assert is_draining(fault.kind)


def test_an_application_xid_is_marked_non_draining(ev: EventNvml, watcher: XidWatcher) -> None:
    watcher.start()
    ev.push(ev.xid(0, 13))
    ev.push(ev.xid(0, 48))
    got = collect(watcher, 2)
    assert [(u, f.kind, f.xid) for u, f in got] == [("GPU-ev-0", XID_APPLICATION, 13), ("GPU-ev-0", XID, 48)]
    assert "application error" in got[0][1].detail and not is_draining(XID_APPLICATION)


def test_other_event_types_are_ignored(ev: EventNvml, watcher: XidWatcher) -> None:
    watcher.start()
    ev.push(ev.xid(0, 5, event_type=pynvml.nvmlEventTypePState))
    ev.push(ev.xid(1, 94))
    [(uuid, fault)] = collect(watcher, 1)
    assert (uuid, fault.kind, fault.xid) == ("GPU-ev-1", XID_APPLICATION, 94)


def test_a_gpu_without_event_support_is_skipped(ev: EventNvml, watcher: XidWatcher) -> None:
    ev.register_errors[0] = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert watcher.start() == 1
    assert [u for _i, u, _h in watcher.registered] == ["GPU-ev-1"]
    assert "not supported" in watcher.skipped[0]
    assert watcher.drain() == ([], [])  # NotSupported is no fault


def test_a_gpu_lost_at_registration_is_a_fault(ev: EventNvml, watcher: XidWatcher) -> None:
    ev.register_errors[1] = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert watcher.start() == 1
    faults, _ = watcher.drain()
    assert [(u, f.kind) for u, f in faults] == [("GPU-ev-1", "gpu_lost")]
    assert "NVMLError_GpuIsLost" in watcher.skipped[1]


def test_no_watchable_gpu_starts_no_thread_and_frees_the_set(ev: EventNvml, watcher: XidWatcher) -> None:
    for i in (0, 1):
        ev.register_errors[i] = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert watcher.start() == 0
    assert not watcher.running and ev.freed == [ev._set] and ev.waits == 0


def test_gpu_lost_from_the_wait_names_the_gpu_that_fails_a_probe_once(ev: EventNvml, watcher: XidWatcher) -> None:
    watcher.start()
    ev.probe_errors[1] = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    ev.wait_error = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)  # and stays lost
    [(uuid, fault)] = collect(watcher, 1)
    assert (uuid, fault.kind) == ("GPU-ev-1", "gpu_lost")
    assert "GPU 1 is lost" in fault.detail and "Xid event wait" in fault.detail
    waits = ev.waits
    wait_for(lambda: ev.waits >= waits + 3, 5.0, "more failing waits", poll=0.01)
    assert watcher.drain() == ([], [])  # reported once, and the thread does not spin (it pauses per error)
    assert ev.waits < waits + 3 + 20


def test_reset_required_from_the_wait_without_a_culprit_blames_every_gpu(ev: EventNvml,
                                                                        watcher: XidWatcher) -> None:
    watcher.start()
    ev.push(pynvml.NVMLError(pynvml.NVML_ERROR_RESET_REQUIRED))
    got = collect(watcher, 2)
    assert sorted((u, f.kind) for u, f in got) == [("GPU-ev-0", "reset_required"), ("GPU-ev-1", "reset_required")]


def test_other_wait_errors_are_sample_errors_not_faults(ev: EventNvml, watcher: XidWatcher) -> None:
    watcher.start()
    ev.push(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN))
    errors = wait_for(lambda: watcher.drain()[1], 5.0, "a sample error", poll=0.01)
    assert [(e.error_class, e.where) for e in errors] == [("NVMLError_Unknown", "nvmlEventSetWait")]
    ev.push(ev.xid(0, 79))  # and the watcher goes on
    assert collect(watcher, 1)[0][1].xid == 79


def test_stop_returns_within_the_wait_timeout_and_frees_the_set(ev: EventNvml) -> None:
    w = XidWatcher(ev.devices(), ev, wait_ms=300)
    w.start()
    wait_for(lambda: ev.waits >= 1, 5.0, "the first wait", poll=0.01)
    t0 = time.monotonic()
    assert w.stop() is True
    took = time.monotonic() - t0
    assert took < 0.3 + 1.0, took  # one wait timeout plus scheduling slack, not the 600 s default
    assert not w.running and ev.freed == [ev._set]
    assert not any(t.name == "xid-events" and t.is_alive() for t in threading.enumerate())


def test_start_watcher_tolerates_a_pynvml_without_events() -> None:
    reader = started(FakeNvml(n_gpus=2))  # FakeNvml has no event functions at all
    w, note = start_watcher(reader)
    assert w is None and note == "Xid events unavailable (AttributeError)"
    backend, why = choose_backend("nvml", nvml_lib=FakeNvml(n_gpus=1))
    assert "Xid events unavailable" in why
    backend.close()


class EventFakeNvml(FakeNvml):
    """FakeNvml (the per-tick queries) plus the event calls, for choose_backend."""

    def __init__(self, n_gpus: int = 2) -> None:
        super().__init__(n_gpus=n_gpus)
        self.events = EventNvml(n_gpus)
        self.nvmlEventSetCreate = self.events.nvmlEventSetCreate
        self.nvmlEventSetWait = self.events.nvmlEventSetWait
        self.nvmlEventSetFree = self.events.nvmlEventSetFree
        self.nvmlEventTypeXidCriticalError = XID_EVENT

    def nvmlDeviceRegisterEvents(self, h: int, types_: int, es: Any) -> None:  # noqa: N802
        if h == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_choose_backend_watches_xids_unless_configured_off() -> None:
    fake = EventFakeNvml(n_gpus=2)
    backend, why = choose_backend("nvml", nvml_lib=fake)
    try:
        assert isinstance(backend, NvmlBackend) and backend.xids is not None and backend.xids.running
        assert "Xid events on 1 GPU(s)" in why
    finally:
        backend.close()
    assert backend.xids is not None and not backend.xids.running and fake.events.freed
    off, why = choose_backend("nvml", nvml_lib=EventFakeNvml(), faults=FaultsConfig(xid_events=False))
    assert isinstance(off, NvmlBackend) and off.xids is None and "Xid" not in why
    off.close()


# == faults into samples and findings ========================================================================
def test_attach_faults_prefers_draining_and_keeps_the_readers_own() -> None:
    devs = [DeviceSample(0, "GPU-a", "x"), DeviceSample(1, "GPU-b", "x", fault=GpuFault("gpu_lost", "lost")),
            DeviceSample(2, "GPU-c", "x")]
    app = xid_fault(13, 0, "GPU-a", (13,))
    crit = xid_fault(79, 0, "GPU-a", (13,))
    out = attach_faults(devs, [("GPU-a", app), ("GPU-a", crit), ("GPU-b", crit), ("GPU-zz", crit)])
    assert out[0].fault == crit
    assert out[1].fault is not None and out[1].fault.kind == "gpu_lost"
    assert out[2].fault is None
    assert attach_faults(devs, [("GPU-c", app)])[2].fault == app


class StubWatcher:
    def __init__(self) -> None:
        self.items: list[tuple[str, GpuFault]] = []
        self.stopped = False

    def drain(self) -> tuple[list[tuple[str, GpuFault]], list[Any]]:
        items, self.items = self.items, []
        return items, []

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def job_proc() -> Iterator[subprocess.Popen[bytes]]:
    env = {**base_env(), JOB_ID_ENV: "job-x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)
    wait_for(lambda: _env_ready(p.pid), 10, "the job's environment", poll=0.01)
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


def _env_ready(pid: int) -> bool:
    try:
        return "RANK" in psutil.Process(pid).environ()
    except psutil.Error:
        return False


def test_queued_xids_reach_the_sample_and_the_detector(job_proc: subprocess.Popen[bytes]) -> None:
    fake = FakeNvml(n_gpus=2)
    fake.gpus[0]["procs"] = [(job_proc.pid, 4 * GIB)]
    fake.gpus[1]["procs"] = []
    stub = StubWatcher()
    backend = NvmlBackend(started(fake), ProcessScanner(root_pid=job_proc.pid), "h", xids=stub)
    cfg = Config().detect
    state, findings = step(DetectorState(), backend.sample(), cfg)
    assert findings == []
    stub.items.append(("GPU-fake-0", xid_fault(79, 0, "GPU-fake-0", (13,))))
    s = backend.sample()
    assert s.devices[0].fault is not None and s.devices[0].fault.xid == 79 and s.devices[1].fault is None
    state, findings = step(state, s, cfg)
    [f] = findings
    assert (f.kind, f.signature, f.job_id, f.devices, f.basis) == ("gpu_fault", "xid", "job-x",
                                                                      ("GPU-fake-0",), "fault")
    assert "Xid 79" in f.detail and "jobs: job-x" in f.detail
    state, findings = step(state, backend.sample(), cfg)  # the event was one tick's news
    assert findings == []
    stub.items.append(("GPU-fake-0", xid_fault(13, 0, "GPU-fake-0", (13,))))
    state, findings = step(state, backend.sample(), cfg)
    assert [(f.kind, f.signature) for f in findings] == [("gpu_fault", "xid_application")]
    backend.close()
    assert stub.stopped


def test_a_lost_gpu_keeps_the_processes_last_seen_on_it(job_proc: subprocess.Popen[bytes]) -> None:
    fake = FakeNvml(n_gpus=1)
    fake.gpus[0]["procs"] = [(job_proc.pid, 4 * GIB)]
    backend = NvmlBackend(started(fake), ProcessScanner(root_pid=job_proc.pid), "h")
    state, _ = step(DetectorState(), backend.sample(), Config().detect)
    fake.fail[("nvmlDeviceGetUtilizationRates", 0)] = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    s = backend.sample()
    assert s.devices[0].fault is not None and s.devices[0].pids == {job_proc.pid}
    _, findings = step(state, s, Config().detect)
    [f] = findings
    assert (f.signature, f.job_id) == ("gpu_lost", "job-x")  # the job is named although NVML lists nothing


# == the policy in launch ====================================================================================
RECORDER = """\
import json, os, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"argv": sys.argv[2:], "cwd": os.getcwd(),
                        "env": {k: v for k, v in os.environ.items() if k.startswith("GPU_WATCHDOG_")}}) + "\\n")
"""


def recorder(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "record_drain.py"
    script.write_text(RECORDER)
    return script, tmp_path / "drain-calls.jsonl"


def calls(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def drain_cfg(tmp_path: Path, **faults: Any) -> Config:
    script, out = recorder(tmp_path)
    argv = (sys.executable, str(script), str(out), "nodename={node}", "state=drain",
            "reason=gpu-watchdog: {reason}", "{gpu}", "{xid}", "{incident}", "{job_id}")
    return Config(agent=AgentConfig(hostname="node-7"), recovery=RecoveryConfig(stop_grace_s=5.0),
                  faults=FaultsConfig(**{"drain_command": argv, **faults}))


def fault_sample(job_pid: int, fault: GpuFault, *, on_job_gpu: bool = True) -> NodeSample:
    p = psutil.Process(job_pid)
    proc = ProcessSample(job_pid, p.create_time(), p.ppid(), "sleeping", 0.0, None, 10 << 20,
                         job=JobIdentity("job-x", 0, 0, 1), is_rank=True)
    job_gpu = (GpuProcess(job_pid, 4 * GIB),)
    devices = (DeviceSample(0, "GPU-aaa", "H100", processes=job_gpu, fault=fault if on_job_gpu else None),
               DeviceSample(1, "GPU-bbb", "H100", fault=None if on_job_gpu else fault))
    return NodeSample(1000.0, "node-7", "nvml", devices, (proc,))


def launcher(cfg: Config, tmp_path: Path, hooks: dict[str, HookSpec] | None = None,
             metrics: Any = None) -> Launcher:
    return Launcher(cfg, ["true"], state_dir=tmp_path / "state", job_id="job-x", out=io.StringIO(),
                    metrics=metrics, hooks=hooks)


def policy_run(lc: Launcher, sample: NodeSample, child: subprocess.Popen[bytes]) -> tuple[int | None, list]:
    _, findings = step(DetectorState(), sample, lc.cfg.detect)
    [f] = findings
    outcome = lc.dispatcher(lc.target(child, 0)).dispatch([f], sample, {})
    return (outcome.exit_code if outcome is not None else None), findings


def test_a_draining_xid_stops_the_job_drains_the_node_and_exits_74(tmp_path: Path,
                                                                    job_proc: subprocess.Popen[bytes]) -> None:
    from gpu_watchdog.export.metrics import AgentMetrics

    metrics = AgentMetrics(process_metrics=False)
    lc = launcher(drain_cfg(tmp_path), tmp_path, metrics=metrics)
    before = FallbackDecision(1, "p2p-nvls-off", {"NCCL_P2P_DISABLE": "1"})
    lc.fallback.save("job-x", before, {"NCCL_P2P_DISABLE": "1"}, now=123.0)
    stored = (lc.fallback.root / "job-x.json").read_text()

    rc, _ = policy_run(lc, fault_sample(job_proc.pid, xid_fault(79, 0, "GPU-aaa", (13,))), job_proc)

    assert rc == EXIT_GPU_FAULT == 74
    assert job_proc.poll() is not None  # stopped by the stop ladder
    [inc] = lc.incidents.list()
    assert (inc["kind"], inc["signature"], inc["xid"], inc["gpu"]) == ("gpu_fault", "xid", 79, "GPU-aaa")
    assert inc["jobs"] == ["job-x"] and inc["job_id"] == "job-x" and inc["drain"] is True
    assert inc["fallback"] is None and "drain the node" in inc["advice"]
    assert [(a["action"], a["ok"]) for a in inc["actions"]] == [("stop", True), ("drain", True), ("exit", True)]
    [call] = calls(tmp_path / "drain-calls.jsonl")
    assert call["argv"] == ["nodename=node-7", "state=drain", "reason=gpu-watchdog: Xid 79 on GPU-aaa", "GPU-aaa",
                            "79", inc["id"], "job-x"]
    assert call["cwd"] == "/"
    assert call["env"]["GPU_WATCHDOG_XID"] == "79" and call["env"]["GPU_WATCHDOG_GPU"] == "GPU-aaa"
    assert call["env"]["GPU_WATCHDOG_INCIDENT"] == inc["id"]
    assert call["env"]["GPU_WATCHDOG_LEVEL"] == "1"  # the job's own fallback level, not a hard-coded 0
    # Never an NCCL fallback: the job's stored level and overlay are untouched.
    assert (lc.fallback.root / "job-x.json").read_text() == stored
    assert lc.fallback.level("job-x") == 1
    assert "NCCL_P2P_DISABLE" not in json.dumps(inc["actions"])
    assert metrics.registry.get_sample_value("gpu_watchdog_gpu_faults_total",
                                             {"UUID": "GPU-aaa", "kind": "xid_79"}) == 1.0
    assert metrics.registry.get_sample_value("gpu_watchdog_incidents_total", {"kind": "gpu_fault"}) == 1.0
    report = (Path(inc["stacks_dir"]).parent / "report.txt").read_text()
    assert "gpu_fault (xid)" in report and "drain: ok" in report


def test_an_application_xid_is_an_incident_only(tmp_path: Path, job_proc: subprocess.Popen[bytes]) -> None:
    lc = launcher(drain_cfg(tmp_path), tmp_path)
    rc, _ = policy_run(lc, fault_sample(job_proc.pid, xid_fault(13, 0, "GPU-aaa", (13,))), job_proc)
    assert rc is None and job_proc.poll() is None
    [inc] = lc.incidents.list()
    assert (inc["kind"], inc["signature"], inc["xid"], inc["drain"]) == ("gpu_fault", "xid_application", 13, False)
    assert inc["actions"] == [] and inc["fallback"] is None and "application error" in inc["advice"]
    assert calls(tmp_path / "drain-calls.jsonl") == []
    assert not (lc.fallback.root / "job-x.json").exists()


def test_a_fault_on_another_gpu_drains_once_but_keeps_the_job(tmp_path: Path,
                                                             job_proc: subprocess.Popen[bytes]) -> None:
    lc = launcher(drain_cfg(tmp_path), tmp_path)
    lost = GpuFault("gpu_lost", "GPU 1 is lost (fell off the bus?)")
    rc, _ = policy_run(lc, fault_sample(job_proc.pid, lost, on_job_gpu=False), job_proc)
    assert rc is None and job_proc.poll() is None
    rc, _ = policy_run(lc, fault_sample(job_proc.pid, xid_fault(48, 1, "GPU-bbb", ()), on_job_gpu=False),
                       job_proc)
    assert rc is None and job_proc.poll() is None
    first, second = lc.incidents.list()
    assert first["jobs"] == [] and first["signature"] == "gpu_lost" and first["xid"] is None
    assert [a["action"] for a in first["actions"]] == ["drain"] and first["actions"][0]["ok"]
    assert "already drained" in second["actions"][0]["detail"]
    [call] = calls(tmp_path / "drain-calls.jsonl")
    assert call["argv"][2] == "reason=gpu-watchdog: gpu lost on GPU-bbb" and call["argv"][4] == ""


def test_drain_hook_from_the_hooks_table_wins(tmp_path: Path, job_proc: subprocess.Popen[bytes]) -> None:
    script, out = recorder(tmp_path)
    hooks = {"node-drain": HookSpec("node-drain", "command",
                                    (sys.executable, str(script), str(out), "{node}", "{incident}"), 10.0)}
    lc = launcher(drain_cfg(tmp_path, drain_hook="node-drain"), tmp_path, hooks=hooks)
    rc, _ = policy_run(lc, fault_sample(job_proc.pid, GpuFault("reset_required", "GPU 0 requires a reset")),
                       job_proc)
    assert rc == EXIT_GPU_FAULT
    [inc] = lc.incidents.list()
    [call] = calls(out)
    assert call["argv"] == ["node-7", inc["id"]]
    assert call["env"]["GPU_WATCHDOG_REASON"] == "reset required on GPU-aaa"


def test_a_hanging_drain_command_is_killed_at_its_timeout(tmp_path: Path,
                                                          job_proc: subprocess.Popen[bytes]) -> None:
    cfg = drain_cfg(tmp_path, drain_command=(sys.executable, "-c", "import time; time.sleep(60)"),
                    drain_timeout_s=0.5)
    lc = launcher(cfg, tmp_path)
    t0 = time.monotonic()
    rc, _ = policy_run(lc, fault_sample(job_proc.pid, xid_fault(79, 0, "GPU-aaa", ())), job_proc)
    assert rc == EXIT_GPU_FAULT and time.monotonic() - t0 < 8
    [inc] = lc.incidents.list()
    drain = next(a for a in inc["actions"] if a["action"] == "drain")
    assert drain["ok"] is False and "timed out after" in drain["detail"]


def test_a_missing_drain_program_is_recorded_not_raised(tmp_path: Path, job_proc: subprocess.Popen[bytes]) -> None:
    lc = launcher(drain_cfg(tmp_path, drain_command=("/nonexistent/scontrol", "update")), tmp_path)
    rc, _ = policy_run(lc, fault_sample(job_proc.pid, xid_fault(79, 0, "GPU-aaa", ())), job_proc)
    assert rc == EXIT_GPU_FAULT
    drain = next(a for a in lc.incidents.list()[0]["actions"] if a["action"] == "drain")
    assert drain["ok"] is False and "cannot start" in drain["detail"]


def test_recovery_disabled_records_only(tmp_path: Path, job_proc: subprocess.Popen[bytes]) -> None:
    cfg = drain_cfg(tmp_path)
    from dataclasses import replace

    lc = launcher(replace(cfg, recovery=RecoveryConfig(enabled=False)), tmp_path)
    rc, _ = policy_run(lc, fault_sample(job_proc.pid, xid_fault(79, 0, "GPU-aaa", ())), job_proc)
    assert rc is None and job_proc.poll() is None and calls(tmp_path / "drain-calls.jsonl") == []


def test_drain_reason_is_printable_and_bounded() -> None:
    assert drain_reason("xid", 79, "GPU-1") == "Xid 79 on GPU-1"
    assert drain_reason("gpu_lost", None, "") == "gpu lost on a GPU"
    assert drain_reason("xid", 1, "GPU-$(reboot);`x`" + "a" * 300).count("$") == 0
    assert len(drain_reason("xid", 1, "a" * 300)) == 200


# == config ==================================================================================================
def _cfg(tmp_path: Path, text: str) -> Config:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load_config(p)


def test_faults_config_defaults_and_values(tmp_path: Path) -> None:
    d = Config().faults
    assert d.application_xids == (13, 31, 43, 45, 68, 94) and d.drain_hook == "" and d.xid_events
    assert d.drain_command[:2] == ("scontrol", "update") and "{node}" in d.drain_command[2]
    c = _cfg(tmp_path, '[faults]\napplication_xids = [43, 13, 13]\ndrain_command = ["/bin/drain", "{node}"]\n'
                       'drain_hook = "d"\n[hooks.d]\nargv = ["/bin/d", "{node}"]\n')
    assert c.faults.application_xids == (13, 43) and c.faults.drain_command == ("/bin/drain", "{node}")
    assert c.faults.drain_hook == "d"
    assert _cfg(tmp_path, "[faults]\ndrain_command = []\n").faults.drain_command == ()


@pytest.mark.parametrize(("text", "words"), [
    ('drain_command = ["scontrol", "{nodename}"]', r"faults\.drain_command\[1\]: unknown placeholder \{nodename\}"),
    ('drain_command = ["scontrol", "{node!r}"]', r"faults\.drain_command\[1\]"),
    ('drain_command = ["scontrol", "{node.__class__}"]', r"faults\.drain_command\[1\]"),
    ('drain_command = ["{node}", "x"]', r"faults\.drain_command\[0\] must be a fixed program"),
    ('drain_command = "scontrol update"', r"faults\.drain_command must be an array of strings"),
    ('application_xids = ["13"]', r"faults\.application_xids must be an array of Xid numbers"),
    ("application_xids = [true]", r"faults\.application_xids"),
    ('drain_hook = "nope"', r"faults\.drain_hook names no \[hooks\.nope\]"),
    ("event_wait_ms = 0", r"faults\.event_wait_ms must be > 0"),
    ('xid_events = "yes"', r"faults\.xid_events must be true or false"),
    ("drain_timeout_s = -1", r"faults\.drain_timeout_s must be > 0"),
    ("bogus = 1", r"unknown key faults\.bogus"),
])
def test_bad_faults_config_names_the_key(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _cfg(tmp_path, f"[faults]\n{text}\n")


def test_cli_rejects_a_bad_drain_command_with_exit_78(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[faults]\ndrain_command = ["scontrol", "{oops}"]\n')
    r = subprocess.run([CLI, "config", "show", "--config", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and len(r.stderr.strip().splitlines()) == 1 and "faults.drain_command[1]" in r.stderr


# == the real pynvml against the NVML stand-in ===============================================================
def test_standin_queued_xid_79_reaches_the_watcher(nvml_standin: NvmlStandin) -> None:
    state = nvml_standin.require_scripted()
    with state.batch():
        for _ in range(2):
            state.add_gpu()
    uuid1 = state.gpu(1)["uuid"]
    with nvml_standin.child() as child:
        child.exec("import time\n"
                   "from gpu_watchdog.sample.nvml import NvmlReader\n"
                   "from gpu_watchdog.sample.xid import XidWatcher\n"
                   "r = NvmlReader(); r.start()\n"
                   "w = XidWatcher.for_reader(r, wait_ms=100, application_xids=(13,))\n"
                   "n = w.start(); got = []\n")
        assert child.eval("n") == 2
        state.queue_xid(1, 79)
        state.queue_xid(0, 13)

        def faults() -> list[list[Any]]:
            child.exec("got += [[u, f.kind, f.xid] for u, f in w.drain()[0]]")
            got: list[list[Any]] = child.eval("got")
            return got if len(got) >= 2 else []

        got = wait_for(faults, 10, "two Xid faults", poll=0.01)
        assert sorted(got, key=lambda g: g[2]) == [[state.gpu(0)["uuid"], "xid_application", 13],
                                                    [uuid1, "xid", 79]]
        child.exec("t0 = time.monotonic(); ok = w.stop(); took = time.monotonic() - t0; r.shutdown()")
        assert child.eval("ok") is True and child.eval("took") < 2.0


JOB = """\
import os, sys, time
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.1)
"""


def _launch_on_standin(nvml_standin: NvmlStandin, tmp_path: Path, job_id: str, *, faults: dict[str, Any],
                       extra_toml: str = "") -> tuple[Any, Path, Path, list[str]]:
    """``gpu-watchdog launch --backend nvml`` (real pynvml on the stand-in, two GPUs) around a one-process
    job that writes its pid and waits for ``done_file``."""
    state = nvml_standin.require_scripted()
    with state.batch():
        for _ in range(2):
            state.add_gpu(utilization_gpu=90, power_mw=400_000)
    uuids = [state.gpu(i)["uuid"] for i in range(2)]
    cfg = write_config(tmp_path / "watchdog.toml", {
        "agent": {"interval_s": 0.5, "hostname": "gpu-node-3"},
        "detect": {"suspect_after_s": 120.0, "confirm_after_s": 300.0},  # this test is about faults only
        "recovery": {"stop_grace_s": 5.0, "memory_release_timeout_s": 5.0},
        "faults": {"event_wait_ms": 200, **faults},
    })
    cfg.write_text(cfg.read_text() + extra_toml)
    (tmp_path / "job.py").write_text(JOB)
    pid_file, done_file = tmp_path / "job.pid", tmp_path / "job.done"
    env = {**nvml_standin.env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    run = start_launch(["--backend", "nvml", "--config", str(cfg)],
                       [sys.executable, str(tmp_path / "job.py"), str(pid_file), str(done_file)],
                       env=env, tmp_path=tmp_path, job_id=job_id, max_lifetime_s=120)
    return run, pid_file, done_file, uuids


def _xid_on_the_jobs_gpu(nvml_standin: NvmlStandin, run: Any, pid_file: Path, gpu: int, xid: int,
                         pids: list[int]) -> None:
    """Once the job wrote its pid (appended to ``pids``, for the cleanup): put it on GPU ``gpu``, let the agent
    watch it there for a tick or two, then queue Xid ``xid`` on that GPU."""
    state = nvml_standin.state
    assert state is not None
    pids.append(int(run.wait_for("the job's pid", lambda: pid_file.exists() and pid_file.read_text(), 30)))
    state.place_process(gpu, pids[0], 8 * GIB)
    run.wait_for("Xid watching", lambda: "Xid events on 2 GPU(s)" in run.output(), 30)
    time.sleep(1.0)
    state.queue_xid(gpu, xid)


def test_standin_launch_xid_79_stops_drains_and_exits_74(nvml_standin: NvmlStandin, tmp_path: Path) -> None:
    """The whole path on the agent's real pynvml: an Xid 79 event on the job's GPU → gpu_fault incident →
    job stopped → drain hook (a [hooks.NAME] named by faults.drain_hook) → exit 74, no NCCL fallback."""
    script, out = recorder(tmp_path)
    hook = (f"\n[hooks.node-drain]\nargv = {json.dumps([sys.executable, str(script), str(out)])[:-1]}, "
            '"nodename={node}", "{incident}"]\ntimeout_s = 20.0\n')
    run, pid_file, _done, uuids = _launch_on_standin(nvml_standin, tmp_path, "xid79",
                                                     faults={"drain_hook": "node-drain"}, extra_toml=hook)
    pids: list[int] = []
    try:
        _xid_on_the_jobs_gpu(nvml_standin, run, pid_file, 1, 79, pids)
        rc = run.wait(timeout=60)
    finally:
        run.kill(pids)
    pid = pids[0]
    out_text = run.output()
    assert rc == EXIT_GPU_FAULT, out_text[-3000:]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    [inc] = run.incidents()
    assert (inc["kind"], inc["signature"], inc["xid"], inc["gpu"]) == ("gpu_fault", "xid", 79, uuids[1])
    assert inc["jobs"] == ["xid79"] and inc["fallback"] is None and inc["devices"] == [uuids[1]]
    assert [(a["action"], a["ok"]) for a in inc["actions"]] == [("stop", True), ("drain", True), ("exit", True)]
    [call] = calls(out)
    assert call["argv"] == ["nodename=gpu-node-3", inc["id"]]
    assert call["env"]["GPU_WATCHDOG_XID"] == "79" and call["env"]["GPU_WATCHDOG_GPU"] == uuids[1]
    assert "GPU_FAULT" in out_text and "exit 74" in out_text
    assert not (run.state_dir / "jobs" / "xid79.json").exists()  # the fallback store never saw this job
    env_out = subprocess.run([CLI, "env", "--state-dir", str(run.state_dir), "--job", "xid79"],
                             capture_output=True, text=True, check=True).stdout
    assert "level 0" in env_out and "export" not in env_out


def test_standin_launch_application_xid_only_records(nvml_standin: NvmlStandin, tmp_path: Path) -> None:
    script, out = recorder(tmp_path)
    argv = [sys.executable, str(script), str(out), "{node}"]
    run, pid_file, done_file, uuids = _launch_on_standin(nvml_standin, tmp_path, "xid13",
                                                         faults={"drain_command": argv})
    pids: list[int] = []
    try:
        _xid_on_the_jobs_gpu(nvml_standin, run, pid_file, 0, 13, pids)
        run.wait_for("an incident", lambda: run.incidents()[:1], 30)
        time.sleep(1.5)  # the job keeps running under the watchdog
        assert run.poll() is None and psutil.pid_exists(pids[0])
        done_file.write_text("")
        rc = run.wait(timeout=30)
    finally:
        run.kill(pids)
    assert rc == 0, run.output()[-3000:]
    [inc] = run.incidents()
    assert (inc["kind"], inc["signature"], inc["xid"], inc["drain"]) == ("gpu_fault", "xid_application", 13, False)
    assert inc["gpu"] == uuids[0] and inc["jobs"] == ["xid13"] and inc["actions"] == []
    assert calls(out) == []


def test_a_critical_xid_right_after_an_application_xid_is_still_reported() -> None:
    cfg = Config().detect

    def tick(t: float, fault: GpuFault | None) -> NodeSample:
        return NodeSample(t, "h", "nvml", (DeviceSample(0, "GPU-a", "x", fault=fault),))

    app, crit = xid_fault(13, 0, "GPU-a", (13,)), xid_fault(79, 0, "GPU-a", (13,))
    lost = GpuFault("gpu_lost", "GPU 0 is lost (fell off the bus?)")
    state, seen = DetectorState(), []
    for t, fault in enumerate((app, crit, lost, lost, lost, None, lost)):
        state, findings = step(state, tick(float(t), fault), cfg)
        seen += [(t, f.signature) for f in findings]
    # each new fault once; a lost GPU that stays lost is one finding until it clears and comes back
    assert seen == [(0, "xid_application"), (1, "xid"), (2, "gpu_lost"), (6, "gpu_lost")]
