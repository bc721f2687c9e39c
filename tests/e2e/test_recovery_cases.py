"""Recovery of real hangs that are not a sleeping rank: a stopped rank, a data-wait hang that recurs (plain
restarts, no NCCL change), a collective hang inside a rank's worker process.

Each test runs ``gpu-watchdog launch`` on a real 4-rank torchrun gloo job (tests/jobs/train.py) with the shipped
detection defaults; only the stop ladder is shortened where the test does not measure it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from launch_harness import LaunchRun, base_env, read_events, start_launch, train_argv, write_config

NPROC = 4


def _launch(tmp_path: Path, name: str, scenario: str, *extra: str, config: dict[str, dict[str, Any]] | None = None,
            steps: int = 12, step_at: int = 4) -> LaunchRun:
    args = []
    if config:
        args = ["--config", str(write_config(tmp_path / "watchdog.toml", config))]
    job = train_argv(tmp_path / "events.jsonl", tmp_path, nproc=NPROC, scenario=scenario, rank_at=2,
                     step_at=step_at, step_s=0.2, steps=steps, extra=extra)
    return start_launch(["--backend", "proc", *args], job, env=base_env(), tmp_path=tmp_path, job_id=f"t-{name}")


def _onsets(tmp_path: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "hang_onset"]


@pytest.mark.slow
def test_a_stopped_rank_is_named_from_its_state_and_the_job_restarts(tmp_path: Path) -> None:
    """SIGSTOP on rank 2 (a debugger, job control): culprit from process state, no py-spy wait on it, SIGCONT
    before SIGTERM so the stop ladder does not wait out its grace, restart; the rerun does not stop itself."""
    run = _launch(tmp_path, "stopped", "stop", "--cured-by", "GPU_WATCHDOG_RESTART_COUNT=1",
                  config={"recovery": {"max_restarts": 1}})
    try:
        rc = run.wait(180)
        out = run.output()
        assert rc == 0, out[-5000:]
        (inc,) = run.incidents()
        assert inc["culprit_ranks"] == [2], inc
        assert "rank 2 is stopped (SIGSTOP" in inc["reason"]
        dump = next(a for a in inc["actions"] if a["action"] == "dump_stacks")
        assert "rank 2: process" in dump["detail"] and "is stopped" in dump["detail"]
        stop = next(a for a in inc["actions"] if a["action"] == "stop")
        assert stop["ok"] and "needed SIGKILL" in stop["detail"] and not stop["detail"].startswith("0 exited")
        assert inc["fallback"]["level"] == 0 and inc["fallback"]["reason"].startswith("advice only: stopped")
        (onset,) = _onsets(tmp_path)
        assert inc["detected_at"] - onset["t"] <= 10.0, inc
        restart = next(a for a in inc["actions"] if a["action"] == "restart")
        # the whole recovery (dump, stop, restart) takes seconds, not the 30 s stop grace
        assert restart["at"] - inc["detected_at"] < 15.0, inc["actions"]
    finally:
        run.kill()


@pytest.mark.slow
def test_a_data_wait_hang_that_recurs_gets_plain_restarts_never_an_nccl_change(tmp_path: Path) -> None:
    """The rank's main thread waits forever on a queue whose producer died, in every run. Its peers wait in
    all_reduce (communication evidence: acted on within seconds), but the hang is the culprit's own code: plain
    restarts with advice, never a fallback level, until the budget (max_restarts = 1) is spent."""
    run = _launch(tmp_path, "data-wait", "queue", config={"recovery": {"max_restarts": 1, "stop_grace_s": 5.0}})
    try:
        rc = run.wait(240)
        out = run.output()
        assert rc == 75, out[-5000:]
        first, second = run.incidents()
        for inc in (first, second):
            assert inc["culprit_ranks"] == [2] and "data_wait at Queue.get" in inc["reason"]
            assert "all_reduce" in (inc["action_evidence"] or "")
        assert first["fallback"]["level"] == 0 and first["fallback"]["env"] == {}
        assert first["fallback"]["reason"].startswith("advice only: data wait")
        assert "dataloader" in first["advice"]
        assert [a["action"] for a in second["actions"]][-1] == "give_up"
        assert "NCCL_P2P_DISABLE" not in out
        assert len(_onsets(tmp_path)) == 2
    finally:
        run.kill()


@pytest.mark.slow
def test_a_collective_hang_inside_a_worker_process_names_the_worker(tmp_path: Path) -> None:
    """Rank 2 hands its step to worker processes and waits on a result queue; one worker is blocked in an
    all_reduce. The incident names the worker's pid and collective, and the ladder applies (level 1)."""
    run = _launch(tmp_path, "worker", "worker", config={"recovery": {"max_restarts": 0, "stop_grace_s": 5.0}})
    try:
        rc = run.wait(180)
        out = run.output()
        assert rc == 75, out[-5000:]  # max_restarts = 0: record, stop, give up
        (inc,) = run.incidents()
        (onset,) = _onsets(tmp_path)
        blocked_pid = onset["worker_pids"][0]
        assert inc["culprit_ranks"] == [2]
        assert inc["workers"][0]["pid"] == blocked_pid and inc["workers"][0]["op"] == "all_reduce", inc
        assert f"rank 2 waits on its worker pid {blocked_pid}, blocked in all_reduce" in inc["reason"]
        assert inc["fallback"] is None or inc["fallback"]["level"] == 0  # gave up before deciding a restart
        workers_dir = Path(inc["stacks_dir"]) / "workers"
        assert (workers_dir / f"rank-2-pid-{blocked_pid}.json").exists()
        assert f"worker pid {blocked_pid}" in out
    finally:
        run.kill()


