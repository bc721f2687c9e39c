"""The job never outlives ``launch``: SIGKILL the launcher mid-run and its job is stopped by the guardian."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from launch_harness import REPO, base_env, read_events, start_launch, torchrun


def _alive(pids: list[int] | dict[int, float]) -> list[int]:
    """The pids still alive (not zombies); with create times, only the very processes (a reused pid is not)."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and (not isinstance(pids, dict) or p.create_time() == pids[pid]):
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def _described(pids: list[int]) -> list[str]:
    """Each pid with its parent and command line, for a failure message."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} (ppid {p.ppid()}, {p.status()}): {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            out.append(f"{pid} (gone)")
    return out


def _guardians() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if "gpu_watchdog.launch.guardian" in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
@pytest.mark.parametrize("victims", ["launch", "launch+torchrun", "launch, loaded machine"])
def test_a_sigkilled_launch_takes_its_job_down_within_10s(tmp_path: Path, victims: str, attempt: int) -> None:
    """Whatever dies with ``launch`` — torchrun too (an OOM kill, ``kill -9`` of the process group), or on a loaded
    machine — no process of the job is alive 10 s later: torchrun 2.13 starts every rank in a session of its own,
    so the guardian must know the job's whole tree, not only torchrun's session."""
    events = tmp_path / "events.jsonl"
    argv = [torchrun(), "--standalone", "--nproc-per-node", "2", str(REPO / "tests" / "jobs" / "sleepy.py"),
            "--steps", "2000", "--events", str(events)]
    run = start_launch(["--backend", "proc"], argv, env=base_env(), tmp_path=tmp_path, job_id="t-guardian")

    def rank_pids() -> list[int] | None:
        pids = [e["pid"] for e in read_events(events) if e["event"] == "start"]
        return pids if len(pids) == 2 else None

    burners: list[multiprocessing.Process] = []
    try:
        pids = run.wait_for("both ranks up", rank_pids, 90)
        # The harness runs `timeout -s KILL N gpu-watchdog launch …`: SIGKILL the launcher, not the wrapper.
        wrapper = psutil.Process(run.proc.pid)
        launcher = next(p for p in wrapper.children() if "launch" in p.cmdline())
        tree = [c for c in launcher.children(recursive=True)
                if "gpu_watchdog.launch.guardian" not in " ".join(c.cmdline())]  # torchrun and the ranks
        job = {c.pid: c.create_time() for c in tree}
        assert set(pids) <= set(job)
        (torchrun_proc,) = [c for c in tree if c.ppid() == launcher.pid]
        if "loaded" in victims:  # every core busy, as on a node whose other jobs compute
            burners = [multiprocessing.Process(target=_burn, args=(20.0,), daemon=True)
                       for _ in range(2 * (os.cpu_count() or 2))]
            for b in burners:
                b.start()
        launcher.send_signal(signal.SIGKILL)
        if "torchrun" in victims:
            torchrun_proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while _alive(job) and time.monotonic() - t0 < 10:
            time.sleep(0.2)
        left = _alive(job)
        assert not left, (f"job processes alive 10 s after {victims} was SIGKILLed: {_described(left)}; "
                          f"launch and guardian said:\n{run.output()[-3000:]}")
        print(f"{victims}: {len(job)} job processes gone {time.monotonic() - t0:.1f} s after the SIGKILL")
        # the guardian says so once the ladder is done (just after the last process went)
        deadline = time.monotonic() + 10
        while "guardian: launch is gone; stopped" not in run.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "guardian: launch is gone; stopped" in run.output()
    finally:
        for b in burners:
            b.kill()
        run.kill(extra=pids if "pids" in locals() else ())


@pytest.mark.slow
def test_a_run_that_ends_normally_releases_its_guardian(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    job = [torchrun(), "--standalone", "--nproc-per-node", "2", str(REPO / "tests" / "jobs" / "sleepy.py"),
           "--steps", "40", "--sleep-s", "0.05", "--events", str(events)]
    run = start_launch(["--backend", "proc"], job, env=base_env(), tmp_path=tmp_path, job_id="t-guardian-ok")

    def our_guardian() -> list[psutil.Process] | None:
        try:
            launcher = next(p for p in psutil.Process(run.proc.pid).children() if "launch" in p.cmdline())
            return [p for p in _guardians() if p.ppid() == launcher.pid] or None
        except (StopIteration, psutil.Error):
            return None

    try:
        (guardian,) = run.wait_for("the run's guardian", our_guardian, 60)
        assert run.wait(120) == 0, run.output()[-3000:]
        assert not _alive([guardian.pid])  # released and gone with the run
        assert "guardian: launch is gone" not in run.output()
    finally:
        run.kill()
