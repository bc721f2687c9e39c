"""The demo's console: what the watchdog and the job say, plus (on a terminal only) one progress line at the
bottom that is redrawn in place while the demo waits and cleared before anything else is written."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TextIO


class StoryConsole:
    """A text stream for ``Launcher(out=…)`` and the job's ``[job]`` lines, with an optional progress line."""

    def __init__(self, out: TextIO, progress: Callable[[], str] | None = None, every_s: float = 0.5) -> None:
        self.out = out
        self.progress = progress if progress is not None and _isatty(out) else None
        self.every_s = every_s
        self._lock = threading.Lock()
        self._shown = False  # a progress line is on screen
        self._line_start = True  # the last character written ended a line
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StoryConsole:
        if self.progress is not None:
            self._thread = threading.Thread(target=self._tick, name="demo-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            self._clear()

    def write(self, text: str) -> int:
        with self._lock:
            self._clear()
            n = self.out.write(text)
            if text:
                self._line_start = text.endswith("\n")
            return n

    def flush(self) -> None:
        with self._lock:
            self.out.flush()

    def isatty(self) -> bool:
        return _isatty(self.out)

    def _tick(self) -> None:
        assert self.progress is not None
        while not self._stop.wait(self.every_s):
            text = self.progress()
            with self._lock:
                if not self._line_start:  # mid-line (print writes the text and its newline apart): next time
                    continue
                self._clear()
                self.out.write(f"\r{text}")
                self.out.flush()
                self._shown = True

    def _clear(self) -> None:
        if self._shown:
            self.out.write("\r\033[K")
            self._shown = False


def _isatty(out: TextIO) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):
        return False
