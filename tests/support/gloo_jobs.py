"""Start real torchrun gloo jobs (tests/jobs/train.py) for tests and benchmarks, and always clean up.

    job = start_job("hang", nproc=4, extra_args=("--rank-at", "1"), tmp_path=tmp_path)
    try:
        job.wait_event("hang_onset", timeout=60)
        pids = job.rank_pids()            # {rank: pid}, from the ranks' "start" events
    finally:
        job.stop()                        # SIGKILL to the whole process group

The job runs in its own session (process group = torchrun's pid) under ``timeout -s KILL`` so even a
test runner killed hard cannot leave hung ranks behind for long. ``--standalone`` picks a free
rendezvous port, so jobs of concurrent test sessions never collide.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
from gpu_watchdog.demo.runner import read_events
from repo_paths import REPO

TRAIN = REPO / "tests" / "jobs" / "train.py"
VENV_BIN = Path(sys.executable).parent


def _torchrun() -> str:
    beside = VENV_BIN / "torchrun"
    return str(beside) if beside.exists() else (shutil.which("torchrun") or "torchrun")


class RunningJob:
    """A torchrun job started by ``start_job``. Read its events; stop it when done."""

    def __init__(self, proc: subprocess.Popen[bytes], nproc: int, events: Path, log: Path, workdir: Path):
        self.proc = proc
        self.nproc = nproc
        self.events_path = events
        self.log_path = log
        self.workdir = workdir

    def events(self) -> list[dict[str, Any]]:
        """Every JSON line the ranks wrote so far (a torn last line is skipped)."""
        return read_events(self.events_path)

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the ranks that have logged their "start" event (torchrun's children)."""
        return {int(e["rank"]): int(e["pid"]) for e in self.events() if e.get("event") == "start" and "pid" in e}

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def wait_event(self, event: str, timeout: float, *, rank: int | None = None, count: int = 1) -> list[dict]:
        """Wait until ``count`` events named ``event`` (from ``rank`` if given) exist; return them.
        Raises TimeoutError (with the job log's tail) or RuntimeError when the job exits first."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events()
                     if e.get("event") == event and (rank is None or e.get("rank") == rank)]
            if len(found) >= count:
                return found
            if self.proc.poll() is not None:
                raise RuntimeError(f"job exited {self.proc.returncode} before {event!r}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {count}x {event!r} within {timeout} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def wait_ranks(self, timeout: float) -> dict[int, int]:
        """Wait until every rank logged "start"; return {rank: pid}."""
        self.wait_event("start", timeout, count=self.nproc)
        return self.rank_pids()

    def stop(self) -> None:
        """Kill torchrun, every rank and anything else it started, then reap torchrun. Idempotent. The tree is read
        before the kill: ranks may sit in sessions of their own, and a rank that had not yet logged its start would
        otherwise outlive a failed test (it did: orphaned ranks ran on for an hour and disturbed later tests)."""
        try:
            tree = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        pids = sorted(set(self.rank_pids().values()) | set(tree))
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:  # a rank that left the group (it never should) still dies
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> RunningJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_job(
    scenario: str,
    *,
    nproc: int = 4,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    tmp_path: Path,
    step_s: float = 0.05,
    step_at: int = 2,
    max_lifetime_s: int = 300,
    script: Path = TRAIN,
) -> RunningJob:
    """Start ``torchrun --standalone --nproc-per-node N tests/jobs/train.py --scenario S`` with a short
    ``--step-s`` and an early ``--step-at`` (override them in ``extra_args``: later flags win). ``script``: another
    job of tests/jobs/ that takes the same flags (groups.py)."""
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    events = tmp_path / f"events-{scenario}-{time.monotonic_ns()}.jsonl"
    log = events.with_suffix(".log")
    argv = [
        _torchrun(), "--standalone", "--nproc-per-node", str(nproc), str(script),
        "--scenario", scenario, "--step-s", str(step_s), "--step-at", str(step_at),
        "--events", str(events), "--workdir", str(tmp_path), *extra_args,
    ]
    timeout_bin = shutil.which("timeout")
    if timeout_bin:  # safety net: the whole group is SIGKILLed after max_lifetime_s whatever happens
        argv = [timeout_bin, "-s", "KILL", str(max_lifetime_s), *argv]
    full_env = dict(os.environ)
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    full_env.update(env or {})
    with open(log, "wb") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=full_env, cwd=tmp_path, start_new_session=True)
    return RunningJob(proc, nproc, events, log, tmp_path)
