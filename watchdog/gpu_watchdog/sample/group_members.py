"""Which processes of a job joined its process group when no environment says so.

``mp.spawn``, Lightning's ``ddp_spawn``, Accelerate's ``notebook_launcher`` and hand-written ``mp.Process`` loops
pass the rank to ``init_process_group`` in code: no process carries ``RANK``. What every rank of every c10d backend
does carry is TCP: it connects to the job's store (hosted by rank 0, or by the job's own launcher), and gloo and
NCCL's bootstrap connect the ranks to one another. So a process of the job that holds an established TCP connection
to a port another process of the same job listens on — or to ``MASTER_ADDR:MASTER_PORT`` from its environment,
where the store is on another node — has joined the group. A process the ranks fork (a DataLoader worker) inherits
those sockets: only the topmost one counts, as for ``RANK``.

NCCL ranks name their own rank: with the Flight Recorder's dump pipe on (``launch`` turns it on), each rank opens
``<TORCH_NCCL_DEBUG_INFO_PIPE_FILE><rank>.pipe``. Other ranks' numbers are learned from their stacks
(evidence.stacks.spawned_ranks).

Everything here reads /proc of the processes in question only (their network namespace's TCP table, their fds).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Mapping

_ESTABLISHED, _LISTEN = "01", "0A"  # /proc/net/tcp state codes
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")


def fd_targets(pid: int) -> list[str]:
    """What each open fd of ``pid`` points at (``socket:[123]``, a path); empty when unreadable (gone, not ours)."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for name in names:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue  # closed meanwhile
    return out


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` holds open; empty when its fds cannot be read (gone, not ours)."""
    return {int(m.group(1)) for t in fd_targets(pid) if (m := _SOCKET_LINK.fullmatch(t))}


def _port(hex_endpoint: str) -> int:
    return int(hex_endpoint.rsplit(":", 1)[1], 16)


def tcp_sockets(pid: int) -> dict[int, tuple[str, int, int]]:
    """inode → (state, local port, remote port) for every TCP socket (IPv4 and IPv6) of ``pid``'s network
    namespace; empty when unreadable."""
    out: dict[int, tuple[str, int, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            try:
                out[int(parts[9])] = (parts[3], _port(parts[1]), _port(parts[2]))
            except ValueError:
                continue
    return out


def _master_port(env: Mapping[str, str]) -> int | None:
    try:
        port = int(env.get("MASTER_PORT", ""))
    except ValueError:
        return None
    return port if 0 < port < 65536 else None


def joined(candidates: Iterable[int], pool: Iterable[int], envs: Mapping[int, Mapping[str, str]],
           ignored_ports: Collection[int] = ()) -> dict[int, frozenset[int]]:
    """The ``candidates`` that hold an established TCP connection to a port some process of ``pool`` (the job's
    processes, candidates included) listens on, or to the ``MASTER_PORT`` of their own starting environment: pid →
    the inodes of those connections (a forked child holds its parent's). ``ignored_ports``: listeners that are not
    a process group's (Ray's workers' gRPC servers)."""
    candidates = list(candidates)
    if not candidates:
        return {}
    held = {pid: socket_inodes(pid) for pid in set(pool) | set(candidates)}
    if not any(held[c] for c in candidates):
        return {}
    table: dict[int, tuple[str, int, int]] = {}
    for pid in candidates:  # one read per network namespace in practice: the first candidate with sockets
        if held[pid]:
            table = tcp_sockets(pid)
            break
    listening = {table[i][1] for inodes in held.values() for i in inodes
                 if i in table and table[i][0] == _LISTEN} - set(ignored_ports)
    out: dict[int, frozenset[int]] = {}
    for pid in candidates:
        ports = listening | ({p} if (p := _master_port(envs.get(pid, {}))) is not None else set())
        conns = frozenset(i for i in held[pid] if table.get(i, ("", 0, 0))[0] == _ESTABLISHED and table[i][2] in ports)
        if conns:
            out[pid] = conns
    return out


def pipe_rank(pid: int, stem: str) -> int | None:
    """The rank in the name of the Flight Recorder dump pipe ``pid`` holds open (``<stem><rank>.pipe``), or None."""
    if not stem:
        return None
    pattern = re.compile(re.escape(stem) + r"(\d+)\.pipe")
    return next((int(m.group(1)) for t in fd_targets(pid) if (m := pattern.fullmatch(t))), None)


__all__ = ["fd_targets", "joined", "pipe_rank", "socket_inodes", "tcp_sockets"]
