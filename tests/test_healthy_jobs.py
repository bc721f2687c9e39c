"""Healthy jobs that look like hangs to a naive detector must run clean, under ``launch`` and under the daemon.

A false action is the worst bug: a job that spends most of each step at one line (a short sleep, a poll) shows
the same frame in every stack dump while it progresses. Its main thread keeps blocking and waking; a rank
blocked for good does not. These tests run such a job on a loaded machine with the shipped detection defaults.
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
from gloo_jobs import start_job
from launch_harness import base_env, read_events, start_launch, train_argv

SLEEPY = ("--sleep-step", "--step-s", "0.2", "--steps", "60")


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


@pytest.mark.slow
def test_a_low_cpu_loop_that_sleeps_at_one_line_runs_clean_under_launch(tmp_path: Path) -> None:
    """3 ranks, 0.2 s sleep + one all_reduce per step, 60 steps, no in-job client, shipped defaults, two CPU
    burners beside it: no incident, no stop, exit 0."""
    events = tmp_path / "events.jsonl"
    argv = train_argv(events, tmp_path, nproc=3, scenario="healthy", extra=SLEEPY)
    with cpu_load():
        run = start_launch(["--backend", "proc"], argv, env=base_env(), tmp_path=tmp_path, job_id="t-sleepy")
        try:
            rc = run.wait(240)
            out = run.output()
        finally:
            run.kill()
    assert rc == 0, out[-4000:]
    assert run.incidents() == [], out[-4000:]
    assert "STALL" not in out and "stopped the job" not in out
    assert sorted(e["rank"] for e in read_events(events) if e["event"] == "done") == [0, 1, 2]


@pytest.mark.slow
def test_a_low_cpu_loop_that_sleeps_at_one_line_runs_clean_under_the_daemon() -> None:
    """The same job registered with the daemon (whose recovery would stop it): no incident, the job finishes."""
    base = short_dir()
    d = DaemonProc(base, daemon_config(base))
    job = None
    try:
        with cpu_load():
            d.wait_socket()
            job = start_job("healthy", nproc=3, extra_args=SLEEPY, tmp_path=base / "job", step_s=0.2)
            job.wait_ranks(60)
            out = subprocess.run([str(Path(sys.executable).parent / "gpu-watchdog"), "hook", "job-start",
                                  "--socket", d.socket, "--job-id", "sleepy-1", "--pid", str(job.proc.pid),
                                  "--restart-hook", "requeue"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            wait_for(lambda: job.proc.poll() is not None, 180, "the job to finish", d.log_text)
        assert job.proc.returncode == 0, job.log_tail()
        assert sorted(e["rank"] for e in job.events() if e["event"] == "done") == [0, 1, 2]
        assert d.call("incidents")["incidents"] == [], d.log_text()[-3000:]
    finally:
        if job is not None:
            job.stop()
        d.kill()
