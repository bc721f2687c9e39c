"""A full or read-only state directory degrades the agent; it never stops it from recovering its job.

The state dir is a real tmpfs, mounted small and filled up, or mounted read-only, before ``launch`` starts (root
only: CI runs as root; elsewhere the test skips, saying why). A real 3-rank gloo hang must still be detected, the
job stopped and restarted, with no traceback and nothing of the job left running; what could not be written is said
once.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_harness import base_env, read_events, start_launch, train_argv


@contextlib.contextmanager
def _tmpfs(d: Path, options: str) -> Iterator[Path]:
    d.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs for the state-dir test: {mounted.stderr.strip()}")
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture
def full_state_dir(tmp_path: Path) -> Iterator[Path]:
    with _tmpfs(tmp_path / "state", "size=256k") as d:
        with open(d / "filler", "wb") as f, contextlib.suppress(OSError):  # fill it until ENOSPC
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        yield d


@pytest.fixture
def read_only_state_dir(tmp_path: Path) -> Iterator[Path]:
    with _tmpfs(tmp_path / "state", "size=256k,ro") as d:
        yield d


@pytest.mark.slow
@pytest.mark.parametrize("state", ["full", "read-only"])
def test_a_hang_is_recovered_with_the_state_dir_unwritable(tmp_path: Path, state: str,
                                                           request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("full_state_dir" if state == "full" else "read_only_state_dir")
    events = tmp_path / "events.jsonl"
    job = train_argv(events, tmp_path, nproc=3, scenario="hang", rank_at=1, step_at=3, step_s=0.2, steps=8,
                     extra=("--cured-by", "GPU_WATCHDOG_RESTART_COUNT=1"))
    run = start_launch(["--backend", "proc"], job, env=base_env(), tmp_path=tmp_path, job_id="t-full-disk")
    # start_launch puts the state dir at tmp_path/state: the full tmpfs
    try:
        rc = run.wait(180)
        out = run.output()
    finally:
        run.kill()
    assert rc == 0, out[-5000:]
    # no traceback of ours (torchrun prints its own on the SIGTERM that stops it: expected)
    assert "gpu_watchdog/" not in out and "OSError" not in out, out[-5000:]
    assert "STALL confirmed" in out and "restarting (run 1)" in out
    assert ("No space left on device" if state == "full" else "Read-only file system") in out  # said, once per place
    said = [ln.split(" WARNING ", 1)[-1] for ln in out.splitlines() if "cannot write" in ln]
    assert said and len(said) == len(set(said)), said  # once per place (dir, summary, trace, report, …), not per tick
    assert sorted(e["rank"] for e in read_events(events) if e["event"] == "done") == [0, 1, 2]
    assert len([e for e in read_events(events) if e["event"] == "hang_onset"]) == 1
