"""The one polling helper the tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


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
