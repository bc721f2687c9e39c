"""gpu_watchdog.export.metrics: the snapshot collector, counters, caps, and a real promtool lint of a scrape."""

from __future__ import annotations

import threading
import urllib.request
from typing import Any

import prom
import pytest
from gpu_watchdog.act.events import TimeSaved
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.export.http import serve
from gpu_watchdog.export.metrics import OVERFLOW, PYSPY_OUTCOMES, AgentMetrics
from gpu_watchdog.model import Deadline, DeviceSample, JobStatus, NodeSample, SampleError
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

T0 = 1_700_000_000.0


def gpu(i: int, **kw: Any) -> DeviceSample:
    fields: dict[str, Any] = dict(util_percent=50.0, mem_used_bytes=10 << 30, mem_total_bytes=80 << 30,
                                  power_w=300.0)
    fields.update(kw)
    return DeviceSample(i, f"GPU-{i}", "NVIDIA H100", **fields)


def node(*devices: DeviceSample, t: float = T0) -> NodeSample:
    return NodeSample(t=t, hostname="node1", backend="nvml", devices=devices)


def value(m: AgentMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def gpu_labels(i: int) -> dict[str, str]:
    return {"gpu": str(i), "UUID": f"GPU-{i}", "Hostname": "node1"}


def series(m: AgentMetrics, name: str) -> list[dict[str, str]]:
    return [s.labels for fam in m.registry.collect() for s in fam.samples if s.name == name]


def scraped(m: AgentMetrics, name: str) -> list[float]:
    """``name``'s values in the text a scrape gets (render() is what /metrics serves a plain client)."""
    return [s.value for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples
            if s.name == name]


def scrape_over_http(m: AgentMetrics) -> str:
    health = LoopHealth(10.0)
    health.tick_ok()
    with serve("127.0.0.1:0", m.registry, health) as srv:
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=10) as r:
            assert r.status == 200
            return r.read().decode()


# -- the snapshot collector -------------------------------------------------------------------------------
def test_gpu_series_from_the_snapshot() -> None:
    m = AgentMetrics()
    jobs = {"j1": JobStatus("j1", state="stalled", ranks=(0, 1), devices=("GPU-0",)),
            "j2": JobStatus("j2", state="running", ranks=(2,), devices=("GPU-1",))}
    m.update(node(gpu(0, util_percent=97.0), gpu(1)), jobs, {})
    assert value(m, "gpu_watchdog_gpu_utilization_ratio", **gpu_labels(0)) == pytest.approx(0.97)
    assert value(m, "gpu_watchdog_gpu_memory_used_bytes", **gpu_labels(0)) == 10 << 30
    assert value(m, "gpu_watchdog_gpu_memory_total_bytes", **gpu_labels(1)) == 80 << 30
    assert value(m, "gpu_watchdog_gpu_power_watts", **gpu_labels(1)) == 300.0
    assert value(m, "gpu_watchdog_gpu_stalled", **gpu_labels(0)) == 1.0
    assert value(m, "gpu_watchdog_gpu_stalled", **gpu_labels(1)) == 0.0
    assert value(m, "gpu_watchdog_gpu_info", **gpu_labels(0), model_name="NVIDIA H100") == 1.0
    assert value(m, "gpu_watchdog_last_sample_timestamp_seconds") == T0
    assert value(m, "gpu_watchdog_backend_info", backend="nvml") == 1.0
    assert value(m, "gpu_watchdog_up") == 1.0


