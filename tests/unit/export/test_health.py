"""gpu_watchdog.export.health: one loop health for /healthz and the systemd pings; the Pinger thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
from gpu_watchdog.export.health import LoopHealth, Pinger


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# -- LoopHealth -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("interval_s,max_age_s", [(0.1, 10.0), (1.0, 10.0), (2.0, 20.0), (30.0, 300.0)])
def test_for_interval_is_the_one_threshold(interval_s: float, max_age_s: float) -> None:
    assert LoopHealth.for_interval(interval_s).max_age_s == max_age_s


@pytest.mark.parametrize("bad", [0, -1.0])
def test_max_age_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="max_age_s"):
        LoopHealth(bad)


def test_status_and_loop_alive_follow_the_last_tick_age() -> None:
    clock = FakeClock(100.0)
    h = LoopHealth(10.0, clock=clock)
    assert h.status() == (True, "starting: no sample yet")
    assert h.loop_alive() is False  # nothing to vouch for before the first tick: systemd is not armed yet
    clock.t = 109.9
    assert h.status() == (True, "starting: no sample yet")
    clock.t = 110.0
    assert h.status() == (False, "no sample in the 10 s since start (limit 10 s)")
    assert h.loop_alive() is False

    h.tick_ok()
    assert h.status() == (True, "ok") and h.loop_alive()
    clock.t = 119.9
    assert h.status() == (True, "ok") and h.loop_alive()
    clock.t = 120.0  # exactly max_age_s: no longer younger than the limit
    assert h.status() == (False, "last sample 10.0 s ago (limit 10 s)")
    assert h.loop_alive() is False
    clock.t = 122.5
    assert h.status() == (False, "last sample 12.5 s ago (limit 10 s)")
    h.tick_ok()
    assert h.status() == (True, "ok") and h.loop_alive()


def test_a_failed_tick_is_unhealthy_but_the_loop_is_alive() -> None:
    """NVML lost: /healthz says so, but systemd must not restart the daemon for it."""
    clock = FakeClock(100.0)
    h = LoopHealth(10.0, clock=clock)
    h.tick_failed("NVMLError_GpuIsLost:\nGPU 3 is lost")
    assert h.status() == (False, "sampling failed: NVMLError_GpuIsLost: GPU 3 is lost")  # one line
    assert h.loop_alive() is True
    clock.t = 109.0
    h.tick_failed("still lost")
    clock.t = 118.0
    assert h.status() == (False, "sampling failed: still lost") and h.loop_alive()
    clock.t = 119.0  # the failing loop itself stopped ticking: now it is stuck too
    assert h.status() == (False, "last sample 10.0 s ago (limit 10 s)")
    assert h.loop_alive() is False
    h.tick_ok()  # sampling works again
    assert h.status() == (True, "ok")
    h.tick_failed("")
    assert h.status() == (False, "sampling failed: unknown error")


def test_busy_holds_both_readers_within_its_bound_only() -> None:
    """A recovery holds the loop (checkpoint grace, stop ladder): alive until its bound, then not."""
    clock = FakeClock(100.0)
    h = LoopHealth(5.0, clock=clock)
    h.tick_ok()
    h.busy(30.0)
    clock.t = 120.0  # no tick for 20 s, but a recovery is under way
    assert h.status() == (True, "recovering a job (sampling paused)")
    assert h.loop_alive() is True
    clock.t = 130.0  # past the bound: a wedged recovery is a stuck loop
    assert h.status() == (False, "last sample 30.0 s ago (limit 5 s)")
    assert h.loop_alive() is False


def test_ending_busy_counts_as_the_loop_returning() -> None:
    clock = FakeClock(100.0)
    h = LoopHealth(5.0, clock=clock)
    h.tick_ok()
    h.busy(30.0)
    clock.t = 120.0
    h.busy(None)  # the recovery returned: the next tick gets a full max_age_s
    assert h.status() == (True, "ok") and h.loop_alive()
    clock.t = 124.9
    assert h.status() == (True, "ok")
    clock.t = 125.0
    assert h.status()[0] is False and not h.loop_alive()


def test_ending_busy_keeps_a_failed_outcome_and_needs_a_busy_to_end() -> None:
    clock = FakeClock(100.0)
    h = LoopHealth(5.0, clock=clock)
    h.tick_failed("NVML lost")
    h.busy(10.0)
    assert h.status() == (True, "recovering a job (sampling paused)")
    h.busy(None)
    assert h.status() == (False, "sampling failed: NVML lost") and h.loop_alive()

    h.tick_ok()
    clock.t = 104.0
    h.busy(None)  # no recovery under way: nothing returned, the age keeps counting
    clock.t = 105.0
    assert h.status()[0] is False and not h.loop_alive()


def test_busy_before_the_first_tick() -> None:
    clock = FakeClock(100.0)
    h = LoopHealth(5.0, clock=clock)
    h.busy(10.0)
    assert h.loop_alive() and h.status() == (True, "recovering a job (sampling paused)")
    h.busy(None)
    assert h.loop_alive() is False  # still no tick: nothing vouches for the loop
    assert h.status() == (True, "starting: no sample yet")


def test_concurrent_ticks_and_reads() -> None:
    """The loop writes, HTTP threads and the pinger read: every read sees one whole tick."""
    h = LoopHealth(60.0)
    stop = threading.Event()
    seen: set[str] = set()
    errors: list[BaseException] = []

    def loop() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            h.tick_ok() if i % 2 else h.tick_failed("flaky")
            h.busy(5.0) if i % 7 == 0 else h.busy(None)

    def reader() -> None:
        try:
            while not stop.is_set():
                ok, reason = h.status()
                assert (ok, reason) in ((True, "ok"), (False, "sampling failed: flaky"),
                                        (True, "recovering a job (sampling paused)"),
                                        (True, "starting: no sample yet")), (ok, reason)
                seen.add(reason)
                assert h.loop_alive() or reason.startswith("starting")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop), *(threading.Thread(target=reader) for _ in range(3))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(5)
    assert not errors, errors[0]
    assert {"ok", "sampling failed: flaky"} <= seen


# -- Pinger -----------------------------------------------------------------------------------------------
class Pings:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


def test_pinger_pings_while_the_loop_ticks_and_stops_when_it_wedges() -> None:
    clock = FakeClock(100.0)
    h = LoopHealth(10.0, clock=clock)
    pings = Pings()
    pinger = Pinger(h, pings, 0.01).start()
    try:
        assert wait_until(lambda: pinger.pings_withheld >= 3)  # no tick yet: nothing sent
        assert pings.n == 0 and pinger.pings_sent == 0

        h.tick_ok()
        assert wait_until(lambda: pings.n >= 3)
        clock.t = 105.0
        h.tick_failed("NVML lost")  # a failing sample still proves the loop runs
        sent = pings.n
        assert wait_until(lambda: pings.n >= sent + 3)

        clock.t = 115.0  # the loop wedged: 10 s without any tick
        withheld = pinger.pings_withheld
        assert wait_until(lambda: pinger.pings_withheld >= withheld + 2)
        stalled_at = pings.n
        assert wait_until(lambda: pinger.pings_withheld >= withheld + 5)
        assert pings.n == stalled_at  # systemd would now kill and restart the daemon

        h.tick_ok()  # the loop recovers
        assert wait_until(lambda: pings.n >= stalled_at + 3)
    finally:
        pinger.stop()
    assert not pinger.is_alive()
    assert pinger.pings_sent == pings.n
    after = pings.n
    time.sleep(0.05)
    assert pings.n == after  # stopped for good


def test_pinger_survives_a_failing_ping(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[float] = []

    def ping() -> None:
        calls.append(time.monotonic())
        raise RuntimeError("boom")

    h = LoopHealth(60.0)
    h.tick_ok()
    with caplog.at_level(logging.ERROR, logger="gpu_watchdog.export.health"):
        pinger = Pinger(h, ping, 0.02, name="test-pinger").start()
        [th] = [th for th in threading.enumerate() if th.name == "test-pinger"]
        assert th.daemon  # never keeps the agent from exiting
        ok = wait_until(lambda: len(calls) >= 3)
        pinger.stop()
    assert ok and pinger.pings_sent == 0
    assert "watchdog ping failed" in caplog.text


def test_pinger_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Pinger(LoopHealth(10.0), lambda: None, 0)
