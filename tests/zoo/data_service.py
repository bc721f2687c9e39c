"""A local data service for the zoo's programs: each connection asks for a shard with one line, ``slow RANK``
(1 KiB every ``--every`` seconds, ``--chunks`` of them: a slow reader's input) or ``stall RANK`` (accepted, never
answered: a reader blocked for good). Prints ``HOST:PORT`` on its first line and serves until killed or
``--lifetime-s`` passes.

    python tests/zoo/data_service.py --every 2 --chunks 22
"""

from __future__ import annotations

import argparse
import socket
import threading
import time


def serve(conn: socket.socket, every: float, chunks: int) -> None:
    with conn:
        request = conn.makefile("rb").readline().decode().split()
        if not request or request[0] != "slow":
            time.sleep(3600)  # "stall": never answer
            return
        for _ in range(chunks):
            time.sleep(every)
            conn.sendall(b"x" * 1024)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--every", type=float, default=2.0)
    p.add_argument("--chunks", type=int, default=22)
    p.add_argument("--lifetime-s", type=float, default=600.0)
    args = p.parse_args()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    host, port = srv.getsockname()
    print(f"{host}:{port}", flush=True)
    threading.Timer(args.lifetime_s, lambda: __import__("os")._exit(0)).start()
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn, args.every, args.chunks), daemon=True).start()


if __name__ == "__main__":
    main()
