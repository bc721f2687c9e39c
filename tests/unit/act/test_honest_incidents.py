"""Incidents say what happened: every incident written is counted (daemon-observed ones too), a level's NCCL advice
only reaches stalls of GPU jobs, and Flight Recorder dumps nothing can trigger are "not available", not FAILED."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_watchdog.act.gather import EvidenceGatherer
from gpu_watchdog.act.recovery import _on_gpus, observe
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.load import load_config
from gpu_watchdog.evidence.flight_recorder.incident import FlightRecorderAtIncident
from gpu_watchdog.evidence.report import action_status
from gpu_watchdog.evidence.source import IncidentJob
from gpu_watchdog.export.metrics import AgentMetrics
from gpu_watchdog.model import DeviceSample, Finding, NodeSample
from gpu_watchdog.policy.ladder import decide
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore


def ctx_for(tmp_path: Path, metrics: AgentMetrics | None = None) -> ActContext:
    return ActContext(load_config(None), "n1", IncidentStore(tmp_path), FallbackStore(tmp_path), metrics)


def finding(devices: tuple[str, ...] = ("proc-j-r0",), kind: str = "stall") -> Finding:
    return Finding(kind, "idle_held", "j", (0, 1), (1,), 1.0, 6.0, devices, "no rank makes progress", "stacks")


def sample(*devices: DeviceSample) -> NodeSample:
    return NodeSample(t=6.0, hostname="n1", backend="proc", devices=devices, processes=(), errors=())


def test_every_incident_is_counted_observed_ones_too(tmp_path: Path) -> None:
    metrics = AgentMetrics(process_metrics=False)
    ctx = ctx_for(tmp_path, metrics)
    for _ in range(3):
        observe(ctx, finding(), None, sample(), None, "not registered")
    assert len(ctx.incidents.list()) == 3
    assert metrics.registry.get_sample_value("gpu_watchdog_incidents_total", {"kind": "stall"}) == 3.0


def test_level_advice_only_for_gpu_stalls() -> None:
    gpu = DeviceSample(index=0, uuid="GPU-0", name="H20")
    proc = DeviceSample(index=0, uuid="proc-j-r0", name="rank 0", virtual=True)
    assert _on_gpus(finding(("GPU-0",)), sample(gpu)) and not _on_gpus(finding(), sample(proc))
    cfg = load_config(None).fallback
    comm = "stacks: ranks 0,2 wait in all_reduce"
    assert "P2P" in decide(cfg, 0, "stall", "collective", communication=comm).advice
    quiet = decide(cfg, 0, "stall", "collective", communication=comm, level_advice=False)
    assert (quiet.level, quiet.advice) == (1, "")  # still climbs, says nothing about PCIe boxes


def test_flight_recorder_without_a_trigger_is_not_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    ctx = ctx_for(tmp_path)
    inc = ctx.open_incident(finding())
    env = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr-")}  # gloo: no pipe
    monkeypatch.setattr(psutil.Process, "environ", lambda self: env)
    job = IncidentJob("", {0: 1, 1: 1}, None, inc.dir)
    EvidenceGatherer(ctx).ask(ctx.transcript(inc), FlightRecorderAtIncident(), job)
    (fr,) = [a for a in inc.summary["actions"] if a["action"] == "flight_recorder"]
    assert (fr["ok"], fr["outcome"], action_status(fr)) == (False, "not_available", "not available"), fr
