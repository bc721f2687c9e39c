"""The in-job client's callback contract (README "The in-job client"): called with an int or not at all, in the
thread that saves; per-rank outcomes decide the checkpoint action's outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from gpu_watchdog.act.checkpoint import client_outcome, request_checkpoint
from gpu_watchdog.config.schema import RecoveryConfig
from gpu_watchdog.job import Client
from gpu_watchdog.job.protocol import EXIT_ABORTED, EXIT_CHECKPOINTED, ControlDir

# A rank that hangs before its first client.step() (a hang that came back after a restart): the abort path.
# The process-group abort is stubbed out: this is about the client's contract, not torch's.
HANG_BEFORE_FIRST_STEP = textwrap.dedent("""\
    import json, sys, time
    from gpu_watchdog.job import Client

    ctl, out = sys.argv[1], sys.argv[2]
    client = Client(ctl, rank=0, poll_s=0.02)
    client._abort_process_group = lambda: None
    client.on_checkpoint(lambda step: open(out, "w").write(json.dumps({"step": step})))
    with client.training():
        open(out + ".ready", "w").close()
        time.sleep(60)  # hung before client.step(): no step completed in this run
""")


def test_a_hang_before_the_first_step_skips_the_callback_and_says_so(tmp_path: Path) -> None:
    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    out = tmp_path / "ckpt.json"
    script = tmp_path / "job.py"
    script.write_text(HANG_BEFORE_FIRST_STEP)
    proc = subprocess.Popen([sys.executable, str(script), str(ctl.path), str(out)])
    try:
        for _ in range(200):
            if Path(f"{out}.ready").exists() and ctl.clients():
                break
            proc.poll()
            assert proc.returncode is None
            time.sleep(0.05)
        ctl.request_checkpoint("inc-early", 0.2, grace_s=1.0)
        assert proc.wait(20) == EXIT_ABORTED
    finally:
        proc.kill()
    assert not out.exists()  # the callback never ran: nothing (least of all None) over the good checkpoint
    ack = ctl.acks("inc-early")[0]
    assert ack["outcome"] == "skipped" and ack["step"] is None
    assert "no step completed in this run" in ack["detail"]


def test_a_callback_that_raises_is_acknowledged_failed(tmp_path: Path) -> None:
    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    c = Client(ctl.path, rank=0, poll_s=0.02)

    def save(step: int) -> None:
        raise ValueError("Default process group has not been initialized")

    c.on_checkpoint(save)
    c.step(1)
    ctl.request_checkpoint("inc-fail", 5.0, grace_s=0.2)
    for _ in range(100):
        if c.checkpoint_requested:
            break
        time.sleep(0.02)
    with pytest.raises(SystemExit) as exit_info:
        with c.training():
            c.step(2)
    c.close()
    assert exit_info.value.code == EXIT_CHECKPOINTED
    ack = ctl.acks("inc-fail")[0]
    assert ack["outcome"] == "failed" and ack["step"] == 2 and "ValueError" in ack["detail"]


@pytest.mark.parametrize("outcomes, expected", [
    ({0: "failed", 1: "saved", 2: "saved"}, "failed"),  # rank 0 writes; the others' no-op "saved" must not hide it
    ({0: "aborted_saved", 1: "skipped"}, "ok"),
    ({0: "skipped", 1: "skipped"}, "skipped"),
    ({}, "failed"),
])
def test_per_rank_outcomes_decide_the_action(outcomes: dict[int, str], expected: str) -> None:
    assert client_outcome({r: {"outcome": o} for r, o in outcomes.items()}) == expected


def test_request_checkpoint_reports_a_failed_rank_as_failed(tmp_path: Path) -> None:
    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    for r in (0, 1):
        (ctl.path / f"client-{r}.json").write_text(json.dumps({"pid": os.getpid(), "rank": r, "t": 0}))

    def answer() -> bool:  # the ranks answer as soon as the request is there
        req = json.loads((ctl.path / "request.json").read_text())
        (ctl.path / "ack-0.json").write_text(json.dumps({"id": req["id"], "rank": 0, "outcome": "failed", "step": 7,
                                                         "detail": "OSError: disk full"}))
        (ctl.path / "ack-1.json").write_text(json.dumps({"id": req["id"], "rank": 1, "outcome": "saved", "step": 7}))
        return True

    res = request_checkpoint(ctl, "inc-x", RecoveryConfig(), timeout_s=2.0, running=answer)
    assert (res.ok, res.outcome) == (False, "failed")
    assert "rank 0: failed at step 7 (OSError: disk full)" in res.detail and "rank 1: saved at step 7" in res.detail


def test_a_control_dir_that_is_not_on_this_node_never_fails_the_job(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """srun copies the batch shell's GPU_WATCHDOG_CONTROL_DIR (the batch host's node-local directory) into every
    node's tasks; on a node where the task was not registered it does not exist. The client is off, the training
    loop runs; a control dir that vanishes mid-run turns the client off too."""
    monkeypatch.setenv("GPU_WATCHDOG_CONTROL_DIR", str(tmp_path / "other-node" / "run-0"))
    monkeypatch.setenv("RANK", "3")
    client = Client.from_env()
    assert not client.enabled
    client.on_checkpoint(lambda step: None)
    with client.training():
        client.step(1)
    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    live = Client(ctl.path, rank=0)
    live.step(1)
    assert (ctl.path / "step-0").read_text() == "1"
    for f in ctl.path.iterdir():
        f.unlink()
    ctl.path.rmdir()
    live.step(2)  # the agent's node-local state was removed: no FileNotFoundError in the training step
    assert not live.enabled


def test_a_training_loop_that_ends_marks_the_rank_done_and_one_that_raises_does_not(tmp_path: Path) -> None:
    """done-<rank>.json: the agent's proof that a rank dying afterwards died at teardown (never restarted)."""
    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    finished = Client(ctl.path, rank=0)
    with finished.training():
        finished.step(7)
    crashed = Client(ctl.path, rank=1)
    with pytest.raises(ValueError), crashed.training():
        crashed.step(3)
        raise ValueError("a bad batch")
    done = ctl.finished()
    assert list(done) == [0] and done[0]["step"] == 7 and done[0]["pid"] == os.getpid()
    ctl.create()  # the next run starts without the last run's marks
    assert ctl.finished() == {}
