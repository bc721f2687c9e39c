"""The stop ladder: SIGTERM to every process of the job, a grace period, SIGKILL, then proof they are gone.
A stopped process (SIGSTOP, a debugger's job-control stop) gets SIGCONT first, or SIGTERM would wait with it.

Only processes that belong to the job are ever signalled, and each is checked against the create time it had
when it was identified as part of the job, so a recycled pid is never hit.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class JobProcess:
    pid: int
    create_time: float


@dataclass(frozen=True)
class StopResult:
    ok: bool
    terminated: tuple[int, ...]  # exited after SIGTERM
    killed: tuple[int, ...]  # needed SIGKILL
    survivors: tuple[int, ...]  # still there after SIGKILL (D state, ...)
    detail: str


def job_tree(root_pid: int) -> list[JobProcess]:
    """The root process and every descendant, with their create times, read now."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in procs:
        try:
            out.append(JobProcess(p.pid, p.create_time()))
        except psutil.NoSuchProcess:
            continue
    return out


def alive(jp: JobProcess) -> bool:
    try:
        p = psutil.Process(jp.pid)
        return p.create_time() == jp.create_time and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stopped(jp: JobProcess) -> bool:
    try:
        p = psutil.Process(jp.pid)
        return p.create_time() == jp.create_time and p.status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def send_signal(jp: JobProcess, sig: int) -> bool:
    """Signal one job process if it is still the same process; False when it is gone or was replaced."""
    try:
        p = psutil.Process(jp.pid)
        if p.create_time() != jp.create_time:
            return False  # the pid was reused: not ours
        p.send_signal(sig)
        return True
    except psutil.NoSuchProcess:
        return False


def stop_processes(procs: Iterable[JobProcess], grace_s: float, poll_s: float = 0.1,
                   reap: Callable[[], object] | None = None) -> StopResult:
    """SIGTERM all, wait up to ``grace_s``, SIGKILL the rest, wait briefly, report.

    ``reap`` is called while waiting so that a parent (the launcher) can collect its own child's exit status;
    otherwise that child would sit as a zombie and look alive.
    """
    procs = [p for p in procs if p.pid != os.getpid()]
    for p in procs:
        if _stopped(p):  # a stopped process (SIGSTOP, job control) acts on SIGTERM only once continued
            send_signal(p, signal.SIGCONT)
        send_signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in procs):
        if reap:
            reap()
        time.sleep(poll_s)
    after_term = [p for p in procs if alive(p)]
    for p in after_term:
        send_signal(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(p) for p in after_term):
        if reap:
            reap()
        time.sleep(poll_s)
    survivors = tuple(p.pid for p in after_term if alive(p))
    terminated = tuple(p.pid for p in procs if p not in after_term)
    killed = tuple(p.pid for p in after_term if p.pid not in survivors)
    detail = f"{len(terminated)} exited on SIGTERM, {len(killed)} needed SIGKILL"
    if survivors:
        detail += f", {len(survivors)} still alive: {','.join(map(str, survivors))}"
    return StopResult(not survivors, terminated, killed, survivors, detail)


def wait_memory_released(pids: set[int], gpu_pids: Callable[[], set[int]], timeout_s: float,
                         poll_s: float = 0.5) -> bool:
    """Wait until no GPU lists any of ``pids`` (their memory is freed) — required before a restart."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not pids & gpu_pids():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