@pytest.mark.slow
def test_a_worker_hang_gets_the_fallback_ladder(tmp_path: Path) -> None:
    """Same hang, cured by NCCL_P2P_DISABLE=1: the first restart already climbs (the worker sits in a collective),
    and the job finishes."""
    run = _launch(tmp_path, "worker-ladder", "worker", "--cured-by", "NCCL_P2P_DISABLE=1",
                  config={"recovery": {"stop_grace_s": 5.0}})
    try:
        t0 = time.monotonic()
        rc = run.wait(240)
        assert rc == 0, run.output()[-5000:]
        (inc,) = run.incidents()
        assert inc["fallback"]["level"] == 1 and inc["fallback"]["reason"].startswith("climbed: communication hang")
        print(f"worker hang recovered in {time.monotonic() - t0:.1f}s")
    finally:
        run.kill()


@pytest.mark.slow
@pytest.mark.parametrize("restart_on_crash", [False, True])
def test_a_rank_that_exits_is_an_incident_and_restarts_only_when_asked(tmp_path: Path, restart_on_crash: bool) -> None:
    """Rank 2 exits with code 3; torchrun tears the job down. Always a rank_exited incident; with
    recovery.restart_on_crash the job is restarted (the rerun is healthy) and finishes, else launch exits with
    the launched command's code."""
    run = _launch(tmp_path, "exit", "exit", "--cured-by", "GPU_WATCHDOG_RESTART_COUNT=1", step_at=2,
                  config={"recovery": {"restart_on_crash": restart_on_crash}})
    try:
        rc = run.wait(180)
        out = run.output()
        (inc,) = run.incidents()
        assert inc["kind"] == "rank_exited" and inc["signature"] == "rank_exited", inc
        assert inc["ranks"] == list(range(NPROC))
        assert "the launched command exited 1" in inc["finding"]
        assert "RANK EXITED" in out
        if inc["culprit_ranks"]:  # seen only when a tick fell between the exit and torchrun's teardown
            assert inc["culprit_ranks"] == [2] and "exit code 3" in inc["exits"]["2"]
        restart = [a for a in inc["actions"] if a["action"] == "restart"]
        if restart_on_crash:
            assert rc == 0, out[-4000:]
            assert restart and restart[0]["ok"]
            assert sorted(e["rank"] for e in read_events(tmp_path / "events.jsonl")
                          if e["event"] == "done") == list(range(NPROC))
        else:
            assert rc == 1, out[-4000:]  # torchrun's own code for a failed worker
            assert restart and not restart[0]["ok"] and "restart_on_crash is false" in restart[0]["detail"]
            assert restart[0]["outcome"] == "skipped" and restart[0]["detail"].startswith("skipped: ")
    finally:
        run.kill()


