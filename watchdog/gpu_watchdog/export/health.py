"""PLACEHOLDER until the export branch lands (same API)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class LoopHealth:
    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._last: float | None = None
        self._ok = True
        self._reason = ""
        self._busy_until: float | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_interval(cls, interval_s: float) -> LoopHealth:
        return cls(max(10.0, 10 * interval_s))

    def tick_ok(self) -> None:
        with self._lock:
            self._last, self._ok = self._clock(), True

    def tick_failed(self, reason: str) -> None:
        with self._lock:
            self._last, self._ok, self._reason = self._clock(), False, reason

    def busy(self, max_s: float | None) -> None:
        self._busy_until = None if max_s is None else self._clock() + max_s

    def status(self) -> tuple[bool, str]:
        if self._busy_until is not None and self._clock() < self._busy_until:
            return True, "recovering a job (sampling paused)"
        if self._last is None:
            return False, "starting: no sample yet"
        if self._clock() - self._last > self.max_age_s:
            return False, "stale"
        return (True, "ok") if self._ok else (False, self._reason)

    def loop_alive(self) -> bool:
        if self._busy_until is not None and self._clock() < self._busy_until:
            return True
        return self._last is not None and self._clock() - self._last <= self.max_age_s


class Pinger:
    def __init__(self, health: LoopHealth, ping: Callable[[], object], interval_s: float, *,
                 name: str = "sd-watchdog") -> None:
        self.health, self.ping, self.interval_s = health, ping, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Pinger:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.health.loop_alive():
                self.ping()
            self._stop.wait(self.interval_s)
