"""A stepped wall clock (NTP after boot, an admin's ``date -s``) is neither a stall nor a blind spot.

Sample times are wall-clock stamps (they go into incidents and traces); the detector measures its windows and
streaks in them. The engine compares each step of the wall clock with the monotonic clock and, when they differ
by more than ``CLOCK_STEP_S``, starts the detector's windows again. ``launch`` runs in this process with the
real proc backend, whose wall clock jumps by an hour at a chosen sample.
"""

from __future__ import annotations

import io
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from gpu_watchdog.config.schema import AgentConfig, Config, RecoveryConfig
from gpu_watchdog.launch.launcher import Launcher
from gpu_watchdog.sample.backends import ProcBackend
from gpu_watchdog.sample.processes import ProcessScanner
from in_process import one_rank_launch

# Burns CPU for the first phase, holds still (memory held, no CPU) for the second, burns again for the third. Holding
# still is a read that blocks without a timeout (a timer thread ends it): a sleep would be a slow rank, not a stall.
PHASES = """
import os, sys, threading, time
ballast = bytearray(32 << 20)
burn1, still, burn2 = map(float, sys.argv[1:4])
def burn(s):
    end = time.monotonic() + s
    while time.monotonic() < end:
        pass
def hold_still(s):
    r, w = os.pipe()
    threading.Timer(s, os.write, (w, b"x")).start()
    os.read(r, 1)
burn(burn1); hold_still(still); burn(burn2)
"""


class JumpingClock:
    """time.time(), plus ``jump_s`` from the ``at_call``-th reading on."""

    def __init__(self, jump_s: float, at_call: int) -> None:
        self.jump_s, self.at_call, self.calls = jump_s, at_call, 0

    def __call__(self) -> float:
        self.calls += 1
        return time.time() + (self.jump_s if self.calls >= self.at_call else 0.0)


def _launch(tmp_path: Path, jump_s: float, at_call: int, phases: tuple[float, float, float]) -> tuple[int, str]:
    # Recovery off: a stall is reported on the console and the job runs on, so the run shows what was found.
    cfg = Config(agent=AgentConfig(interval_s=0.25, backend="proc", state_dir=str(tmp_path / "s"), hostname="n1"),
                 recovery=replace(RecoveryConfig(), enabled=False))
    backend = ProcBackend(ProcessScanner(root_pid=os.getpid()), "n1", clock=JumpingClock(jump_s, at_call))
    out = io.StringIO()
    lc = Launcher(cfg, [sys.executable, "-c", PHASES, *map(str, phases)], job_id="clock", out=out, backend=backend)
    with one_rank_launch():
        rc = lc.run()
    return rc, out.getvalue()


@pytest.mark.parametrize("jump_s", [3600.0, -3600.0])
def test_a_clock_step_during_a_short_pause_is_not_a_stall(tmp_path: Path, jump_s: float) -> None:
    """Forward, a 1.5 s pause would read as an hour-long streak, past confirm_after_s: a false stall."""
    rc, out = _launch(tmp_path, jump_s, at_call=10, phases=(2.0, 1.5, 2.0))
    assert rc == 0, out
    assert "found" not in out, out


@pytest.mark.parametrize("jump_s", [3600.0, -3600.0])
def test_a_hang_after_a_clock_step_is_still_found(tmp_path: Path, jump_s: float) -> None:
    """Back, every window would read as too short and the rank's verdict stay frozen: a hang unseen for an hour."""
    rc, out = _launch(tmp_path, jump_s, at_call=6, phases=(2.5, 25.0, 0.0))
    assert rc == 0, out
    assert "stall found" in out, out  # found while the job held still (recovery is off: reported only)