@pytest.mark.slow
@pytest.mark.parametrize("proof", ["peers_exited_0", "client_done"])
def test_a_job_that_finished_its_work_and_died_at_teardown_is_never_restarted(tmp_path: Path, proof: str) -> None:
    """Every step done and the group destroyed, rank 2 dies by SIGABRT (PyTorch's teardown abort), with
    recovery.restart_on_crash on. peers_exited_0: its peers exited 0 first. client_done: it died first (torchrun
    then SIGTERMs the lingering peers) but the in-job client saw every rank's training loop end. Either way: a
    rank_exited incident that says the work was finished, no restart, launch exits with torchrun's code.
    peers_exited_0 aborts only once its peers' processes ended: with a fixed pause, a loaded host held a peer's
    interpreter exit past it, torchrun SIGTERMed the peers and nothing showed the work done (rightly restarted)."""
    timing = (["--after-peers", "--pause-s", "0.5"] if proof == "peers_exited_0"
              else ["--client", "--pause-s", "0", "--linger-s", "5"])
    run = _launch(tmp_path, f"teardown-{proof}", "abort_at_exit", *timing, steps=4, step_at=99,
                  config={"recovery": {"restart_on_crash": True}})
    try:
        rc = run.wait(180)
        out = run.output()
        assert rc == 1, out[-4000:]  # torchrun's own code for a failed worker
        incs = run.incidents()
        assert len(incs) == 1, [(i["kind"], i.get("reason")) for i in incs]
        (inc,) = incs
        assert inc["kind"] == "rank_exited" and inc["culprit_ranks"] == [2], inc
        assert "SIGABRT" in inc["exits"]["2"], inc["exits"]
        assert "a death at teardown" in inc["finished_work"], inc
        assert ("rank 0, rank 1, rank 3 exited 0" if proof == "peers_exited_0" else "rank 2 had ended its training "
                "loop (last step 4)") in inc["finished_work"]
        (restart,) = [a for a in inc["actions"] if a["action"] == "restart"]
        assert restart["outcome"] == "skipped" and "finished its work" in restart["detail"], restart
        assert "not restarting: the job had finished its work" in out
        starts = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "start"]
        assert len(starts) == NPROC  # one run only
    finally:
        run.kill()


@pytest.mark.slow
def test_a_rank_that_aborts_mid_training_is_restarted_when_asked(tmp_path: Path) -> None:
    """The healthy counterpart of the teardown death: the same SIGABRT at step 2 of 6 is a crash, restarted."""
    run = _launch(tmp_path, "abort", "abort", "--cured-by", "GPU_WATCHDOG_RESTART_COUNT=1", steps=6, step_at=2,
                  config={"recovery": {"restart_on_crash": True}})
    try:
        rc = run.wait(180)
        out = run.output()
        assert rc == 0, out[-4000:]
        (inc,) = run.incidents()
        assert inc["kind"] == "rank_exited" and "finished_work" not in inc, inc
        restart = [a for a in inc["actions"] if a["action"] == "restart"]
        assert restart and restart[0]["ok"], inc["actions"]
        assert sorted(e["rank"] for e in read_events(tmp_path / "events.jsonl")
                      if e["event"] == "done") == list(range(NPROC))
    finally:
        run.kill()
