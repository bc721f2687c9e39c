"""sd_notify client, and the loop-gated watchdog pings it sends, against real unix datagram sockets (what
systemd binds)."""

from __future__ import annotations

import logging
import os
import socket
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_watchdog.export.health import LoopHealth, Pinger
from gpu_watchdog.export.sdnotify import Notifier, watchdog_interval_s

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Receiver:
    """The systemd side: a bound AF_UNIX/SOCK_DGRAM socket that also reports the sender's pid."""

    def __init__(self, sock: socket.socket, notify_socket: str) -> None:
        self.sock = sock
        self.notify_socket = notify_socket  # the NOTIFY_SOCKET value naming it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def recv(self, timeout: float = 2.0) -> tuple[dict[str, str], int] | None:
        """One message as ({field: value}, sender pid), or None on timeout."""
        self.sock.settimeout(timeout)
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = _UCRED.unpack(payload[: _UCRED.size])[0]
        text = data.decode()
        assert text.endswith("\n"), text
        fields = dict(line.split("=", 1) for line in text.splitlines())
        return fields, pid

    def next(self, timeout: float = 2.0) -> dict[str, str]:
        got = self.recv(timeout)
        assert got is not None, "no sd_notify message arrived"
        return got[0]

    def drain(self, within: float) -> list[dict[str, str]]:
        """Every message arriving within ``within`` seconds."""
        out: list[dict[str, str]] = []
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            got = self.recv(timeout=left)
            if got is not None:
                out.append(got[0])
        return out


@pytest.fixture
def path_receiver() -> Iterator[Receiver]:
    # A short directory: sun_path holds at most 107 bytes, pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="sdn") as d:
        path = str(Path(d) / "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        try:
            yield Receiver(sock, path)
        finally:
            sock.close()


@pytest.fixture
def abstract_receiver() -> Iterator[Receiver]:
    name = f"gpu-watchdog-test/{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    try:
        yield Receiver(sock, "@" + name)
    finally:
        sock.close()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_ready_with_status_reaches_the_socket(kind: str, request: pytest.FixtureRequest,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rx: Receiver = request.getfixturevalue(f"{kind}_receiver")
    monkeypatch.setenv("NOTIFY_SOCKET", rx.notify_socket)
    n = Notifier.from_env()
    assert n.enabled
    assert n.ready("watching 2 GPUs") is True
    got = rx.recv()
    assert got is not None
    fields, pid = got
    assert fields == {"READY": "1", "STATUS": "watching 2 GPUs"}
    assert pid == os.getpid()  # what NotifyAccess=main checks
    n.close()


def test_status_stopping_reloading_extend(path_receiver: Receiver) -> None:
    n = Notifier(path_receiver.notify_socket)
    assert n.status("3 jobs, 0 incidents")
    assert path_receiver.next() == {"STATUS": "3 jobs, 0 incidents"}
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    fields = path_receiver.next()
    assert fields["RELOADING"] == "1"
    assert before <= int(fields["MONOTONIC_USEC"]) <= before + 5_000_000
    assert n.ready()
    assert path_receiver.next() == {"READY": "1"}
    assert n.extend_timeout(12.5)
    assert path_receiver.next() == {"EXTEND_TIMEOUT_USEC": "12500000"}
    assert n.stopping("draining")
    assert path_receiver.next() == {"STOPPING": "1", "STATUS": "draining"}
    assert n.stopping()
    assert path_receiver.next() == {"STOPPING": "1"}
    n.close()


def test_send_folds_newlines_and_rejects_bad_keys(path_receiver: Receiver) -> None:
    n = Notifier(path_receiver.notify_socket)
    assert n.send(STATUS="NVML error:\nGPU is lost", ERRNO=5)
    assert path_receiver.next() == {"STATUS": "NVML error: GPU is lost", "ERRNO": "5"}
    with pytest.raises(ValueError, match="upper case"):
        n.send(ready=1)
    assert n.send() is False  # nothing to say
    n.close()


def test_no_socket_is_a_noop() -> None:
    fds = len(os.listdir("/proc/self/fd"))
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.watchdog_interval_s is None
    assert n.ready("x") is False
    assert n.watchdog() is False
    assert n.status("x") is False
    assert n.stopping() is False
    assert len(os.listdir("/proc/self/fd")) == fds  # no socket was even created
    n.close()


def test_unsupported_address_is_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpu_watchdog.export.sdnotify"):
        n = Notifier("vsock:2:1234")
    assert not n.enabled and n.ready() is False
    assert "not a unix socket path" in caplog.text


@pytest.mark.parametrize("address", ["missing", "stale", "@gpu-watchdog-test/nobody-{}"])
def test_unreachable_socket_never_raises_and_warns_once(address: str, caplog: pytest.LogCaptureFixture) -> None:
    with tempfile.TemporaryDirectory(prefix="sdn") as d:
        if address == "missing":
            address = str(Path(d) / "no-such-socket")
        elif address == "stale":  # a socket file whose owner went away: ECONNREFUSED
            address = str(Path(d) / "stale")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.bind(address)
            s.close()
        else:
            address = address.format(uuid.uuid4().hex)
        n = Notifier(address)
        with caplog.at_level(logging.DEBUG, logger="gpu_watchdog.export.sdnotify"):
            assert n.ready("x") is False
            assert n.watchdog() is False
            assert n.stopping() is False
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, caplog.text
        assert address in warnings[0].getMessage()
        n.close()


def test_warning_rearms_after_recovery(caplog: pytest.LogCaptureFixture) -> None:
    with tempfile.TemporaryDirectory(prefix="sdn") as d:
        path = str(Path(d) / "notify")
        n = Notifier(path)
        with caplog.at_level(logging.DEBUG, logger="gpu_watchdog.export.sdnotify"):
            assert n.watchdog() is False
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(path)
            assert n.watchdog() is True
            sock.close()
            assert n.watchdog() is False
        assert sum(r.levelno == logging.WARNING for r in caplog.records) == 2
        n.close()


def test_watchdog_interval_from_env() -> None:
    me = os.getpid()
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(me)}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(me + 1)}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, pid=7) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None