def test_memory_controller_utilization_and_pcie_link() -> None:
    m = AgentMetrics()
    m.update(node(gpu(0, util_percent=100.0, mem_util_percent=0.0, pcie_link_bytes_per_s=63.0e9),
                  gpu(1, mem_util_percent=38.0)), {}, {})
    assert value(m, "gpu_watchdog_gpu_memory_controller_utilization_ratio", **gpu_labels(0)) == 0.0
    assert value(m, "gpu_watchdog_gpu_memory_controller_utilization_ratio", **gpu_labels(1)) == pytest.approx(0.38)
    assert value(m, "gpu_watchdog_gpu_utilization_ratio", **gpu_labels(0)) == 1.0  # the spin: SMs 1, memory 0
    assert value(m, "gpu_watchdog_gpu_pcie_link_bytes_per_second", **gpu_labels(0)) == 63.0e9
    assert series(m, "gpu_watchdog_gpu_pcie_link_bytes_per_second") == [gpu_labels(0)]  # GPU 1: unknown
    assert "# TYPE gpu_watchdog_gpu_memory_controller_utilization_ratio gauge" in m.render().decode()


def test_no_series_for_none_values() -> None:
    m = AgentMetrics()
    m.update(node(gpu(0, util_percent=None, mem_total_bytes=None, power_w=None)), {}, {})
    for name in ("gpu_watchdog_gpu_utilization_ratio", "gpu_watchdog_gpu_memory_controller_utilization_ratio",
                 "gpu_watchdog_gpu_memory_total_bytes", "gpu_watchdog_gpu_power_watts",
                 "gpu_watchdog_gpu_pcie_link_bytes_per_second"):
        assert series(m, name) == [], name
    assert value(m, "gpu_watchdog_gpu_memory_used_bytes", **gpu_labels(0)) == 10 << 30
    assert value(m, "gpu_watchdog_gpu_stalled", **gpu_labels(0)) == 0.0


def test_before_the_first_sample_only_agent_series() -> None:
    m = AgentMetrics()
    assert value(m, "gpu_watchdog_up") == 1.0
    assert value(m, "gpu_watchdog_last_sample_timestamp_seconds") is None
    assert value(m, "gpu_watchdog_start_time_seconds") is not None
    assert value(m, "gpu_watchdog_build_info", version=m.version) == 1.0
    assert series(m, "gpu_watchdog_job_state") == []


def test_job_series_one_hot_and_waiting() -> None:
    m = AgentMetrics()
    jobs = {"a": JobStatus("a", state="suspect", ranks=(0, 1, 2, 3)),
            "b": JobStatus("b", state="waiting", ranks=(0, 1, 2, 3), waiting_since=T0 - 30, waiting_on=(0,))}
    m.update(node(t=T0), jobs, {"a": 1})
    for job, state in (("a", "suspect"), ("b", "waiting")):
        hot = {labels["state"] for labels in series(m, "gpu_watchdog_job_state")
               if labels["job_id"] == job and value(m, "gpu_watchdog_job_state", **labels) == 1.0}
        assert hot == {state}
        assert len([s for s in series(m, "gpu_watchdog_job_state") if s["job_id"] == job]) == 4
    assert value(m, "gpu_watchdog_job_stalled", job_id="a") == 0.0
    assert value(m, "gpu_watchdog_job_ranks", job_id="a") == 4.0
    assert value(m, "gpu_watchdog_job_fallback_level", job_id="a") == 1.0
    assert value(m, "gpu_watchdog_job_fallback_level", job_id="b") == 0.0
    assert value(m, "gpu_watchdog_job_waiting_seconds", job_id="b") == 30.0
    assert value(m, "gpu_watchdog_job_waiting_seconds", job_id="a") == 0.0
    assert series(m, "gpu_watchdog_rank_waited_on") == [{"job_id": "b", "rank": "0"}]
    # no pid label anywhere
    assert not any("pid" in s.labels for fam in m.registry.collect() for s in fam.samples)


def test_a_wait_governed_by_the_jobs_deadline_exports_the_deadline_and_the_time_left() -> None:
    m = AgentMetrics()
    deadline = Deadline(900.0, "client", "every process group's timeout (15 min)")
    jobs = {"a": JobStatus("a", state="waiting", ranks=(0, 1), waiting_since=T0 - 600, waiting_on=(0,),
                           deadline=deadline),
            "b": JobStatus("b", state="waiting", ranks=(0, 1), waiting_since=T0 - 30, waiting_on=(0,))}
    m.update(node(t=T0), jobs, {})
    assert value(m, "gpu_watchdog_job_deadline_seconds", job_id="a", source="client") == 900.0
    assert value(m, "gpu_watchdog_job_deadline_left_seconds", job_id="a") == 300.0
    assert series(m, "gpu_watchdog_job_deadline_left_seconds") == [{"job_id": "a"}]  # b: no deadline governs
    m.update(node(t=T0 + 1), {"a": JobStatus("a")}, {})  # running again: the series go
    assert series(m, "gpu_watchdog_job_deadline_left_seconds") == []


