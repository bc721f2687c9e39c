"""One notion of "the agent's loop is alive", read by ``/healthz`` and by the systemd watchdog pinger.

The sampling loop reports every tick: ``tick_ok()`` when it sampled, ``tick_failed(reason)`` when it ran but
sampling failed (NVML lost, ...), and ``busy(max_s)`` / ``busy(None)`` around a bounded recovery that holds
the loop (stack dump, checkpoint grace, stop ladder). Both readers use the same threshold, ``max_age_s``
(``for_interval``: ``max(10 s, 10 × interval_s)``), but ask different questions:

- ``status()`` (``/healthz``): is the agent *useful*? The last tick must be younger than ``max_age_s`` and
  must have sampled. Before the first tick the agent counts as starting (healthy) for ``max_age_s``, so a
  liveness probe does not kill a daemon whose NVML init is slow.
- ``loop_alive()`` (``WATCHDOG=1`` pings): is the loop *running*? Any tick counts, failed or not: a driver
  problem must not get the daemon restarted by systemd every ``WatchdogSec`` (its failure shows on
  ``/healthz`` and ``gpu_watchdog_up``); only a wedged loop (an NVML call that never returns, a deadlock)
  stops the pings. Before the first tick: False (systemd arms its watchdog only after ``READY=1``).

A problem outside the loop that makes the agent not useful (the daemon's control API unreachable: its socket
vanished and could not be recreated, or another process replaced it) is set with ``problem(what, reason)`` and
cleared with ``problem(what, None)``: ``status()`` is not ok while one is set; ``loop_alive()`` ignores it.

``Pinger`` is the thread that asks ``loop_alive()`` every ``interval_s`` and pings while it holds. It has no
work of its own, so it keeps running when the loop is stuck.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["LoopHealth", "Pinger"]

MIN_MAX_AGE_S = 10.0  # a sub-second interval must not make one slow tick look like a dead loop
MAX_AGE_INTERVALS = 10.0


class LoopHealth:
    """The loop's last tick (when, and whether it sampled) and any bounded recovery holding it. Thread-safe."""

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s!r}")
        self.max_age_s = float(max_age_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._last_tick: float | None = None
        self._failure: str | None = None  # why the last tick's sampling failed; None: it sampled
        self._busy_until: float | None = None
        self._problems: dict[str, str] = {}  # what → why, for status() only

    @classmethod
    def for_interval(cls, interval_s: float) -> LoopHealth:
        """The agent's threshold for a loop ticking every ``interval_s``: ``max(10 s, 10 × interval_s)``."""
        return cls(max(MIN_MAX_AGE_S, MAX_AGE_INTERVALS * interval_s))

    def tick_ok(self) -> None:
        """A tick sampled and ran."""
        self._tick(None)

    def tick_failed(self, reason: str, *, what: str = "sampling failed") -> None:
        """A tick ran but failed (``what``: sampling, or an internal error past it): the loop is alive, the agent
        is not healthy."""
        one_line = " ".join(str(reason).split()) or "unknown error"  # /healthz's body is one line
        self._tick(f"{what}: {one_line}")

    def _tick(self, failure: str | None) -> None:
        now = self._clock()
        with self._lock:
            self._last_tick = now
            self._failure = failure

    def busy(self, max_s: float | None) -> None:
        """A recovery holds the loop for at most ``max_s`` seconds; ``None``: it is over.

        Within the bound both readers say alive, so neither a liveness probe nor systemd kills the agent
        mid-recovery; past it, a wedged recovery is a stuck loop. Ending it counts as the loop being alive
        now (it just returned), so the next tick has a full ``max_age_s`` to arrive; the last tick's outcome
        (ok or failed) stands.
        """
        now = self._clock()
        with self._lock:
            if max_s is not None:
                self._busy_until = now + max(0.0, max_s)
                return
            if self._busy_until is not None and self._last_tick is not None:
                self._last_tick = now
            self._busy_until = None

    def problem(self, what: str, reason: str | None) -> None:
        """Set (``reason``) or clear (None) a problem outside the loop that makes ``status()`` not ok."""
        with self._lock:
            if reason is None:
                self._problems.pop(what, None)
            else:
                self._problems[what] = " ".join(reason.split())

    def status(self) -> tuple[bool, str]:
        """(healthy, reason) for ``/healthz``."""
        now = self._clock()
        with self._lock:
            last, failure, busy_until = self._last_tick, self._failure, self._busy_until
            problems = "; ".join(self._problems.values())
        if problems:
            return False, problems
        limit = self.max_age_s
        if busy_until is not None and now < busy_until:
            return True, "recovering a job (sampling paused)"
        if last is None:
            age = now - self._started
            if age < limit:
                return True, "starting: no sample yet"
            return False, f"no sample in the {age:.0f} s since start (limit {limit:g} s)"
        age = now - last
        if age >= limit:
            return False, f"last sample {age:.1f} s ago (limit {limit:g} s)"
        if failure is not None:
            return False, failure
        return True, "ok"

    def loop_alive(self) -> bool:
        """For the systemd watchdog ping: any tick younger than ``max_age_s``, or a recovery within its bound."""
        now = self._clock()
        with self._lock:
            last, busy_until = self._last_tick, self._busy_until
        if busy_until is not None and now < busy_until:
            return True
        return last is not None and now - last < self.max_age_s


class Pinger:
    """A daemon thread calling ``ping()`` every ``interval_s`` seconds while ``health.loop_alive()``.

    ``pings_sent`` / ``pings_withheld`` count its decisions. A raising ``ping()`` is logged, never fatal.
    """

    def __init__(self, health: LoopHealth, ping: Callable[[], object], interval_s: float, *,
                 name: str = "sd-watchdog") -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.health = health
        self.interval_s = float(interval_s)
        self.pings_sent = 0
        self.pings_withheld = 0
        self._ping = ping
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Pinger:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.health.loop_alive():
                self.pings_withheld += 1  # only this thread writes the counters
            else:
                try:
                    self._ping()
                    self.pings_sent += 1
                except Exception:  # a bug in ping() must not kill the thread silently
                    log.exception("watchdog ping failed")
            self._stop.wait(self.interval_s)
