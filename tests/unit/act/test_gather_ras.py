"""An incident's NCCL RAS evidence: the gatherer asks the stand-in RAS server twice, writes ``ras.json`` and names
the hung communicator's culprits; a job RAS is not asked about gets no action and no file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from gpu_watchdog.act.gather import EvidenceGatherer
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.schema import Config, RasConfig, StacksConfig
from gpu_watchdog.detect.detector import STALLED
from gpu_watchdog.model import Finding, JobStatus, NodeSample
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore
from ras_standin import Comm, Rank, RasStandIn, report_json


def stuck_report() -> str:
    """rank 1 never launched its 11th AllReduce; the others wait in it."""
    return report_json([Comm(0x5, 2, [Rank(0, pid=200, counts={"AllReduce": 11}),
                                      Rank(1, pid=201, cuda_dev=1, counts={"AllReduce": 10})])])


def gather(tmp_path: Path, ras: RasConfig, rank_pid: int | None = None) -> dict:
    cfg = replace(Config(), stacks=StacksConfig(enabled=False),
                  ras=replace(ras, timeout_s=2.0, confirm_gap_s=0.05))
    ctx = ActContext(cfg, "node", IncidentStore(tmp_path), FallbackStore(tmp_path))
    now = time.time()
    finding = Finding("stall", "idle_held", "job", (0, 1), (), now - 5, now)
    inc = ctx.open_incident(finding)
    status = JobStatus("job", STALLED, rank_pids={0: rank_pid or os.getpid()})
    EvidenceGatherer(ctx).gather(ctx.transcript(inc), finding, status, NodeSample(now, "node", "proc"))
    return {"summary": json.loads((inc.dir / "summary.json").read_text()), "dir": inc.dir}


def test_a_stalled_jobs_incident_records_ras_evidence(tmp_path: Path) -> None:
    with RasStandIn([stuck_report()]) as s:
        got = gather(tmp_path, RasConfig(enabled="on", addr=s.addr))
        assert s.connections == 2
    summary, ras = got["summary"], json.loads((got["dir"] / "ras.json").read_text())
    assert summary["ras_culprit_ranks"] == [1] and summary["ras_hung_communicators"] == 1
    (action,) = [a for a in summary["actions"] if a["action"] == "nccl_ras"]
    assert action["ok"] and "1 hung communicator(s); culprit ranks 1" in action["detail"]
    assert ras["culprit_ranks"] == [1] and len(ras["polls"]) == 2
    assert all(p["raw"].startswith("{") and p["format"] == "json" for p in ras["polls"])
    assert ras["hung"]["suspects"][0]["behind"] == {"AllReduce": 1}
    # no stacks, no Flight Recorder: the merge of evidence sources (evidence.culprit) lets RAS name the culprit
    assert summary["culprit_ranks"] == [1] and summary["culprit_evidence"] == "nccl_ras"
    assert summary["reason"].startswith("NCCL RAS at ") and "culprit ranks 1" in summary["reason"]


def test_a_job_not_asked_gets_no_ras_action(tmp_path: Path) -> None:
    with RasStandIn([stuck_report()]) as s:
        # A gloo rank whose NCCL_RAS_ADDR names a live RAS server it does not serve itself: auto asks nothing.
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env=dict(os.environ, NCCL_RAS_ADDR=s.addr))
        try:
            got = gather(tmp_path, RasConfig(enabled="auto"), rank.pid)
        finally:
            rank.kill()
            rank.wait()
        assert s.connections == 0
    assert not (got["dir"] / "ras.json").exists()
    assert all(a["action"] != "nccl_ras" for a in got["summary"]["actions"])


def test_no_ras_socket_is_recorded_as_no_evidence(tmp_path: Path) -> None:
    with RasStandIn() as s:
        addr = s.addr
    got = gather(tmp_path, RasConfig(enabled="on", addr=addr))
    (action,) = [a for a in got["summary"]["actions"] if a["action"] == "nccl_ras"]
    assert action["ok"] is False and action["detail"].startswith("no NCCL RAS evidence")
    assert got["summary"]["ras_culprit_ranks"] == []
