"""launch.exits.ExitWatch on real processes: each exit is timed when the process ended, with its status read from
the zombie, whether or not its rank was known then; a process that may become a rank keeps what named it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_watchdog.launch.exits import ExitWatch, ended_by_ray
from gpu_watchdog.sample.unranked import Unranked
from ray_logs import DEAD_AFTER_INIT, SURVIVOR, copy_log


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(params=["pidfd", "proc"])
def watch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ExitWatch]:
    if request.param == "proc":  # Linux < 5.3: no pidfds, /proc/PID/stat read every poll_s
        def no_pidfd(pid: int) -> int:
            raise OSError(38, "Function not implemented")
        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    w = ExitWatch(poll_s=0.02)
    yield w
    w.close()


def test_a_rank_named_after_its_process_died_is_timed_when_it_died(watch: ExitWatch) -> None:
    """A Ray actor's rank is read from Ray's records, possibly after the actor was SIGKILLed: the exit is the one
    seen while its process was watched unnamed, with the status its zombie gave, before a peer's later exit."""
    killed, peer = _sleeper(), _sleeper()
    try:
        watch.watch_processes([killed.pid, peer.pid])
        time.sleep(1.0)  # the thread holds both (it picks new pids up within 200 ms)
        killed.send_signal(signal.SIGKILL)
        time.sleep(0.5)  # still a zombie: this test is its parent and has not reaped it
        died_by = time.time()
        peer.send_signal(signal.SIGTERM)
        _until(lambda: len(watch.exits) == 0 and peer.poll() is not None)
        watch.watch({1: killed.pid, 0: peer.pid})
        _until(lambda: len(watch.exits) == 2)
        exits = watch.exits
        assert exits[1][0] < died_by < exits[0][0], exits
        assert exits[1][1] == signal.SIGKILL, exits  # read from the zombie
    finally:
        for p in (killed, peer):
            p.kill()
            p.wait()


def test_a_rank_first_seen_already_reaped_is_an_exit_with_no_status(watch: ExitWatch) -> None:
    gone = _sleeper()
    gone.kill()
    gone.wait()  # reaped: nothing left to read
    watch.watch({2: gone.pid})
    _until(lambda: 2 in watch.exits)
    assert watch.exits[2][1] is None


def test_the_command_is_timed_apart_from_the_ranks_and_forget_drops_the_ended(watch: ExitWatch) -> None:
    command, rank = _sleeper(), _sleeper()
    try:
        watch.watch_command(command.pid)
        watch.watch({0: rank.pid})
        time.sleep(0.3)
        rank.terminate()
        _until(lambda: 0 in watch.exits)
        assert watch.command_exited_at is None
        watch.forget()  # the engine restarted its ranks in place: that exit is no exit of the job's
        assert watch.exits == {}
        command.terminate()
        _until(lambda: watch.command_exited_at is not None)
        assert watch.exits == {}
    finally:
        for p in (command, rank):
            p.kill()
            p.wait()


def test_a_process_that_dies_before_its_rank_is_known_keeps_what_named_it(watch: ExitWatch) -> None:
    """Both may become ranks (a Ray actor, a group member): the one that dies — reaped by its parent at once, as Ray's
    raylet does (this test is its parent) — keeps what named it when last seen alive; the live one the scanner stops
    listing (back to idle, named) is dropped; one named as a rank after all is a rank's exit."""
    dies, lives = _sleeper(), _sleeper()
    try:
        watch.watch_unranked({dies.pid: Unranked(dies.pid, 0.0, ("python", "a"), True),
                              lives.pid: Unranked(lives.pid, 0.0, ("python", "b"), True)})
        time.sleep(0.5)  # the thread holds both
        dies.kill()
        dies.wait()
        _until(lambda: dies.pid in watch.unranked_exits)
        watch.watch_unranked({})  # the next tick lists neither
        exits = watch.unranked_exits
        # Its status: none where the reap came first, SIGKILL where the watch read the zombie before it (a loaded
        # host delays the reaping parent) — never anything else.
        assert list(exits) == [dies.pid] and exits[dies.pid][1] in (None, signal.SIGKILL), exits
        assert exits[dies.pid][2].command == ("python", "a"), exits
        lives.kill()
        lives.wait()
        time.sleep(0.5)
        assert list(watch.unranked_exits) == [dies.pid]
        watch.watch({1: dies.pid})
        assert watch.unranked_exits == {} and 1 in watch.exits
    finally:
        for p in (dies, lives):
            p.kill()
            p.wait()


def test_a_rank_ray_ended_on_purpose_is_told_by_its_own_log(watch: ExitWatch, tmp_path: Path) -> None:
    """Rank 0's log says Ray ended it (its driver gone); rank 1, SIGKILLed, logged nothing of its end. Both dead ranks
    are named by their Ray workers as Ray's records tell after their end (rank 1's actor, from its log)."""
    survivor, killed = _sleeper(), _sleeper()
    try:
        watch.watch({0: survivor.pid, 1: killed.pid})
        watch.watch_ray_workers({p.pid: Unranked(p.pid, 0.0, ("ray::Trainer.train",), False,
                                                 copy_log(w, tmp_path / "logs", p.pid))
                                 for p, w in ((survivor, SURVIVOR), (killed, DEAD_AFTER_INIT))})
        time.sleep(0.3)
        assert watch.ray_ranks() == {} and ended_by_ray(watch.ray_ranks()) == {}  # nothing ended yet
        for p in (killed, survivor):
            p.kill()
            p.wait()
        _until(lambda: len(watch.exits) == 2)
        dead = watch.ray_ranks()
        assert {r: w.pid for r, w in dead.items()} == {0: survivor.pid, 1: killed.pid}, dead
        assert dead[1].ray is not None and dead[1].ray.actor_repr == "Trainer(rank=1)", dead[1]
        ended = ended_by_ray(dead)
        assert list(ended) == [0] and "its owner has died" in ended[0], ended
    finally:
        for p in (survivor, killed):
            p.kill()
            p.wait()
