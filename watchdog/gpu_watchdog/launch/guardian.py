"""The job never outlives ``launch``: a small guardian process stops it if ``launch`` dies, even by SIGKILL.

``launch`` starts the job in a session of its own and, beside it, a guardian (``python -m
gpu_watchdog.launch.guardian``, in another session, so a signal to the job or to the terminal never reaches it)
whose stdin is a pipe that only ``launch`` holds. When ``launch`` ends the run normally it writes ``done`` first and
the guardian exits. When ``launch`` dies any other way the pipe closes with nothing written: the guardian stops
every process of the job's session (torchrun and its ranks stay in it; a rank that left it was already stopped by
``launch`` on its own tick) with the usual ladder — SIGCONT + SIGTERM, ``grace_s``, SIGKILL — and exits. Processes
are matched by session id *and* start time no earlier than the session leader's, so a recycled session id is never
hit.
"""

from __future__ import annotations

import os
import subprocess
import sys

DONE = b"done\n"


def session_members(sid: int, not_before: float) -> list[tuple[int, float]]:
    """(pid, start token) of every process in session ``sid`` started at or after ``not_before`` (clock ticks
    since boot, /proc/PID/stat field 22)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # rest[0] is field 3 (state): session is field 6, start time field 22
        if int(rest[3]) == sid and float(rest[19]) >= not_before and int(name) != os.getpid():
            out.append((int(name), float(rest[19])))
    return out


def start_token(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return float(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def stop_session(sid: int, not_before: float, grace_s: float) -> int:
    """The stop ladder over the session's processes; returns how many there were."""
    import psutil

    from gpu_watchdog.act.stopper import JobProcess, stop_processes

    procs = []
    for pid, _token in session_members(sid, not_before):
        try:
            procs.append(JobProcess(pid, psutil.Process(pid).create_time()))
        except psutil.Error:
            continue
    if procs:
        stop_processes(procs, grace_s)
    return len(procs)


class Guardian:
    """The launcher's side: start the guardian for one run's job, release it when the run ends normally."""

    def __init__(self, job_pid: int, grace_s: float) -> None:
        token = start_token(job_pid)
        self._proc: subprocess.Popen[bytes] | None = None
        if token is None:  # the job is already gone: nothing to guard
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_watchdog.launch.guardian", str(job_pid), repr(token), repr(grace_s)],
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


def main(argv: list[str]) -> int:
    sid, not_before, grace_s = int(argv[0]), float(argv[1]), float(argv[2])
    data = b""
    while True:
        try:
            chunk = os.read(0, 64)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    if data.startswith(DONE):
        return 0
    n = stop_session(sid, not_before, grace_s)
    print(f"gpu-watchdog guardian: launch is gone; stopped {n} process(es) of its job (session {sid})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
