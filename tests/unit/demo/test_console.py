"""The demo's progress line: drawn in place on a terminal only, cleared before anything else is written."""

from __future__ import annotations

import io
import time
from collections.abc import Callable

from gpu_watchdog.demo.console import StoryConsole


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_progress_on_a_tty_is_redrawn_and_cleared() -> None:
    out = Tty()
    with StoryConsole(out, lambda: "  … waiting", every_s=0.02) as console:
        print("first", file=console)
        wait_for(lambda: "\r  … waiting" in out.getvalue())
        print("second", file=console)
    text = out.getvalue()
    assert text.startswith("first\n\r  … waiting")
    assert "\r\x1b[Ksecond\n" in text  # the progress line was cleared before "second"
    lines = [ln.rsplit("\r\x1b[K", 1)[-1] for ln in text.split("\n")]
    assert [ln for ln in lines if ln] == ["first", "second"]  # what stays on screen


def test_no_progress_line_when_not_a_terminal() -> None:
    out = io.StringIO()
    with StoryConsole(out, lambda: "  … waiting", every_s=0.01) as console:
        print("only", file=console)
        time.sleep(0.1)
    assert out.getvalue() == "only\n"
