"""A local stand-in for NCCL's RAS client socket, and reports written the way NCCL writes them.

The server follows NCCL's ``src/ras/client_support.cc``: one command per line (``\\r`` tolerated), case-insensitive;
``CLIENT PROTOCOL n`` → ``SERVER PROTOCOL 2``; ``TIMEOUT s`` → ``OK`` or ``ERROR: Invalid timeout value s``;
``SET FORMAT json|text`` → ``OK`` (an old server, ``json=False``: ``ERROR: Unknown command ...``); ``STATUS`` /
``VERBOSE STATUS`` → the report, then it closes the connection. ``hang=True`` accepts and never answers.

``report_json`` prints a report with NCCL's own layout (``jsonWriteHeader`` … ``jsonWriteFooter``);
``nccl_2289=True`` drops the comma after a missing rank's ``nvml_dev`` as NCCL 2.28.9 does.

``RasStandIn(source=fn)`` builds the JSON report at each STATUS by calling ``fn()`` instead of serving fixed
``reports``, so the counts can follow a running job (``nccl_like_state.ras_report`` reads tests/jobs/nccl_like.py's
per-rank files); every report served is kept in ``served``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

COLLECTIVES = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")  # ncclFuncToString order


@dataclass
class Rank:
    rank: int
    host: str = "10.0.0.1"
    pid: int = 1000
    cuda_dev: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    init_state: int = 0
    async_error: int = 0
    abort_flag: bool = False


@dataclass
class Missing:
    rank: int
    host: str = "10.0.0.2"
    pid: int = 2000
    cuda_dev: int = 0
    unresponsive: bool = True
    dead: bool = False


@dataclass
class Comm:
    hash: int
    size: int
    ranks: Sequence[Rank]
    missing: Sequence[Missing] = ()


def _b(v: bool) -> str:
    return "true" if v else "false"


def report_json(comms: Sequence[Comm], nccl_2289: bool = False, version: str = "2.28.9",
                timeouts: int = 0) -> str:
    out = ["{\n", f'  "nccl_version": "{version}",\n', '  "cuda_runtime_version": 12080,\n',
           '  "cuda_driver_version": 12080,\n', '  "timestamp": "2026-11-23 16:40:00",\n',
           f'  "communicators_count": {len(comms)},\n', '  "communicators": [\n']
    for ci, c in enumerate(comms):
        if ci:
            out.append(",\n")
        out += ["    {\n", f'      "hash": "0x{c.hash:x}",\n', f'      "secondary_hash": "0x{c.hash + 1:x}:0x99",\n',
                f'      "size": {c.size},\n', f'      "ranks_count": {len(c.ranks)},\n',
                f'      "missing_ranks_count": {len(c.missing)},\n', '      "ranks": [\n']
        for ri, r in enumerate(c.ranks):
            if ri:
                out.append(",\n")
            out += ["        {\n", f'          "rank": {r.rank},\n', f'          "host": "{r.host}",\n',
                    f'          "pid": {r.pid},\n', f'          "cuda_dev": {r.cuda_dev},\n',
                    f'          "nvml_dev": {r.cuda_dev},\n', '          "status": {\n',
                    f'            "init_state": {r.init_state},\n', f'            "async_error": {r.async_error},\n',
                    '            "finalize_called": false,\n', '            "destroy_flag": false,\n',
                    f'            "abort_flag": {_b(r.abort_flag)}\n', "          },\n",
                    '          "collective_counts": {\n']
            for oi, op in enumerate(COLLECTIVES):
                sep = "," if oi < len(COLLECTIVES) - 1 else ""
                out.append(f'            "{op}": {r.counts.get(op, 0)}{sep}\n')
            out += ["          }\n", "        }"]
        out += ["\n      ],\n", '      "missing_ranks": [\n']
        for mi, m in enumerate(c.missing):
            if mi:
                out.append(",\n")
            comma = "" if nccl_2289 else ","
            out += ["        {\n", f'          "rank": {m.rank},\n', f'          "host": "{m.host}",\n',
                    f'          "pid": {m.pid},\n', f'          "cuda_dev": {m.cuda_dev},\n',
                    f'          "nvml_dev": {m.cuda_dev}{comma}\n', '          "status": {\n',
                    f'            "unresponsive": {_b(m.unresponsive)},\n',
                    f'            "considered_dead": {_b(m.dead)}\n', "          }\n", "        }"]
        out += ["\n      ]\n", "    }"]
    out += ["\n  ],\n", '  "ras": {\n', '    "collection_time_sec": 0.012,\n',
            f'    "timeouts_count": {timeouts}\n', "  }\n", "}\n"]
    return "".join(out)


# What an NCCL 2.24-2.28.6 server prints (text only), abridged from client_support.cc's format strings.
OLD_TEXT_REPORT = """NCCL version 2.26.2 compiled with CUDA 12.8
CUDA runtime version 12080, driver version 12080

