"""The job never outlives ``launch``: a small guardian process stops it if ``launch`` dies, even by SIGKILL —
and even when torchrun dies with it.

``launch`` starts the job in a session of its own and, beside it, a guardian (``python -m
gpu_watchdog.launch.guardian``, in another session, so a signal to the job or to the terminal never reaches it)
whose stdin is a pipe that only ``launch`` holds. When ``launch`` ends the run normally it writes ``done`` first and
the guardian exits. When ``launch`` dies any other way the pipe closes with nothing written: the guardian stops
every process of the job with the usual ladder — SIGCONT + SIGTERM, ``grace_s``, SIGKILL — and exits.

Every process of the job: torchrun (2.13) starts each rank in a session of its own, and when torchrun dies with
``launch`` (both SIGKILLed: an OOM kill, ``kill -9`` of the process group) its ranks are re-parented to init, out
of any tree that starts at torchrun. So while it waits the guardian keeps the job's process tree itself: every
``SCAN_S`` it reads /proc and adds each process whose parent, or whose session leader, is already in the job
(checked by start time: the parent's or leader's recorded start, and a start no earlier than it), starting from
the job's first process. A process it once saw stays in the job after its parent dies. At the stop it scans once
more (children started since the last scan), runs the ladder, and repeats for anything the ladder's grace let
start. Nothing else is ever signalled: processes are matched by pid *and* start time, so a recycled pid is never
hit.

The tree can miss a process that started and lost its parent between two scans (torchrun SIGKILLed a moment after
it spawned a rank in a session of its own). Every process of the run also carries the run's identity in its
environment — the control directory and run number ``launch`` sets for the job, inherited by everything it
starts — so at the stop the guardian also takes each process that started no earlier than the job and whose
environment carries that identity.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Callable

from gpu_watchdog.sample.proc_stat import ProcStat, read_stat, scan

DONE = b"done\n"
SCAN_S = 1.0  # how often the guardian re-reads the job's process tree while launch runs




def environ(pid: int) -> dict[str, str]:
    """A process's environment as it was started ({} when unreadable: gone, or another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def start_token(pid: int) -> float | None:
    st = read_stat(pid)
    return st.start if st else None


class JobTree:
    """The job's processes, pid → start token, grown from its first process; a member whose parent dies stays in
    (a re-parented rank), one whose pid now names another process (a different start) is dropped."""

    def __init__(self, root_pid: int, root_start: float, marker: dict[str, str] | None = None) -> None:
        self.members: dict[int, float] = {root_pid: root_start}
        self.root_start = root_start
        self.marker = dict(marker or {})  # environment entries every process of this run carries

    def adopt_marked(self, procs: dict[int, ProcStat],
                     read_env: Callable[[int], dict[str, str]] = environ) -> None:
        """Add each process that started no earlier than the job and carries the run's marker in its environment:
        the ones the tree missed (re-parented between two scans)."""
        if not self.marker:
            return
        me = os.getpid()
        for st in procs.values():
            if st.pid in self.members or st.pid == me or st.start < self.root_start:
                continue
            env = read_env(st.pid)
            if env and all(env.get(k) == v for k, v in self.marker.items()):
                self.members[st.pid] = st.start

    def grow(self, procs: dict[int, ProcStat]) -> None:
        """Add every process whose parent or session leader is a member (the very process: the recorded start)
        and that started no earlier than it, transitively. A member that exited still vouches for its session:
        Linux does not reuse a pid while a session or group still carries it; once reused, the pid shows with
        another start and is dropped first."""
        self.members = {pid: t for pid, t in self.members.items() if pid not in procs or procs[pid].start == t}
        owned: dict[int, list[ProcStat]] = {}  # parent or session leader → the processes it vouches for
        for st in procs.values():
            owned.setdefault(st.ppid, []).append(st)
            if st.sid != st.pid:
                owned.setdefault(st.sid, []).append(st)
        todo = list(self.members)
        me = os.getpid()
        while todo:
            owner = todo.pop()
            t = self.members[owner]
            for st in owned.get(owner, ()):
                if st.pid not in self.members and st.start >= t and st.pid != me:
                    self.members[st.pid] = st.start
                    todo.append(st.pid)

    def stop(self, grace_s: float, rounds: int = 3) -> int:
        """The stop ladder over every member, then over what started meanwhile; returns how many were stopped."""
        import psutil

        from gpu_watchdog.act.stopper import JobProcess, stop_processes

        stopped: set[tuple[int, float]] = set()
        for _ in range(rounds):
            procs_now = scan()
            self.grow(procs_now)
            self.adopt_marked(procs_now)
            procs = []
            for pid, token in self.members.items():
                if (pid, token) in stopped:
                    continue
                try:
                    p = psutil.Process(pid)
                    create_time = p.create_time()
                except psutil.Error:
                    continue
                if start_token(pid) == token:  # still the very process the tree recorded
                    procs.append(JobProcess(pid, create_time))
                    stopped.add((pid, token))
            if not procs:
                break
            stop_processes(procs, grace_s)
        return len(stopped)


class Guardian:
    """The launcher's side: start the guardian for one run's job, release it when the run ends normally."""

    def __init__(self, job_pid: int, grace_s: float, marker: dict[str, str] | None = None) -> None:
        token = start_token(job_pid)
        self._proc: subprocess.Popen[bytes] | None = None
        if token is None:  # the job is already gone: nothing to guard
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_watchdog.launch.guardian", str(job_pid), repr(token), repr(grace_s),
             json.dumps(marker or {})],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,  # stderr: launch's, for its one line
            start_new_session=True, close_fds=True, cwd="/")

    def release(self) -> None:
        """The run ended under the launcher's control: the guardian leaves the job alone."""
        proc, self._proc = self._proc, None
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(DONE)
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_launch(tree: JobTree, scan_s: float = SCAN_S) -> bytes:
    """Read the pipe from ``launch`` until it closes, growing the job's tree every ``scan_s``; what was written."""
    data = b""
    while True:
        try:
            ready, _, _ = select.select([0], [], [], scan_s)
        except InterruptedError:
            continue
        if not ready:
            tree.grow(scan())
            continue
        try:
            chunk = os.read(0, 64)
        except InterruptedError:
            continue
        except OSError:
            return data
        if not chunk:
            return data
        data += chunk


def main(argv: list[str]) -> int:
    job_pid, start, grace_s = int(argv[0]), float(argv[1]), float(argv[2])
    tree = JobTree(job_pid, start, json.loads(argv[3]) if len(argv) > 3 else None)
    tree.grow(scan())
    if wait_for_launch(tree).startswith(DONE):
        return 0
    n = tree.stop(grace_s)
    print(f"gpu-watchdog guardian: launch is gone; stopped {n} process(es) of its job (started as pid {job_pid})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
