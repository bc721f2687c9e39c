"""The one polling helper the tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psutil


def wait_for(cond: Callable[[], Any], timeout: float, what: str, *, log: Callable[[], str] | None = None,
             poll: float = 0.05) -> Any:
    """Call ``cond`` every ``poll`` s until it returns something truthy, and return that; after ``timeout`` s
    fail the test naming ``what`` (with ``log()``, e.g. the daemon's log, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{log()}" if log else ""))
        time.sleep(poll)


def wait_blocked(pid: int, timeout: float = 10.0) -> None:
    """Wait until ``pid`` sleeps in the kernel on three reads in a row: a child that printed "ready" has then
    reached the blocking call after the print, however slowly it was scheduled."""
    proc = psutil.Process(pid)
    in_a_row = 0

    def blocked() -> bool:
        nonlocal in_a_row
        in_a_row = in_a_row + 1 if proc.status() == psutil.STATUS_SLEEPING else 0
        return in_a_row >= 3

    wait_for(blocked, timeout, f"pid {pid} to block", poll=0.01)