Job summary
===========

  Nodes  Processes         GPUs  Processes     GPUs
(total)   per node  per process    (total)  (total)
      2          4            1          8        8

Communicators... (0.01s)
=============

Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors
    #  in group  per comm  per node  per comm  in group
    0         1         2         4         8         7   RUNNING  INCOMPLETE

Errors
======

DEAD
  1 job process is considered dead (unreachable via the RAS network)
  Process 4242 on node 10.0.0.2 managing GPU 3

#0-0 (00000000c0ffee01) INCOMPLETE
  Missing communicator data from 1 rank
  Rank 7 -- GPU 3 managed by process 4242 on node 10.0.0.2

Warnings
========

"""


class RasStandIn:
    """Serves ``reports`` (one per connection, the last repeated) on 127.0.0.1, a free port, until closed; with
    ``source``, the JSON report is ``source()`` at each STATUS (``reports`` ignored)."""

    def __init__(self, reports: Sequence[str] = (), *, text: str = OLD_TEXT_REPORT, json: bool = True,
                 hang: bool = False, port: int = 0, source: Callable[[], str] | None = None) -> None:
        self.reports = list(reports)
        self.source = source
        self.served: list[tuple[float, str]] = []  # (wall time, JSON report) of every STATUS answered in JSON
        self.text = text
        self.json = json
        self.hang = hang
        self.commands: list[str] = []
        self.connections = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(16)
        self._sock.settimeout(0.05)  # accept() wakes up to see close()
        self.port = self._sock.getsockname()[1]
        self.addr = f"127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def __enter__(self) -> RasStandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        for c in self._held:
            c.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.connections += 1
            if self.hang:
                self._held.append(conn)  # accepted, never answered
                continue
            threading.Thread(target=self._client, args=(conn, self.connections - 1), daemon=True).start()

    def _report(self, n: int, fmt: str) -> str:
        if fmt == "text" or not (self.reports or self.source):
            return self.text
        report = self.source() if self.source is not None else self.reports[min(n, len(self.reports) - 1)]
        self.served.append((time.time(), report))
        return report

    def _client(self, conn: socket.socket, n: int) -> None:
        fmt = "text"
        buf = b""
        with conn:
            conn.settimeout(10)
            while True:
                try:
                    chunk = conn.recv(4096)
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    raw, _, buf = buf.partition(b"\n")
                    cmd = raw.decode().rstrip("\r")
                    self.commands.append(cmd)
                    low = cmd.lower()
                    if low.startswith("client protocol "):
                        conn.sendall(b"SERVER PROTOCOL 2\n")
                    elif low.startswith("timeout "):
                        value = cmd[len("timeout "):]
                        ok = value.replace(".", "", 1).isdigit()
                        conn.sendall(b"OK\n" if ok else f"ERROR: Invalid timeout value {value}\n".encode())
                    elif low.startswith("set format ") and self.json:
                        want = low[len("set format "):]
                        if want in ("json", "text"):
                            fmt = want
                            conn.sendall(b"OK\n")
                        else:
                            conn.sendall(f"ERROR: Invalid format {cmd[len('set format '):]}\n".encode())
                    elif low in ("status", "verbose status"):
                        conn.sendall(self._report(n, fmt).encode())
                        return  # the server closes after the report
                    else:
                        conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    # A stand-in "rank process" that serves RAS itself, as every NCCL process does:
    #   NCCL_RAS_ADDR=127.0.0.1:PORT python ras_standin.py REPORT_FILE
    import os
    import sys
    import time

    with open(sys.argv[1]) as f:
        report = f.read()
    with RasStandIn([report], port=int(os.environ["NCCL_RAS_ADDR"].rpartition(":")[2])):
        print("ready", flush=True)
        time.sleep(120)
