"""The job's own deadline, end to end: ``gpu-watchdog launch`` on a real 4-rank torchrun gloo DDP job
(tests/jobs/deadline_save.py) whose rank 0 writes its checkpoint steadily while ranks 1-3 wait in the all_gather
after it — the Open-R1 shape. Durations are the issue's scaled down together: the group timeout, the save and
``detect.waiting_timeout_s`` (600 s → 20 s), the save always longer than ``waiting_timeout_s``, so the old bound
would have stopped it.

- a save that ends before the group timeout (30 s of 45 s): never stopped, the job finishes; the deadline warning
  at half the deadline names rank 0, the all_gather, the client's 45 s and the remedy;
- a save that outlasts it (60 s, timeout 30 s): the warning comes long before the timeout, the job dies of its own
  timeout, and the crash incident points at the warning.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from launch_harness import LaunchRun, _safety, base_env, read_events, start_launch, torchrun, write_config

JOB = Path(__file__).resolve().parents[1] / "jobs" / "deadline_save.py"
NPROC = 4
SAVE_AT = 4


def _launch(tmp_path: Path, name: str, *, timeout_s: float, save_s: float) -> LaunchRun:
    config = write_config(tmp_path / "watchdog.toml", {"detect": {"waiting_timeout_s": 20.0}})
    job = _safety([torchrun(), "--standalone", "--nproc-per-node", str(NPROC), str(JOB), "--timeout-s",
                   str(timeout_s), "--save-at", str(SAVE_AT), "--steps", str(SAVE_AT + 3), "--save-s", str(save_s),
                   "--client", "--events", str(tmp_path / "events.jsonl"), "--workdir", str(tmp_path)], 240)
    return start_launch(["--backend", "proc", "--config", str(config)], job, env=base_env(), tmp_path=tmp_path,
                        job_id=f"t-{name}")


def _events(tmp_path: Path, event: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == event]


def _warning(incs: list[dict[str, Any]]) -> dict[str, Any]:
    (warning,) = [i for i in incs if i["kind"] == "deadline"]
    assert warning["culprit_ranks"] == [0] and not [a for a in warning["actions"] if a["action"] == "stop"]
    d = warning["deadline"]
    assert d["source"] == "client" and d["waited_on"] == [0] and d["waiting_ranks"] == [1, 2, 3]
    assert d["waiting_in"] == "all_gather", d
    assert any("async_save" in r for r in d["remedies"]), d["remedies"]
    assert "writing" in d["activity"]["0"] and "model.safetensors" in d["activity"]["0"], d["activity"]
    return warning


@pytest.mark.slow
def test_a_save_within_the_jobs_own_timeout_is_never_stopped(tmp_path: Path) -> None:
    run = _launch(tmp_path, "save-within", timeout_s=45.0, save_s=30.0)
    try:
        rc = run.wait(200)
        out = run.output()
        assert rc == 0, out[-5000:]
        incs = run.incidents()
        assert [i["kind"] for i in incs] == ["deadline"], [(i["kind"], i.get("finding")) for i in incs]
        warning = _warning(incs)
        (save_start,) = _events(tmp_path, "save_start")
        d = warning["deadline"]
        assert d["timeout_s"] == 45.0
        # at half the deadline (22.5 s into the wait), the wait began at most a few seconds before the save
        assert 45.0 * 0.5 <= warning["detected_at"] - d["waiting_since"] < 45.0 * 0.5 + 5.0
        assert abs(d["waiting_since"] - save_start["t"]) < 5.0
        assert sorted(e["rank"] for e in _events(tmp_path, "done")) == list(range(NPROC))
        assert "STALL" not in out and "restarting" not in out
    finally:
        run.kill()


@pytest.mark.slow
def test_a_save_past_the_jobs_own_timeout_is_warned_about_and_the_crash_points_at_it(tmp_path: Path) -> None:
    run = _launch(tmp_path, "save-past", timeout_s=30.0, save_s=60.0)
    try:
        rc = run.wait(200)
        out = run.output()
        assert rc == 1, out[-5000:]  # torchrun's code for a failed worker: the job's own timeout ended it
        incs = run.incidents()
        assert [i["kind"] for i in incs] == ["deadline", "rank_exited"], [(i["kind"], i.get("finding")) for i in incs]
        warning, crash = incs
        _warning(incs)
        timed_out = _events(tmp_path, "timed_out")
        assert timed_out and "Timed out" in timed_out[0]["error"]
        (save_start,) = _events(tmp_path, "save_start")  # ranks 1-3 enter the all_gather at once
        raised = min(e["t"] for e in timed_out)
        print(f"deadline margin: gloo raised {raised - save_start['t'] - 30.0:+.2f} s after the 30 s timeout, "
              f"launch recorded the crash {crash['detected_at'] - raised:.2f} s later; warning "
              f"{raised - warning['detected_at']:.1f} s before the timeout")
        # the warning came well before the job's timeout fired (the issue: >= 60 s of 300 s, scaled: 6 s of 30 s)
        assert min(e["t"] for e in timed_out) - warning["detected_at"] >= 30.0 * 0.2
        assert crash["deadline_warning"]["incident"] == warning["id"], crash
        # the waiters exited first (gloo raised in them): the crash names rank 0, whom they waited on, never them
        assert crash["culprit_ranks"] == [0], crash
        assert crash["own_timeout"]["waited_on"] == [0] and crash["own_timeout"]["timeout_s"] == 30.0, crash
        assert "hit the job's own 30 s collective timeout waiting" in crash["finding"], crash["finding"]
        assert "ran into the deadline incident" in out and "async_save" in out
        assert not [a for a in crash["actions"] if a["action"] == "stop" and "SIGTERM" in a.get("detail", "")]
    finally:
        run.kill()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
