"""The incident's JSON contract (docs/json-contract.md), byte for byte: scripted recoveries — a restart on process
evidence, a stall held as waiting, a give-up, and real rank processes whose Flight Recorder names the culprit
(stacks, the Flight Recorder source, the merge) — must write exactly the summaries in tests/data/contract/, times,
ids, pids and temporary paths aside. The stored summaries were written by the release before the evidence
sources, the typed records and the recovery's outcome were restructured (b19b453): a refactoring that changes a
byte fails here. A deliberate change of the contract rewrites them (``GW_WRITE_CONTRACT=1``) and says so in
docs/json-contract.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.act.recovery import Recovery
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.schema import Config, RecoveryConfig, StacksConfig
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import Finding, JobStatus, NodeSample
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import Incident, IncidentStore

DATA = Path(__file__).resolve().parents[2] / "data"
CONTRACT = DATA / "contract"
TIMES = {"at", "done_at", "onset", "detected_at", "finished_at", "confirmed_at", "created_at", "t", "since",
         "acted_at", "due_at", "started_at", "saved_s", "gpu_seconds"}  # the deadline section: times and their spans


class _Target:
    """A job whose processes are gone by the time it is stopped; its restart always succeeds."""

    may_signal_checkpoint = False

    def __init__(self, tmp: Path) -> None:
        self.job_id, self.control = "job-7", ControlDir(tmp / "control")
        self.control.create()

    def processes(self) -> list[Any]:
        return []

    def poll(self) -> int | None:
        return 0

    def restart(self, inc: Incident, level: int, shown: str) -> bool:
        inc.record_action("restart", True, shown)
        return True


def _normalized(obj: Any, tmp: str) -> Any:
    if isinstance(obj, dict):
        return {k: 0 if k in TIMES and isinstance(v, (int, float)) else _normalized(v, tmp) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_normalized(v, tmp) for v in obj]
    return obj.replace(tmp, "<tmp>") if isinstance(obj, str) else obj


def _summary(tmp: Path, name: str, finding: Finding, status: JobStatus | None = None, *, stacks: bool = False,
             max_restarts: int = 3) -> str:
    cfg = replace(Config(), stacks=StacksConfig(enabled=stacks),
                  recovery=RecoveryConfig(max_restarts=max_restarts, restart_backoff_s=0.0))
    d = tmp / name
    ctx = ActContext(cfg, "node1", IncidentStore(d), FallbackStore(d))
    sample = NodeSample(t=time.time(), hostname="node1", backend="proc", devices=(), processes=(), errors=())
    result = Recovery(ctx, RestartBudget(cfg.recovery)).handle(finding, _Target(d), sample, status)
    result.incident.finish("finished by the test")
    summary = json.loads((result.incident.dir / "summary.json").read_text())
    summary["id"] = "<id>"
    text = json.dumps(_normalized(summary, str(tmp)), indent=1, sort_keys=True)
    text = re.sub(r"\bat \d\d:\d\d:\d\d\b", "at <hh:mm:ss>", text)  # a deadline's wall-clock time
    return text.replace(result.incident.id, "<id>") + "\n"


def _check(name: str, text: str) -> None:
    path = CONTRACT / f"{name}.json"
    if os.environ.get("GW_WRITE_CONTRACT") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"the incident summary of {name!r} changed: see docs/json-contract.md"


def _exited(now: float) -> Finding:
    return Finding("stall", "rank_exited", "job-7", (0, 1, 2, 3), (3,), now - 5, now, (), "rank 3 exited", "process")


def test_a_restart_on_process_evidence(tmp_path: Path) -> None:
    _check("restart", _summary(tmp_path, "restart", _exited(time.time())))


def test_a_stall_without_proof_held_as_waiting(tmp_path: Path) -> None:
    now = time.time()
    idle = Finding("stall", "idle_held", "job-7", (0, 1), (), now - 40, now, (), "no progress for 40s", "stacks")
    _check("hold", _summary(tmp_path, "hold", idle))


def test_a_give_up_when_the_budget_is_spent(tmp_path: Path) -> None:
    _check("give_up", _summary(tmp_path, "give_up", _exited(time.time()), max_restarts=0))


@pytest.mark.parametrize("case", ["missing", "mismatch"])
def test_real_ranks_whose_flight_recorder_names_the_culprit(tmp_path: Path, case: str) -> None:
    """Four real processes asleep (their stacks all alike) that record a Flight Recorder into a directory holding
    the stored dumps of tests/data/fr/<case>: the stacks, the Flight Recorder source and the merge all write."""
    fr = tmp_path / f"fr-{case}"
    fr.mkdir()
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000", TORCH_FR_DUMP_TEMP_FILE=str(fr / "nccl_trace_rank_"))
    procs = [subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(60)\n"], env=env) for _ in range(4)]
    try:
        time.sleep(1.0)  # the dumps must be newer than the ranks (older ones are an earlier run's)
        for r in range(4):
            shutil.copy(DATA / "fr" / case / f"trace_{r}", fr / f"nccl_trace_rank_{r}")
        pids = {r: p.pid for r, p in enumerate(procs)}
        now = time.time()
        finding = Finding("stall", "idle_held", "job-7", (0, 1, 2, 3), (), now - 40, now, (), "no progress", "stacks")
        text = _summary(tmp_path, f"fr-{case}", finding, JobStatus("job-7", ranks=(0, 1, 2, 3), rank_pids=pids),
                        stacks=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r, pid in pids.items():
        text = text.replace(f"pid {pid}", f"pid <{r}>").replace(f'"pid": {pid}', f'"pid": "<{r}>"')
    text = re.sub(r"dumped in [0-9.]+s", "dumped in <t>s", text)
    _check(f"fr-{case}", text)
