"""Does a blocked thread wait with a timeout? Read from ``/proc/PID/task/TID/syscall`` (pure parsing here).

A thread blocked in a system call that carries a timeout wakes by itself: a ``time.sleep`` (``clock_nanosleep``),
a ``poll``/``select``/``epoll_wait`` with a timeout, a futex wait with a timeout (Python's ``Event.wait(5)``,
``Queue.get(timeout=…)``, a DataLoader's 5 s liveness poll). Such a thread is *waiting* (a polling loop), not
hung. A wait without one (``Event.wait()``, ``lock.acquire()``, ``socket.recv()``, ``subprocess.wait()``) only
ends when someone else acts.

The file reads ``NR ARG1 … ARG6 SP PC`` while the thread is in a call (``running`` or ``-1 …`` otherwise). Which
argument is the timeout, and what "none" looks like, is per call (man 2 poll, select, epoll_wait, futex,
nanosleep): an int of milliseconds where -1 is infinite, or a pointer where NULL is infinite. Numbers are the
kernel's syscall tables for x86_64 and aarch64 (asm-generic); other machines answer "unknown" (None).
"""

from __future__ import annotations

import platform
import struct
import time

# name: (argument index from 0, kind) — "ms": int milliseconds, < 0 infinite; "ptr": NULL infinite; "always".
_TIMEOUT_ARG = {
    "nanosleep": (0, "always"), "clock_nanosleep": (0, "always"),
    "poll": (2, "ms"), "epoll_wait": (3, "ms"), "epoll_pwait": (3, "ms"),
    "select": (4, "ptr"), "pselect6": (4, "ptr"), "ppoll": (2, "ptr"), "epoll_pwait2": (3, "ptr"),
    "futex": (3, "ptr"),
}
_X86_64 = {35: "nanosleep", 230: "clock_nanosleep", 7: "poll", 232: "epoll_wait", 281: "epoll_pwait",
           23: "select", 270: "pselect6", 271: "ppoll", 441: "epoll_pwait2", 202: "futex"}
_AARCH64 = {101: "nanosleep", 115: "clock_nanosleep", 22: "epoll_pwait", 72: "pselect6", 73: "ppoll",
            441: "epoll_pwait2", 98: "futex"}
_TABLES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}
# futex operations whose 4th argument is a timeout (the others use it as a count: FUTEX_WAKE, REQUEUE, …).
_FUTEX_WAITS = {0, 9, 11}  # FUTEX_WAIT, FUTEX_WAIT_BITSET, FUTEX_WAIT_REQUEUE_PI
_FUTEX_CMD_MASK = 0x7F  # without FUTEX_PRIVATE_FLAG (128) and FUTEX_CLOCK_REALTIME (256)


def syscall_name(text: str, machine: str | None = None) -> str | None:
    """The name of the call a ``/proc/…/syscall`` line shows, when it is one this module knows."""
    parts = text.split()
    if not parts or not parts[0].isdigit():
        return None
    table = _TABLES.get((machine or platform.machine()).lower(), {})
    return table.get(int(parts[0]))


def timed_wait(text: str, machine: str | None = None) -> bool | None:
    """True: the thread sits in a call that ends by itself (a timeout); False: in a known wait without one;
    None: not in a call this module knows (running, reading, another call), or the line is unreadable."""
    call = _parse(text, machine)
    if call is None:
        return None
    name, args = call
    kind = _TIMEOUT_ARG[name][1]
    value = args[_TIMEOUT_ARG[name][0]]
    if kind == "always":
        return True
    if name == "futex" and (args[1] & _FUTEX_CMD_MASK) not in _FUTEX_WAITS:
        return None
    if kind == "ms":
        return value < (1 << 31)  # an int: 0x7fffffff and below are >= 0; -1 reads as 0xffffffff(ffffffff)
    return value != 0


def _parse(text: str, machine: str | None) -> tuple[str, list[int]] | None:
    name = syscall_name(text, machine)
    if name is None:
        return None
    try:
        args = [int(a, 16) for a in text.split()[1:7]]
        args[_TIMEOUT_ARG[name][0]]  # noqa: B018  (present)
    except (ValueError, IndexError):
        return None
    return name, args


# Clocks of absolute deadlines (clock_nanosleep's clockid; a futex's FUTEX_CLOCK_REALTIME flag).
_CLOCKS = {0: time.CLOCK_REALTIME, 1: time.CLOCK_MONOTONIC, 7: getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)}
_FUTEX_CLOCK_REALTIME = 256
_TIMER_ABSTIME = 1


def wait_left_s(pid: int, tid: int, text: str, machine: str | None = None) -> float | None:
    """How long until the call the thread blocks in returns by itself, in seconds (a relative timeout is its whole
    length: the kernel does not rewrite it while waiting); None when it has no timeout or it cannot be read. The
    timeout is read from the thread's memory where the call takes a pointer (``/proc/PID/mem``: the access
    py-spy needs too). A 30-minute collective timeout (gloo, NCCL) or a ``sleep(3600)`` is a wait; a poll every
    few seconds is a loop."""
    if timed_wait(text, machine) is not True:
        return None
    call = _parse(text, machine)
    assert call is not None
    name, args = call
    index, kind = _TIMEOUT_ARG[name]
    if kind == "ms":
        return args[index] / 1000.0
    pointer = args[2] if name == "clock_nanosleep" else args[index]
    seconds = _read_time(pid, pointer, micro=name == "select")
    if seconds is None:
        return None
    absolute_clock = None
    if name == "clock_nanosleep" and args[1] & _TIMER_ABSTIME:
        absolute_clock = _CLOCKS.get(args[0])
    elif name == "futex" and (args[1] & _FUTEX_CMD_MASK) != 0:  # FUTEX_WAIT is relative; the others absolute
        absolute_clock = time.CLOCK_REALTIME if args[1] & _FUTEX_CLOCK_REALTIME else time.CLOCK_MONOTONIC
    if absolute_clock is None:
        return seconds
    return max(0.0, seconds - time.clock_gettime(absolute_clock))


def _read_time(pid: int, pointer: int, micro: bool) -> float | None:
    """A ``struct timespec`` (or ``timeval``) at ``pointer`` in the process's memory, in seconds."""
    if pointer == 0:
        return None
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            f.seek(pointer)
            raw = f.read(16)
    except (OSError, OverflowError, ValueError):
        return None
    if len(raw) != 16:
        return None
    sec, frac = struct.unpack("=qq", raw)
    return sec + frac / (1e6 if micro else 1e9)


def read_syscall(pid: int, tid: int) -> str:
    """A thread's ``/proc/PID/task/TID/syscall`` line; ``""`` when unreadable (another user's process without
    ptrace rights, a thread that ended)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/syscall") as f:
            return f.read().strip()
    except OSError:
        return ""
