"""A test harness thread that calls ``tick()`` every ``period_s`` until stopped; an exception in it fails the test.

    class Player(HarnessLoop):
        def tick(self) -> None: ...
    with Player(period_s=0.5): ...          # the thread runs while the block does; stop() re-raises its error
"""

from __future__ import annotations

import threading
from typing import TypeVar

Self = TypeVar("Self", bound="HarnessLoop")


class HarnessLoop:
    name = "harness"

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def tick(self) -> None:
        raise NotImplementedError

    def start(self: Self) -> Self:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.error is not None:
            raise AssertionError(f"the {self.name} thread failed: {self.error!r}") from self.error

    def __enter__(self: Self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.tick()
                self._stop.wait(self.period_s)
        except BaseException as e:  # surfaced by stop()
            self.error = e
