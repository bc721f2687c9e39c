"""Ranks handed their rank in code: which processes of a job joined its process group (real sockets, a real
FIFO), and the scanner turning them into ranks — the topmost only, never where the environment names ranks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from gpu_watchdog.model import rank_label, unknown_rank
from gpu_watchdog.sample import group_members
from gpu_watchdog.sample.processes import ProcessScanner
from waiting import wait_for


class Finder:
    """A rank finder (evidence.stacks.spawned_ranks) with fixed answers; ``gives_up``: on every process it has none
    for."""

    def __init__(self, ranks: dict[int, int] | None = None, gives_up: bool = False, fail: bool = False) -> None:
        self.ranks, self.gives_up, self.fail = dict(ranks or {}), gives_up, fail
        self.asked: list[int] = []

    def __call__(self, pid: int, create_time: float) -> int | None:
        if self.fail:
            pytest.fail(f"asked for pid {pid}")
        self.asked.append(pid)
        return self.ranks.get(pid)

    def gave_up(self, pid: int, create_time: float) -> bool:
        return self.gives_up and pid not in self.ranks

    def why(self, pid: int) -> str:
        return "no frame names a rank"

# A job shaped like mp.spawn without torch: the main process starts "ranks" that hand their rank around in code.
# The first hosts the store (listens, connects to itself), the next connect to it, "loner" connects nowhere, and
# "forker" connects, then forks a child that inherits the socket (a DataLoader worker).
JOB = r"""
import os, socket, subprocess, sys, time
role = sys.argv[1] if len(sys.argv) > 1 else "main"
if role == "main":
    port_file = sys.argv[2]
    kids = [subprocess.Popen([sys.executable, __file__, r, port_file]) for r in ("store",)]
    while not os.path.exists(port_file):
        time.sleep(0.05)
    kids += [subprocess.Popen([sys.executable, __file__, r, port_file]) for r in ("client", "loner", "forker")]
    time.sleep(120)
elif role == "store":
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8)
    me = socket.create_connection(srv.getsockname()); peer, _ = srv.accept()
    open(sys.argv[2] + ".tmp", "w").write(str(srv.getsockname()[1])); os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    conns = []
    while True:
        conns.append(srv.accept())
elif role in ("client", "forker"):
    c = socket.create_connection(("127.0.0.1", int(open(sys.argv[2]).read())))
    if role == "forker" and os.fork() == 0:
        time.sleep(120)
    time.sleep(120)
else:
    time.sleep(120)
"""


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, int]]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_PORT", "SLURM_PROCID")}
    env["GPU_WATCHDOG_JOB_ID"] = "spawned"  # as `launch` sets it
    proc = subprocess.Popen([sys.executable, str(script), "main", str(tmp_path / "port")], env=env,
                            start_new_session=True)
    try:
        def roles() -> dict[str, int] | None:
            out = {}
            for c in psutil.Process(proc.pid).children(recursive=True):
                argv = c.cmdline()
                role = argv[2] if len(argv) > 2 and argv[1] == str(script) else ""
                out[role if role not in out else role + "-child"] = c.pid
            return out if len(out) == 5 and all(group_members.socket_inodes(out[r]) for r in ("client", "forker",
                                                                                             "forker-child")) else None
        yield proc, wait_for(roles, 30, "the job's processes and their connections")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_processes_connected_to_a_port_of_the_job_joined_and_the_others_did_not(job) -> None:
    proc, pids = job
    pool = [proc.pid, *pids.values()]
    members = group_members.joined(pool, pool, {})
    assert set(members) == {pids["store"], pids["client"], pids["forker"], pids["forker-child"]}
    assert members[pids["forker-child"]] <= members[pids["forker"]]  # the fork holds its parent's sockets
    assert proc.pid not in members and pids["loner"] not in members


def test_a_connection_to_the_master_port_counts_where_the_store_is_elsewhere(tmp_path: Path) -> None:
    """One rank per node: the store listens on another node (here: this test process, outside the pool)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    client = subprocess.Popen([sys.executable, "-c", f"import socket, time; c = socket.create_connection(("
                               f"'127.0.0.1', {port})); time.sleep(60)"])
    try:
        peer, _ = srv.accept()
        wait_for(lambda: group_members.socket_inodes(client.pid) or None, 10, "the client's socket")
        assert group_members.joined([client.pid], [client.pid], {}) == {}
        assert set(group_members.joined([client.pid], [client.pid], {client.pid: {"MASTER_PORT": str(port)}})) \
            == {client.pid}
        assert group_members.joined([client.pid], [client.pid], {client.pid: {"MASTER_PORT": "x"}}) == {}
        peer.close()
    finally:
        client.kill()
        client.wait()
        srv.close()


def test_an_nccl_rank_names_its_rank_in_its_dump_pipe(tmp_path: Path) -> None:
    stem = str(tmp_path / "fr-pipe-")
    os.mkfifo(stem + "3.pipe")
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY | "
                               "os.O_NONBLOCK); print(1, flush=True); time.sleep(60)", stem + "3.pipe"],
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline()
        assert group_members.pipe_rank(holder.pid, stem) == 3
        assert group_members.pipe_rank(holder.pid, str(tmp_path / "other-")) is None
        assert group_members.pipe_rank(holder.pid, "") is None
        assert group_members.pipe_rank(os.getpid(), stem) is None
    finally:
        holder.kill()
        holder.wait()


