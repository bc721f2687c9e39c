"""Live: `gpu-watchdog record --backend proc` beside a real 4-rank gloo job, then `gpu-watchdog replay --json`.

A hang (rank 1 stops joining all_reduce) is reported as exactly one stall whose onset is within two sampling
intervals of the job's own ``hang_onset`` event; a checkpoint save longer than the confirmation time is not
reported at all. The job carries a unique GPU_WATCHDOG_JOB_ID: `record` samples every rank process on the
node, and other jobs running on the same machine must not disturb the assertions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_watchdog.detect.detector import CLOCK_SLACK_S
from repo_paths import REPO

ROOT = REPO
TRAIN = ROOT / "tests" / "jobs" / "train.py"
BIN = Path(sys.executable).parent
RECORD_S = 20
CONFIRM_S = 8.0

pytestmark = pytest.mark.slow


class Job:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.job_id = f"e2e-{uuid.uuid4().hex[:8]}"
        self.events = tmp / "events.jsonl"
        self.log = (tmp / "job.log").open("wb")
        env = {**os.environ, "GPU_WATCHDOG_JOB_ID": self.job_id, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", str(TRAIN), *args,
             "--events", str(self.events), "--workdir", str(tmp)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def read_events(self) -> list[dict]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line.endswith("}")]

    def wait_started(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len([e for e in self.read_events() if e["event"] == "start"]) == 4:
                return
            assert self.proc.poll() is None, "the job exited early"
            time.sleep(0.2)
        raise AssertionError("the job's 4 ranks did not start")

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
        try:  # stragglers left in the group after torchrun exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[list[Job]]:
    jobs: list[Job] = []
    try:
        yield jobs
    finally:
        for j in jobs:
            j.stop()


def record_beside(tmp_path: Path, job: Job) -> list[dict]:
    """Record RECORD_S seconds with the real console script, then replay with confirm_after_s = 8."""
    trace = tmp_path / "t.trace"
    rec = subprocess.Popen([str(BIN / "gpu-watchdog"), "record", "--backend", "proc", "--duration", str(RECORD_S),
                            "--output", str(trace)], stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _out, err = rec.communicate(timeout=RECORD_S + 60)
    finally:
        if rec.poll() is None:
            os.killpg(rec.pid, signal.SIGKILL)
            rec.wait()
    assert rec.returncode == 0, err
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[detect]\nconfirm_after_s = {CONFIRM_S}\n")
    r = subprocess.run([str(BIN / "gpu-watchdog"), "replay", "--config", str(cfg), str(trace), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [f for f in json.loads(r.stdout) if f["job"] == job.job_id]


def test_live_hang_is_one_stall_with_the_true_onset(tmp_path: Path, job_factory: list[Job]) -> None:
    job = Job(tmp_path, "--scenario", "hang", "--rank-at", "1", "--step-at", "12", "--steps", "400")
    job_factory.append(job)
    job.wait_started()
    findings = record_beside(tmp_path, job)
    onset = [e["t"] for e in job.read_events() if e["event"] == "hang_onset"]
    assert len(onset) == 1, "the job did not hang during the recording"
    assert [(f["kind"], f["signature"]) for f in findings] == [("stall", "idle_held")], findings
    f = findings[0]
    # The onset is the last tick that saw progress: the tick after the hang when the ranks still computed in
    # that window (a rank finishing its step), so up to one interval plus the ranks' wind-down after it.
    assert abs(f["onset"] - onset[0]) <= 2.0, (f["onset"], onset[0])
    assert f["ranks"] == [0, 1, 2, 3]
    # Confirmed by time (no stacks in a trace): the first tick at least CONFIRM_S after the onset, give or
    # take the detector's allowance for clock jitter.
    assert CONFIRM_S - CLOCK_SLACK_S <= f["confirmed_at"] - f["onset"] <= CONFIRM_S + 1.5


def test_live_checkpoint_save_is_no_finding(tmp_path: Path, job_factory: list[Job]) -> None:
    # rank 0 writes for 15 s (longer than the 8 s confirmation) while ranks 1-3 wait in barrier()
    job = Job(tmp_path, "--scenario", "save", "--step-at", "5", "--pause-s", "15", "--steps", "400")
    job_factory.append(job)
    job.wait_started()
    findings = record_beside(tmp_path, job)
    events = job.read_events()
    start = [e["t"] for e in events if e["event"] == "hang_onset"]
    end = [e["t"] for e in events if e["event"] == "pause_end"]
    assert start and end and end[0] - start[0] >= 14.0, "the save did not happen during the recording"
    assert findings == []