def test_from_env_unset_environment(path_receiver: Receiver) -> None:
    env = {"NOTIFY_SOCKET": path_receiver.notify_socket, "WATCHDOG_USEC": "20000000",
           "WATCHDOG_PID": str(os.getpid()), "PATH": "/usr/bin"}
    n = Notifier.from_env(env, unset_environment=True)
    assert env == {"PATH": "/usr/bin"}  # children will not inherit them
    assert n.watchdog_interval_s == 10.0
    assert n.ready()
    assert path_receiver.next() == {"READY": "1"}
    n.close()


def test_pinger_thread_pings_while_loop_ticks_and_stops_when_it_wedges(
        path_receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", path_receiver.notify_socket)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # WatchdogSec=0.1s -> ping every 50 ms
    n = Notifier.from_env()
    assert n.watchdog_interval_s == 0.05
    health = LoopHealth(max_age_s=0.3)

    # The "sampling loop": a real thread ticking every 20 ms (every other tick a failed sample, which must not
    # stop the pings) until it wedges on `ticking`.
    ticking = threading.Event()
    ticking.set()
    stop = threading.Event()

    def sampling_loop() -> None:
        ok = True
        while not stop.is_set():
            ticking.wait()  # cleared == wedged (e.g. an NVML call that never returns)
            if ok:
                health.tick_ok()
            else:
                health.tick_failed("NVML lost")
            ok = not ok
            time.sleep(0.02)

    loop = threading.Thread(target=sampling_loop, daemon=True)
    loop.start()
    n.ready("up")
    assert path_receiver.next() == {"READY": "1", "STATUS": "up"}
    pinger = Pinger(health, n.watchdog, n.watchdog_interval_s).start()
    try:
        healthy = path_receiver.drain(1.5)
        assert len(healthy) >= 5, healthy  # ~30 expected at 50 ms; 5 leaves room for a loaded machine
        assert all(m == {"WATCHDOG": "1"} for m in healthy)

        ticking.clear()  # the loop wedges
        time.sleep(health.max_age_s + 0.5)
        path_receiver.drain(0.05)  # pings sent before the age ran out
        withheld_before = pinger.pings_withheld
        assert path_receiver.drain(1.0) == []  # no pings: systemd would now kill and restart us
        assert pinger.pings_withheld - withheld_before >= 5

        ticking.set()  # the loop recovers
        assert len(path_receiver.drain(1.5)) >= 5
    finally:
        pinger.stop()
        stop.set()
        ticking.set()
        loop.join(2)
        n.close()
    assert not pinger.is_alive()


def test_pinger_messages_carry_main_pid(path_receiver: Receiver) -> None:
    """NotifyAccess=main accepts the pinger thread: a thread's datagrams carry the process pid."""
    n = Notifier(path_receiver.notify_socket)
    health = LoopHealth(max_age_s=60)
    health.tick_ok()
    pinger = Pinger(health, n.watchdog, 0.05).start()
    try:
        got = path_receiver.recv()
        assert got is not None
        assert got == ({"WATCHDOG": "1"}, os.getpid())
    finally:
        pinger.stop()
        n.close()
