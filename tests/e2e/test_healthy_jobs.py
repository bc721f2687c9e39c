"""Healthy jobs that look like hangs to a naive detector run clean, under ``launch`` and under the daemon, on the
shipped detection defaults — and real libraries, as users run them.

A false action is the worst bug. Each job here once got (or would get) a false stall:
- a loop that spends most of each step at one line (``tests/jobs/sleepy.py``: 0.2 s sleep + one all_reduce) shows
  the same frame in every stack dump while it progresses; its main thread keeps blocking and waking, a rank
  blocked for good does not;
- a checkpoint write crawling at ~128 KiB/s inside one write(2) (``tests/jobs/slow_save.py``, a FIFO drained
  slowly: a saturated NFS mount) moves no byte counter and no Python frame for a minute;
- an HF Trainer run with evaluation, checkpoint saves and dataloader workers (``tests/jobs/hf_trainer.py``).
The FSDP2 + ``generate()`` hang with per-rank decode lengths must be reported as a desync, not an NCCL problem.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import DaemonProc, short_dir, wait_for
from daemon_helpers import write_config as daemon_config
from launch_harness import REPO, LaunchRun, base_env, read_events, start_launch, torchrun, write_config

JOBS = REPO / "tests" / "jobs"


def _job(script: str, nproc: int, *args: str) -> list[str]:
    return [torchrun(), "--standalone", "--nproc-per-node", str(nproc), str(JOBS / script), *args]


@contextlib.contextmanager
def cpu_load(n: int = 2) -> Iterator[None]:
    """``n`` CPU-bound processes for the duration (the issue's "load 1.6–4.7 on 2 cores")."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


def _run_clean(run: LaunchRun, timeout: float, events: Path, nproc: int) -> str:
    """Wait for the launch to finish; assert exit 0, no incident, no action, every rank done."""
    try:
        rc = run.wait(timeout)
        out = run.output()
    finally:
        run.kill()
    assert rc == 0, out[-4000:]
    assert run.incidents() == [], out[-4000:]
    assert "STALL" not in out and "stopped the job" not in out and "restarting" not in out
    assert sorted(e["rank"] for e in read_events(events) if e["event"] == "done") == list(range(nproc))
    return out


@pytest.mark.slow
def test_a_low_cpu_loop_that_sleeps_at_one_line_runs_clean_under_launch(tmp_path: Path) -> None:
    """3 ranks, 0.2 s sleep + one all_reduce per step, 60 steps, no in-job client, shipped defaults, two CPU
    burners beside it: no incident, no stop, exit 0."""
    events = tmp_path / "events.jsonl"
    with cpu_load():
        run = start_launch(["--backend", "proc"], _job("sleepy.py", 3, "--events", str(events)), env=base_env(),
                           tmp_path=tmp_path, job_id="t-sleepy")
        _run_clean(run, 240, events, 3)


@pytest.mark.slow
def test_a_low_cpu_loop_that_sleeps_at_one_line_runs_clean_under_the_daemon() -> None:
    """The same job registered with the daemon (whose recovery would stop it): no incident, the job finishes."""
    base = short_dir()
    d = DaemonProc(base, daemon_config(base))
    events = base / "events.jsonl"
    job = None
    try:
        with cpu_load():
            d.wait_socket()
            job = subprocess.Popen(_job("sleepy.py", 3, "--events", str(events)), env=base_env(), cwd=base,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            wait_for(lambda: len([e for e in read_events(events) if e["event"] == "start"]) == 3, 60, "ranks up")
            out = subprocess.run([str(Path(sys.executable).parent / "gpu-watchdog"), "hook", "job-start",
                                  "--socket", d.socket, "--job-id", "sleepy-1", "--pid", str(job.pid),
                                  "--restart-hook", "requeue"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            assert job.wait(timeout=180) == 0
        assert sorted(e["rank"] for e in read_events(events) if e["event"] == "done") == [0, 1, 2]
        # The daemon watches the whole host (other tests' jobs too): this job's incidents only.
        own = [r for r in d.call("incidents")["incidents"] if r.get("job_id") == "sleepy-1"]
        assert own == [], d.log_text()[-3000:]
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        d.kill()


@pytest.mark.slow
@pytest.mark.parametrize("stacks", [True, False], ids=["defaults", "no-stacks"])
def test_a_checkpoint_write_crawling_inside_write2_finishes_untouched(tmp_path: Path, stacks: bool) -> None:
    """Rank 0 sits ~60 s in ONE write(2) at ~128 KiB/s while its peers wait in barrier(): no byte counter moves
    (wchar counts only when write returns) and the stack never changes. Shipped defaults: its stack is in a save
    frame (io: being waited on). Without stacks (py-spy missing or denied): the kernel shows the main thread in a
    pipe/file-system write. Either way slow is not stuck: exit 0, no incident."""
    events = tmp_path / "events.jsonl"
    save_s = 60 if stacks else 40  # without stacks a stall would be confirmed by time at 30 s
    argv = _job("slow_save.py", 3, "--workdir", str(tmp_path), "--events", str(events), "--save-s", str(save_s),
                "--rate-kib", "128")
    args = ["--backend", "proc"]
    if not stacks:
        args += ["--config", str(write_config(tmp_path / "watchdog.toml", {"stacks": {"enabled": False}}))]
    run = start_launch(args, argv, env=base_env(), tmp_path=tmp_path, job_id="t-slow-save")
    _run_clean(run, 240, events, 3)
    (start,) = [e for e in read_events(events) if e["event"] == "pause_start"]
    (end,) = [e for e in read_events(events) if e["event"] == "pause_end"]
    assert end["t"] - start["t"] >= save_s - 10  # the save really crawled, under the watchdog
    assert end["writes"] == 1  # in one write(2): the watchdog's dumps (nonblocking) never interrupted it


@pytest.mark.slow
def test_an_hf_trainer_run_with_eval_saves_and_dataloader_workers_raises_nothing(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    argv = _job("hf_trainer.py", 3, "--output-dir", str(tmp_path / "out"), "--events", str(events))
    run = start_launch(["--backend", "proc"], argv, env=base_env(), tmp_path=tmp_path, job_id="t-hf-trainer")
    _run_clean(run, 300, events, 3)
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))  # it saved, under the watchdog


@pytest.mark.slow
def test_fsdp2_generate_with_per_rank_decode_lengths_is_reported_as_a_desync(tmp_path: Path) -> None:
    """FSDP2 (fully_shard) + transformers generate(synced_gpus=False), rank r decodes 4+4r tokens: rank 0 reaches
    barrier() while ranks 1,2 block in FSDP's all_gather_single. The incident is a desync naming both, with the
    usual cause, and no NCCL advice (max_restarts = 0: one incident, then exit 75)."""
    events = tmp_path / "events.jsonl"
    cfg = write_config(tmp_path / "watchdog.toml", {"recovery": {"max_restarts": 0, "stop_grace_s": 5.0}})
    run = start_launch(["--backend", "proc", "--config", str(cfg)],
                       _job("fsdp_generate.py", 3, "--events", str(events)), env=base_env(), tmp_path=tmp_path,
                       job_id="t-fsdp")
    try:
        rc = run.wait(240)
        out = run.output()
    finally:
        run.kill()
    assert rc == 75, out[-4000:]
    (inc,) = run.incidents()
    assert inc["desync"] is True and inc["culprit_ranks"] == [0], inc
    assert inc["reason"].startswith("desync: rank 0 in barrier while ranks 1,2 wait in all_gather_single"), inc
    assert inc["collective"] == "all_gather_single"
    assert "synced_gpus=True" in inc["advice"] and "No NCCL setting helps" in inc["advice"]
    assert "P2P" not in inc["advice"] and "NCCL_P2P_DISABLE" not in out
