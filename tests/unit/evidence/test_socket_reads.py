"""Reads from a socket are judged by their bytes, whatever library does the reading: real urllib clients against a
real HTTP server, dumped twice with the real py-spy. A read without a timeout whose bytes stopped is stuck (as
``socket.recv()`` is); one whose bytes trickle in is alive; one with a timeout ends by itself and is alive."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_watchdog.evidence.stacks.classify import SOCKET_OP
from gpu_watchdog.evidence.stacks.collect import classify_results
from gpu_watchdog.evidence.stacks.diagnosis import rank_moved
from gpu_watchdog.evidence.stacks.dump import dump_stacks
from gpu_watchdog.model import RankStack
from waiting import wait_for

SERVER = r"""
import socket, sys, threading, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0)); srv.listen(16)
print(srv.getsockname()[1], flush=True)
def serve(c):
    request = c.recv(65536).decode()
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\nabc")
    if "/trickle" in request:
        while True:
            time.sleep(0.3)
            c.sendall(b"x")
    time.sleep(3600)  # /stall: headers and three bytes, then nothing
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""
CLIENT = "import sys, urllib.request\nargs = {'timeout': 60} if len(sys.argv) > 2 else {}\n" \
         "urllib.request.urlopen(sys.argv[1], **args).read()\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("http") / "server.py"
    path.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{proc.stdout.readline().strip()}"
    finally:
        proc.kill()
        proc.wait()


def _two_dumps(tmp_path: Path, url: str, *extra: str) -> tuple[RankStack, RankStack]:
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    proc = subprocess.Popen([sys.executable, str(client), url, *extra])
    try:
        def reading_the_body() -> RankStack | None:
            # The detector's first dump comes after the job went quiet, never while the status line is still
            # arriving (a dump then sees another frame and moving counters: the flake CI found).
            stacks = classify_results({0: dump_stacks([proc.pid], timeout_s=20, nonblocking=True)[0]})
            if not stacks or not stacks[0].where.startswith("SocketIO.readinto"):
                return None
            return None if "_read_status" in stacks[0].signature else stacks[0]

        a = wait_for(reading_the_body, 30, "the client reading the body")
        time.sleep(3.0)  # stack_confirm_gap_s
        b = classify_results({0: dump_stacks([proc.pid], timeout_s=20, nonblocking=True)[0]})[0]
        return a, b
    finally:
        proc.kill()
        proc.wait()


def test_a_urllib_read_without_a_timeout_whose_bytes_stopped_is_stuck(server: str, tmp_path: Path) -> None:
    a, b = _two_dumps(tmp_path, f"{server}/stall")
    assert (b.state, b.op) == ("data_wait", SOCKET_OP) and not b.timed, b
    assert not rank_moved(a, b)


def test_a_urllib_read_whose_bytes_trickle_in_is_alive(server: str, tmp_path: Path) -> None:
    a, b = _two_dumps(tmp_path, f"{server}/trickle")
    assert (b.state, b.op) == ("data_wait", SOCKET_OP), b
    assert rank_moved(a, b)


def test_a_urllib_read_with_a_timeout_ends_by_itself_and_is_alive(server: str, tmp_path: Path) -> None:
    a, b = _two_dumps(tmp_path, f"{server}/stall", "--timeout")
    assert (b.state, b.op) == ("data_wait", SOCKET_OP) and b.timed, b
    assert rank_moved(a, b)