def _ranks(scanner: ProcessScanner) -> dict[int, int]:
    samples, _ = scanner.sample()
    return {s.pid: s.job.rank for s in samples if s.is_rank and s.job is not None and s.job.rank is not None}


def test_the_scanner_makes_the_topmost_members_ranks_once_their_rank_is_known(job) -> None:
    proc, pids = job
    finder = Finder({pids["store"]: 0, pids["client"]: 1})  # "forker"'s rank is not learned (yet)
    known, asked = finder.ranks, finder.asked
    scanner = ProcessScanner(root_pid=proc.pid)
    scanner.rank_finder = finder
    ranks = wait_for(lambda: _ranks(scanner) or None, 10, "ranks")
    assert ranks == {pids["store"]: 0, pids["client"]: 1}
    assert {s.job.job_id for s in scanner.sample()[0] if s.is_rank} == {"spawned"}
    assert scanner.unranked == (pids["forker"],)  # its fork is its work, never a member of its own
    assert scanner.rankless == tuple(sorted((proc.pid, pids["loner"])))
    assert pids["forker-child"] not in asked and proc.pid not in asked
    known[pids["forker"]] = 2
    assert _ranks(scanner) == {pids["store"]: 0, pids["client"]: 1, pids["forker"]: 2}
    assert scanner.unranked == ()
    asked.clear()
    _ranks(scanner)
    assert asked == []  # a learned rank is kept; nobody is asked again


def test_the_processes_that_may_become_ranks_are_listed_with_what_names_them(job) -> None:
    """Should one die before its rank is known, launch's exit watch names it by this: the member whose rank is not
    learned yet and the process that joined nothing — never the launched command, a rank or a member's fork."""
    proc, pids = job
    finder = Finder({pids["store"]: 0, pids["client"]: 1})
    scanner = ProcessScanner(root_pid=proc.pid)
    scanner.rank_finder = finder
    wait_for(lambda: _ranks(scanner) or None, 10, "ranks")
    listed = scanner.not_yet_ranked
    assert set(listed) == {pids["forker"], pids["loner"]}
    forker, loner = listed[pids["forker"]], listed[pids["loner"]]
    assert forker.joined and forker.may_be_rank and forker.command[2] == "forker" and forker.ray is None
    assert not loner.joined and not loner.may_be_rank
    assert scanner.ray_workers == {}
    finder.ranks[pids["forker"]] = 2
    _ranks(scanner)
    assert set(scanner.not_yet_ranked) == {pids["loner"]}


def test_a_member_no_source_names_is_watched_with_its_rank_unknown(job) -> None:
    """"forker" joined the group, but its live environment names no rank and it is no Ray worker: while the stack
    reader still looks it stays unranked; once it gave up, it is watched all the same, as rank unknown (pid N), never
    a guessed number; the others keep theirs."""
    proc, pids = job
    scanner = ProcessScanner(root_pid=proc.pid)
    finder = scanner.rank_finder = Finder({pids["store"]: 0, pids["client"]: 1}, gives_up=False)
    deadline = time.monotonic() + 11  # past the 10 s after which its Ray facts are final
    while time.monotonic() < deadline:
        assert pids["forker"] not in _ranks(scanner)
        time.sleep(0.5)
    assert scanner.unranked == (pids["forker"],)
    finder.gives_up = True
    ranks = _ranks(scanner)
    assert ranks == {pids["store"]: 0, pids["client"]: 1, pids["forker"]: unknown_rank(pids["forker"])}
    assert rank_label(ranks[pids["forker"]]) == f"rank unknown (pid {pids['forker']})"
    assert scanner.unranked == ()
    assert pids["forker-child"] not in ranks  # its fork is still its work


def test_an_actor_whose_repr_is_logged_after_it_joined_gets_that_rank_not_a_stand_in(job, monkeypatch,
                                                                                      tmp_path: Path) -> None:
    """A Ray actor joins its process group inside ``__init__``; Ray logs the ``__repr__`` naming its rank only once
    ``__init__`` returned. Even with the stack reader given up, the look on which those facts become final must
    take the rank they name (CI once watched both actors of a healthy group as rank unknown)."""
    from gpu_watchdog.sample import processes, ray_node

    proc, pids = job
    logged = False

    def core_worker(pid: int, fd_targets) -> ray_node.CoreWorker | None:
        if pid != pids["forker"]:
            return None
        return ray_node.CoreWorker(pid=pid, worker_id="ab", driver=False, logs_dir=str(tmp_path), grpc_port=1,
                                   actor_id="cd" if logged else "", actor_repr="Trainer(rank=2)" if logged else "",
                                   actor_created=logged)

    monkeypatch.setattr(ray_node, "core_worker", core_worker)
    scanner = ProcessScanner(root_pid=proc.pid)
    scanner.rank_finder = Finder({pids["store"]: 0, pids["client"]: 1}, gives_up=True)

    def forker_unranked() -> bool | None:
        _ranks(scanner)
        return scanner.unranked == (pids["forker"],) or None

    wait_for(forker_unranked, 10, "forker joined, its rank unknown yet")
    monkeypatch.setattr(processes, "MEMBER_RECHECK_S", 1e9)  # no look at the candidates reads the facts first
    _ranks(scanner)
    logged = True
    assert _ranks(scanner)[pids["forker"]] == 2


