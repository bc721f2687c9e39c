"""The cheap per-rank signal: what a rank's main thread did between two reads, from the kernel's own clocks.

``/proc/PID/task/TID/schedstat`` holds three cumulative counters per thread: nanoseconds on a CPU, nanoseconds
runnable but waiting for one (on a run queue — also while its cgroup's quota throttles it), and timeslices. Between
two reads they split the wall time into *running*, *queued* and, for the rest, *asleep* (blocked: on a lock, a
socket, a pipe, a disk). Reading them and the thread's state and kernel wait channel costs a few tens of µs per
rank: this can run every tick, where a stack sample (py-spy, ~10 ms per rank) cannot.

Asleep, the wait channel read at the end of the interval says on what — a sample, as a stack is: a futex is where a
rank's main thread waits for a gloo collective's work (or a lock), a pipe or socket read is its input, D or a
filesystem channel is I/O (``classify.kernel_wait``), a timer is its own sleep. On a GPU rank the device says more
than the host: NCCL's waiting ranks spin on the CPU and on the GPU alike, so the GPU's signature decides
(``detector.device_signature``: ``spin`` is a wait in a collective kernel, ``busy`` its own work).

Reading: standard library only; an unreadable or vanished thread is None, never an exception (proc_stat's convention).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpu_watchdog.evidence.stacks.classify import kernel_wait
from gpu_watchdog.sample import proc_stat

PROC = proc_stat.PROC


@dataclass(frozen=True, slots=True)
class ThreadClock:
    """One read of a thread's scheduler counters."""

    t: float  # monotonic seconds at the read
    tid: int  # the thread read
    state: str  # R, S, D, … (proc(5))
    run_s: float  # cumulative seconds on a CPU
    queued_s: float  # cumulative seconds runnable but not running (run queue, throttled cgroup)
    wchan: str  # the kernel wait channel while asleep ("0" or "" when running or unknown)


@dataclass(frozen=True, slots=True)
class ThreadShares:
    """Between two reads of one thread: the share of the wall time it ran, waited for a CPU, and slept."""

    seconds: float
    running: float
    queued: float

    @property
    def asleep(self) -> float:
        return max(0.0, 1.0 - self.running - self.queued)


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.read(fd, 256).decode(errors="replace")
        finally:
            os.close(fd)
    except OSError:
        return None


def read_clock(pid: int, t: float, tid: int | None = None, root: str = PROC) -> ThreadClock | None:
    """Thread ``tid`` of ``pid`` (its main thread by default) at monotonic ``t``; None when it cannot be read."""
    tid = pid if tid is None else tid
    st = proc_stat.read_stat(pid, tid, root=root)
    sched = _read(f"{root}/{pid}/task/{tid}/schedstat")
    if st is None or sched is None:
        return None
    fields = sched.split()
    try:
        run_ns, queued_ns = int(fields[0]), int(fields[1])
    except (IndexError, ValueError):
        return None
    wchan = _read(f"{root}/{pid}/task/{tid}/wchan") or ""
    return ThreadClock(t, tid, st.state, run_ns / 1e9, queued_ns / 1e9, wchan)


def shares(before: ThreadClock, after: ThreadClock) -> ThreadShares | None:
    """What the thread did between the two reads; None when they are of two threads, no time passed or the counters
    went back (a new thread under a reused id)."""
    if before.tid != after.tid:
        return None
    dt = after.t - before.t
    run, queued = after.run_s - before.run_s, after.queued_s - before.queued_s
    if dt <= 0 or run < 0 or queued < 0:
        return None
    return ThreadShares(dt, min(1.0, run / dt), min(1.0, queued / dt))


_FUTEX = re.compile(r"futex")
_SLEEP = re.compile(r"nanosleep|hrtimer")
# A main thread polling file descriptors waits for bytes from a producer: a DataLoader's queue.get polls its pipe
# before reading it (measured: 5 of 24 reads of an input-starved rank, the rest in the read itself).
_POLL = re.compile(r"poll_schedule_timeout|do_sys_poll|do_select|core_sys_select")


def asleep_as(clock: ThreadClock, last: str = "unknown") -> str:
    """The straggler state (score.py) of the thread's sleep: what it is asleep on at this read; a thread running
    now slept, if at all, where it last did (``last``: what an earlier read of it said) — a read that finds it
    running says nothing about its sleep, and counting that sleep as nothing would make a rank that works often
    between short waits look like one that never waits."""
    if clock.state == "R" or (clock.state != "D" and clock.wchan in ("", "0")):
        return last
    kernel = kernel_wait(clock.wchan, "disk-sleep" if clock.state == "D" else "")
    if kernel is not None:
        return kernel
    if _FUTEX.search(clock.wchan):
        return "collective"
    if _POLL.search(clock.wchan):
        return "data_wait"
    return "sleep" if _SLEEP.search(clock.wchan) else "unknown"


def interval_states(sh: ThreadShares, asleep: str, device: str | None, throttled: float = 0.0) -> dict[str, float]:
    """One interval of a rank's main thread as shares of the straggler's states: on a GPU that spins in a
    collective it waited; on a GPU at work, or on its CPU (running or queued for it), it did its own work; its
    sleep counts as ``asleep`` (``asleep_as``). ``throttled``: the share of the wall time its cgroup's CPU quota held
    its process lately — a CPU (gloo) rank waiting in a collective then waits, up to that share, for its collective's
    work on its own held threads (gloo's, not the main thread): own time, as the stack window counts it
    (score.as_sampled), in proportion here, so a rank held a little is not made one that never waits."""
    if device == "spin":
        return {"collective": 1.0}
    if device == "busy":
        return {"compute": 1.0}
    out = {"compute": sh.running + sh.queued}
    if sh.asleep > 0:
        out[asleep] = out.get(asleep, 0.0) + sh.asleep
    if throttled > 0 and device is None and out.get("collective", 0.0) > 0:
        held = min(out["collective"], throttled)
        out["collective"] -= held
        out["compute"] += held
    return out
