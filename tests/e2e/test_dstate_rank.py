"""A rank in uninterruptible sleep (state D), as on a hard-mounted NFS server that went away.

The rank really sits in D: tests/jobs/dsleep.c makes it a vfork() parent waiting for its child, the kernel's
TASK_KILLABLE wait that NFS uses too. A D rank is waiting on storage, which ends on its own (a slow checkpoint
save), so the job is "waiting on" it and not stalled; only ``detect.waiting_timeout_s`` turns that into a stall.
Then the rank is named with its state, no NCCL fallback is tried (I/O is never a communication fault), and the
stop ladder ends it (a fatal signal wakes a killable D wait).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_harness import LaunchRun, base_env, read_events, start_launch, train_argv, write_config

NPROC = 2


def _launch(tmp_path: Path, name: str, pause_s: float, waiting_timeout_s: float) -> LaunchRun:
    # deadline_still_max_s scaled with the dump interval: the stuck rank's CPU and I/O are still from its onset, so
    # after 4 s its peers' wait in all_reduce is no longer given the job's own deadline (nothing visibly moves)
    config = {"detect": {"waiting_timeout_s": waiting_timeout_s, "waiting_stack_interval_s": 2.0,
                         "deadline_still_max_s": 4.0},
              "recovery": {"stop_grace_s": 5.0}}
    job = train_argv(tmp_path / "events.jsonl", tmp_path, nproc=NPROC, scenario="dsleep", rank_at=1, step_at=3,
                     step_s=0.2, steps=6, extra=("--pause-s", str(pause_s),
                                                 "--cured-by", "GPU_WATCHDOG_RESTART_COUNT=1"))
    args = ["--backend", "proc", "--config", str(write_config(tmp_path / "watchdog.toml", config))]
    return start_launch(args, job, env=base_env(), tmp_path=tmp_path, job_id=f"t-{name}")


@pytest.mark.slow
def test_a_rank_briefly_in_uninterruptible_sleep_is_waited_for(tmp_path: Path) -> None:
    """Healthy counterpart: 8 s in D (a slow NFS write) with a 30 s waiting timeout is no stall."""
    run = _launch(tmp_path, "dstate-brief", pause_s=8, waiting_timeout_s=30.0)
    try:
        rc = run.wait(150)
        out = run.output()
        assert rc == 0, out[-5000:]
        assert run.incidents() == [] and "STALL" not in out, out[-5000:]
        events = read_events(tmp_path / "events.jsonl")
        assert [e["rank"] for e in events if e["event"] == "pause_end"] == [1]  # it really sat there the 8 s
        assert sorted(e["rank"] for e in events if e["event"] == "done") == list(range(NPROC))
    finally:
        run.kill()


@pytest.mark.slow
def test_a_rank_stuck_in_uninterruptible_sleep_is_a_stall_after_the_waiting_timeout(tmp_path: Path) -> None:
    run = _launch(tmp_path, "dstate-stuck", pause_s=600, waiting_timeout_s=8.0)
    try:
        rc = run.wait(180)
        out = run.output()
        assert rc == 0, out[-5000:]
        assert "gpu_watchdog/" not in out, out[-5000:]  # no traceback of ours
        (inc,) = run.incidents()
        (onset,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "hang_onset"]
        waited = inc["detected_at"] - onset["t"]
        # Not before the waiting timeout (D is I/O until then). The wait counts from when the job went quiet,
        # which on a loaded box can precede the onset event by a slow step (measured 7.97 s once).
        assert 8.0 - 2.5 <= waited <= 30.0, inc
        assert inc["culprit_ranks"] == [1], inc
        assert "io" in inc["reason"], inc["reason"]
        assert inc["fallback"]["level"] == 0, inc["fallback"]  # I/O is not a communication fault: no NCCL change
        stop = next(a for a in inc["actions"] if a["action"] == "stop")
        assert stop["ok"] and "still alive" not in stop["detail"], stop
        events = read_events(tmp_path / "events.jsonl")
        assert sorted(e["rank"] for e in events if e["event"] == "done") == list(range(NPROC))
    finally:
        run.kill()