def test_time_saved_counts_gpu_seconds() -> None:
    m = AgentMetrics()
    assert value(m, "gpu_watchdog_gpu_seconds_saved_total") == 0.0
    m.count(TimeSaved(1795.0, 4 * 1795.0))
    m.count(TimeSaved(0.0, 0.0))
    assert value(m, "gpu_watchdog_gpu_seconds_saved_total") == 7180.0
    assert value(m, "gpu_watchdog_incidents_total", kind="deadline") == 0.0


def test_a_job_that_ends_stops_its_series() -> None:
    m = AgentMetrics()
    m.update(node(), {"a": JobStatus("a")}, {})
    assert value(m, "gpu_watchdog_job_stalled", job_id="a") == 0.0
    m.update(node(), {}, {})
    assert series(m, "gpu_watchdog_job_stalled") == []


def test_proc_backend_model_name_carries_no_pid() -> None:
    m = AgentMetrics()
    d = DeviceSample(0, "proc-j-r0", "rank 0 (pid 4242)", util_percent=3.0, mem_used_bytes=1 << 20, virtual=True)
    m.update(node(d), {}, {})
    assert series(m, "gpu_watchdog_gpu_info") == [{"gpu": "0", "UUID": "proc-j-r0", "Hostname": "node1",
                                                   "model_name": "virtual"}]


def test_job_cardinality_cap_keeps_stalled_jobs_and_counts_the_rest() -> None:
    m = AgentMetrics(max_jobs=64, max_ranks=4)
    jobs = {f"job-{i:03d}": JobStatus(f"job-{i:03d}", state="running", ranks=(0,)) for i in range(100)}
    jobs["zz-stalled"] = JobStatus("zz-stalled", state="stalled", ranks=(0,))
    jobs["zz-waiting"] = JobStatus("zz-waiting", state="waiting", ranks=tuple(range(10)), waiting_since=T0,
                                   waiting_on=tuple(range(10)))
    m.update(node(), jobs, {})
    exported = {s["job_id"] for s in series(m, "gpu_watchdog_job_stalled")}
    assert len(exported) == 64
    assert {"zz-stalled", "zz-waiting"} <= exported
    assert value(m, "gpu_watchdog_jobs_dropped") == 102 - 64
    assert len(series(m, "gpu_watchdog_rank_waited_on")) == 4
    assert value(m, "gpu_watchdog_ranks_dropped") == 6
    # restarts{job_id} was pre-initialised for at most max_jobs jobs
    assert len(series(m, "gpu_watchdog_restarts_total")) <= 64


def test_counter_label_caps() -> None:
    m = AgentMetrics(max_jobs=3)
    for i in range(5):
        m.restart(f"j{i}")
    assert {s["job_id"] for s in series(m, "gpu_watchdog_restarts_total")} == {"j0", "j1", "j2", OVERFLOW}
    assert value(m, "gpu_watchdog_restarts_total", job_id=OVERFLOW) == 2.0
    for i in range(40):
        m.nvml_errors([SampleError(f"Err{i}", "nvmlDeviceGetPowerUsage gpu 0")])
    assert len(series(m, "gpu_watchdog_nvml_errors_total")) == 33  # 32 classes + other
    m.pyspy_dump("something-new")
    assert value(m, "gpu_watchdog_pyspy_dumps_total", outcome=OVERFLOW) == 1.0
    m.incident("x" * 500)
    assert all(len(s["kind"]) <= 128 for s in series(m, "gpu_watchdog_incidents_total"))