def test_a_ray_worker_keeps_what_its_log_told_once_its_fds_are_gone(job, monkeypatch, tmp_path: Path) -> None:
    """A worker that ended is a zombie until the raylet reaps it, and a zombie lists no fds, its log among them: the
    facts read while it lived stay (CI named a killed actor by its pid alone, its actor lost on the last look)."""
    from gpu_watchdog.sample import ray_node

    proc, pids = job
    alive = True

    def core_worker(pid: int, fd_targets) -> ray_node.CoreWorker | None:
        if pid != pids["forker"] or not alive:
            return None
        return ray_node.CoreWorker(pid=pid, worker_id="ab", driver=False, logs_dir=str(tmp_path), grpc_port=1,
                                   actor_id="cd")  # leased, its __init__ still running: read again each look

    monkeypatch.setattr(ray_node, "core_worker", core_worker)
    scanner = ProcessScanner(root_pid=proc.pid)
    scanner.rank_finder = Finder({pids["store"]: 0, pids["client"]: 1})

    def forker_known() -> bool | None:
        _ranks(scanner)
        listed = scanner.not_yet_ranked.get(pids["forker"])
        return listed is not None and listed.ray is not None or None

    wait_for(forker_known, 10, "forker joined, its Ray facts read")
    alive = False
    _ranks(scanner)
    listed = scanner.not_yet_ranked[pids["forker"]]
    assert listed.ray is not None and listed.ray.actor_id == "cd" and listed.ray_actor


# A hand-written mp.Process loop whose parent is rank 0: it hosts the store, connects to it, then starts ranks 1
# and 2, which connect on their own.
RANK0_STARTS = r"""
import socket, subprocess, sys, time
if len(sys.argv) > 1:
    c = socket.create_connection(("127.0.0.1", int(sys.argv[1]))); time.sleep(120)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8)
me = socket.create_connection(srv.getsockname()); conns = [srv.accept()]
kids = [subprocess.Popen([sys.executable, __file__, str(srv.getsockname()[1])]) for _ in range(2)]
while True:
    conns.append(srv.accept())
"""


def test_ranks_a_rank_starts_itself_are_ranks_not_its_workers(tmp_path: Path) -> None:
    """Below a member, a process with connections of its own is a rank (a DataLoader worker holds only its
    parent's sockets)."""
    script = tmp_path / "rank0.py"
    script.write_text(RANK0_STARTS)
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True,
                            env=dict(os.environ, GPU_WATCHDOG_JOB_ID="loop"))
    try:
        def connected() -> list[int] | None:
            kids = [c.pid for c in psutil.Process(proc.pid).children() if group_members.socket_inodes(c.pid)]
            return kids if len(kids) == 2 else None

        kids = wait_for(connected, 30, "the two ranks it starts, connected")
        scanner = ProcessScanner(root_pid=proc.pid)
        order = {proc.pid: 0, kids[0]: 1, kids[1]: 2}
        scanner.rank_finder = Finder(order)

        def three() -> dict[int, int] | None:
            ranks = _ranks(scanner)
            return ranks if len(ranks) == 3 else None

        assert wait_for(three, 10, "three ranks") == order
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_where_the_environment_names_a_rank_nobody_is_made_a_member(tmp_path: Path) -> None:
    """torchrun's agent hosts the store its ranks connect to: with RANK in the ranks' environment, only they are
    ranks, and the finder is never asked."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    code = (f"import socket, subprocess, sys, os, time\nc = socket.create_connection(('127.0.0.1', {port}))\n"
            "if len(sys.argv) < 2:\n"
            "    subprocess.Popen([sys.executable, __file__, 'w'], env=dict(os.environ, RANK='0', WORLD_SIZE='1'))\n"
            "time.sleep(60)\n")
    script = tmp_path / "agent.py"
    script.write_text(code)
    agent = subprocess.Popen([sys.executable, str(script)], start_new_session=True,
                             env=dict(os.environ, GPU_WATCHDOG_JOB_ID="agent"))
    conns = [srv.accept()[0], srv.accept()[0]]
    try:
        scanner = ProcessScanner(root_pid=agent.pid)
        scanner.rank_finder = Finder(fail=True)
        deadline = time.monotonic() + 5
        ranks: dict[int, int] = {}
        while time.monotonic() < deadline and not ranks:
            ranks = _ranks(scanner)
        assert list(ranks.values()) == [0] and agent.pid not in ranks
        assert scanner.unranked == () and scanner.rankless == ()
    finally:
        for c in conns:
            c.close()
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        srv.close()
