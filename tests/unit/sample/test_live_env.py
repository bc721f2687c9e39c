"""The environment a process has now (sample.live_env): what ``os.environ[...] = ...`` set after it started, which
``/proc/PID/environ`` never shows — read from real processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_watchdog.sample.live_env import live_env
from waiting import wait_for


@pytest.fixture
def ranked(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    ready = tmp_path / "ready"
    code = ("import os, sys, time; os.environ['RANK'] = '3'; os.environ['WORLD_SIZE'] = '4'; "
            "os.environ.pop('GW_GONE'); open(sys.argv[1], 'w').close(); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready)], env={"GW_GONE": "x", "PATH": "/usr/bin"})
    try:
        wait_for(ready.exists, 20, "the process set its environment")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_what_the_process_set_in_code_is_read_and_its_start_block_does_not_show_it(
        ranked: subprocess.Popen[bytes]) -> None:
    assert b"RANK=" not in Path(f"/proc/{ranked.pid}/environ").read_bytes()
    env = live_env(ranked.pid, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GW_GONE", "PATH"))
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "PATH": "/usr/bin"}, env  # removed and unset keys are absent


def test_a_process_that_is_gone_or_not_readable_gives_none() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert live_env(proc.pid, ("RANK",)) is None
    assert live_env(1 << 30, ("RANK",)) is None