# -- counters and histograms -------------------------------------------------------------------------------
def test_preinitialised_counters_read_zero() -> None:
    m = AgentMetrics()
    assert value(m, "gpu_watchdog_incidents_total", kind="stall") == 0.0
    assert value(m, "gpu_watchdog_incidents_total", kind="gpu_fault") == 0.0
    for outcome in PYSPY_OUTCOMES:
        assert value(m, "gpu_watchdog_pyspy_dumps_total", outcome=outcome) == 0.0
    m.update(node(), {"train": JobStatus("train")}, {})
    assert value(m, "gpu_watchdog_restarts_total", job_id="train") == 0.0


def test_counters_and_histograms() -> None:
    m = AgentMetrics()
    m.incident("stall")
    m.incident("stall")
    m.action("restart", True)
    m.action("checkpoint", False)
    m.restart("train")
    m.pyspy_dump("ok")
    m.pyspy_dump("timeout")
    m.nvml_errors([SampleError("NVMLError_Unknown", "nvmlDeviceGetPowerUsage gpu 0"),
                   SampleError("NVMLError_Unknown", "nvmlDeviceGetPowerUsage gpu 1"),
                   SampleError("AccessDenied", "pid 1")])
    m.gpu_fault("GPU-0", 79)
    m.gpu_fault("GPU-0", 79)
    m.gpu_fault("GPU-1", "gpu_lost")
    m.sample_duration(0.003)
    m.detection_latency(14.0)
    m.detection_latency(700.0)
    assert value(m, "gpu_watchdog_incidents_total", kind="stall") == 2.0
    assert value(m, "gpu_watchdog_actions_total", action="restart", result="ok") == 1.0
    assert value(m, "gpu_watchdog_actions_total", action="checkpoint", result="failed") == 1.0
    assert value(m, "gpu_watchdog_restarts_total", job_id="train") == 1.0
    assert value(m, "gpu_watchdog_pyspy_dumps_total", outcome="timeout") == 1.0
    assert value(m, "gpu_watchdog_nvml_errors_total", error_class="NVMLError_Unknown") == 2.0
    assert value(m, "gpu_watchdog_nvml_errors_total", error_class="AccessDenied") is None  # psutil's, not NVML's
    assert value(m, "gpu_watchdog_process_errors_total", error_class="AccessDenied") == 1.0
    assert value(m, "gpu_watchdog_gpu_faults_total", UUID="GPU-0", kind="xid_79") == 2.0
    assert value(m, "gpu_watchdog_gpu_faults_total", UUID="GPU-1", kind="gpu_lost") == 1.0
    assert value(m, "gpu_watchdog_sample_duration_seconds_bucket", le="0.005") == 1.0
    assert value(m, "gpu_watchdog_detection_latency_seconds_bucket", le="15.0") == 1.0
    assert value(m, "gpu_watchdog_detection_latency_seconds_bucket", le="600.0") == 1.0
    assert value(m, "gpu_watchdog_detection_latency_seconds_count") == 2.0


def test_job_config_digest_replaces_and_forgets() -> None:
    m = AgentMetrics()
    m.job_config("train", "aaa")
    m.job_config("train", "bbb")
    assert series(m, "gpu_watchdog_job_config_info") == [{"job_id": "train", "digest": "bbb"}]
    m.forget_job("train")
    assert series(m, "gpu_watchdog_job_config_info") == []


def test_up_is_0_while_sampling_fails_until_the_next_update() -> None:
    m = AgentMetrics()
    m.update(node(gpu(0)), {}, {})
    assert scraped(m, "gpu_watchdog_up") == [1.0]
    m.set_up(False)  # the backend's sample() raised
    assert scraped(m, "gpu_watchdog_up") == [0.0]
    assert scraped(m, "gpu_watchdog_up") == [0.0]  # scraping does not reset it; only a sample does
    m.set_up(False)
    m.update(node(gpu(0)), {}, {})
    assert scraped(m, "gpu_watchdog_up") == [1.0]


