"""One daemon per control socket (issue 23): a second ``run`` refuses (exit 69) and never takes the first one's
socket; a daemon never unlinks a socket it did not create; a vanished socket comes back on the next tick or SIGHUP,
and /healthz is not ok while the control API is unreachable."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_helpers import GW, DaemonProc, wait_for, write_config
from gpu_watchdog.daemon.control import ControlServer, refuse_if_served, request
from gpu_watchdog.daemon.service import Daemon
from gpu_watchdog.errors import EXIT_UNAVAILABLE, ServiceUnavailable


@pytest.fixture
def daemon(make_daemon: Callable[..., Daemon]) -> Daemon:
    return make_daemon()


def test_a_second_run_on_a_served_socket_exits_69_and_a_deleted_socket_comes_back(base: Path) -> None:
    d = DaemonProc(base, write_config(base))
    try:
        d.wait_socket()
        before = os.lstat(d.socket).st_ino
        out = subprocess.run([GW, "run", "--config", str(d.config)], capture_output=True, text=True, timeout=60)
        assert out.returncode == EXIT_UNAVAILABLE == 69, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and f"(pid {d.proc.pid}) already serves the control socket" in lines[0], lines
        assert os.lstat(d.socket).st_ino == before  # never unlinked nor replaced
        assert d.call("status")["ok"] is True
        os.unlink(d.socket)  # deleted under the running daemon: back on its next tick, and said so
        wait_for(lambda: d.call("status", check=False).get("ok") is True, 10, "the socket to come back", d.log_text)
        assert "had vanished (deleted?): recreated" in d.log_text()
        d.kill(signal.SIGTERM)
        assert d.proc.returncode == 0
    finally:
        d.kill()


def test_a_stale_socket_is_replaced_and_anything_else_refused(base: Path) -> None:
    path = base / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # bound, never listening: a killed daemon's leftover
    refuse_if_served(path)  # stale: may be replaced
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(ServiceUnavailable, match="not a socket"):
        refuse_if_served(path)


def test_a_vanished_socket_comes_back_on_the_next_tick_and_healthz_says_while_it_cannot(
        daemon: Daemon, base: Path, caplog: pytest.LogCaptureFixture) -> None:
    srv = ControlServer(daemon.settings, daemon)
    daemon._control = srv
    srv.start()
    try:
        os.unlink(srv.path)  # an admin's rm, a tmpfiles cleanup
        daemon.check_control()  # what every tick (and SIGHUP) does first
        assert "had vanished (deleted?): recreated" in caplog.text
        assert daemon.health.status() == (True, "starting: no sample yet")
        wait_for(lambda: request(str(srv.path), {"op": "status"}, timeout_s=5)["ok"], 10, "the recreated socket")

        # Replaced by another process's socket: not ours to remove; /healthz is not ok, and stop() leaves it.
        os.unlink(srv.path)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(str(srv.path))
        other.listen(1)
        daemon.check_control()
        ok, why = daemon.health.status()
        assert not ok and "no longer this daemon's socket" in why
        srv.stop()
        assert srv.path.exists()  # never unlinked a socket it did not create
        other.close()
    finally:
        srv.stop()