def test_pyspy_outcomes_match_the_stacks_module() -> None:
    from gpu_watchdog.evidence.stacks.dump import OUTCOMES

    assert tuple(PYSPY_OUTCOMES) == tuple(OUTCOMES)


def test_shared_registry_gets_no_process_collector() -> None:
    reg = CollectorRegistry()
    m = AgentMetrics(reg)
    assert m.registry is reg
    assert not any(n.startswith("process_") for n in prom.exported_names(reg))
    assert any(n.startswith("process_") for n in prom.exported_names(AgentMetrics().registry))


# -- a scrape touches nothing but the snapshot -----------------------------------------------------------
class RaisingBackend:
    """A sampling backend that fails on every call."""

    name = "raising"

    def sample(self) -> NodeSample:
        raise AssertionError("sample() called")

    def close(self) -> None:
        raise AssertionError("close() called")


def _forbid(monkeypatch: pytest.MonkeyPatch, module: Any, what: str) -> None:
    def boom(*_a: Any, **_k: Any) -> Any:
        raise AssertionError(f"{what} called during a scrape")

    for name in dir(module):
        obj = getattr(module, name)
        is_exception = isinstance(obj, type) and issubclass(obj, BaseException)
        if not name.startswith("_") and callable(obj) and not is_exception:
            monkeypatch.setattr(module, name, boom)


def test_registering_and_scraping_never_call_nvml_or_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpu_watchdog.sample.nvml as nvml_mod
    import gpu_watchdog.sample.processes as processes_mod
    import psutil
    import pynvml

    good = node(gpu(0), gpu(1))
    jobs = {"train": JobStatus("train", state="stalled", ranks=(0, 1), devices=("GPU-0",))}
    backend: Any = RaisingBackend()
    for mod, what in ((pynvml, "NVML"), (psutil, "psutil")):
        _forbid(monkeypatch, mod, what)
    for cls in (nvml_mod.NvmlReader, processes_mod.ProcessScanner):
        for name in ("read_all", "start", "sample", "shutdown"):
            if hasattr(cls, name):
                monkeypatch.setattr(cls, name, lambda *_a, **_k: (_ for _ in ()).throw(AssertionError("called")))

    with pytest.raises(AssertionError):
        psutil.Process()
    with pytest.raises(AssertionError):
        pynvml.nvmlInit()
    m = AgentMetrics()  # registration: describe() only
    m.update(good, jobs, {"train": 1})
    try:  # what the loop does when the backend fails
        backend.sample()
    except AssertionError:
        m.set_up(False)
    for _ in range(3):
        text = scrape_over_http(m)
    assert 'gpu_watchdog_gpu_stalled{Hostname="node1",UUID="GPU-0",gpu="0"} 1.0' in text
    assert "gpu_watchdog_up 0.0" in text


def test_registration_does_not_collect(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_watchdog.export import metrics as metrics_mod
    def no_collect(self: Any) -> Any:
        raise AssertionError("collect() during registration")

    monkeypatch.setattr(metrics_mod._SnapshotCollector, "collect", no_collect)
    AgentMetrics(CollectorRegistry(auto_describe=True))


def test_concurrent_updates_and_scrapes() -> None:
    m = AgentMetrics()
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            js = JobStatus("j", state=("running", "stalled")[i % 2], ranks=(0,), devices=("GPU-0",))
            m.update(node(gpu(0), t=T0 + i), {"j": js}, {})
            m.incident("stall")

    th = threading.Thread(target=loop)
    th.start()
    try:
        for _ in range(50):
            text = m.render().decode()
            assert text.count("gpu_watchdog_job_stalled{") == 1
    except BaseException as e:  # pragma: no cover
        errors.append(e)
    finally:
        stop.set()
        th.join()
    assert not errors


# -- promtool ----------------------------------------------------------------------------------------------
def test_promtool_check_metrics_on_a_live_scrape() -> None:
    prom.require("promtool")
    text = scrape_over_http(prom.populated_metrics())
    r = prom.promtool("check", "metrics", stdin=text)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
