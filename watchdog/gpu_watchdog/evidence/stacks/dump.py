"""Dump the Python stacks of rank processes with py-spy, many pids in parallel.

py-spy attaches from outside, so it works on unmodified jobs and on a main thread blocked in a C++
collective (where a Python signal handler never runs, RESEARCH §2). Each dump is a separate
``py-spy dump --pid P --json`` child with its own timeout; a failure is reported per pid as a
``DumpResult`` outcome, never raised.

What py-spy 0.4 really prints (checked by experiment, as root, RUST_BACKTRACE=1):
  * pid gone: exit 1, ``Error: Failed to get process executable name. Check that the process is running.``
    ``Caused by: No such file or directory (os error 2)``
  * not allowed: exit 1, same first line with ``Permission denied (os error 13)``; as non-root it prints
    ``Permission Denied: Try running again with elevated permissions by going 'sudo env "PATH=$PATH" !!'``;
    in docker it mentions the SYS_PTRACE capability; a ptrace refused by Yama gives ``Operation not
    permitted (os error 1)``.
  * not a Python process: exit 1, ``Error: Failed to find python version from target process``.
  * ``time.sleep`` does not show as a frame: only Python frames are listed, so a rank sleeping in
    ``main()`` shows ``main (train.py:94)``, idle. With ``--native`` it shows ``time_sleep`` /
    ``clock_nanosleep``. Hence we add each thread's kernel wait channel (``wchan``) when readable.

Each thread object is py-spy's JSON, plus ``"wchan"`` (str, e.g. ``"hrtimer_nanosleep"``,
``"futex_do_wait"``, ``"0"`` when running), ``"kstate"`` (the thread's scheduler state letter, ``"D"`` for an
uninterruptible wait), ``"syscall"`` (its ``/proc/…/syscall`` line: whether it waits with a timeout,
evidence.stacks.syscalls) and ``"wait_left_s"`` (how long until that call returns by itself, or null) added by
gpu-watchdog on Linux when readable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import psutil

from gpu_watchdog.errors import EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE
from gpu_watchdog.evidence.stacks.syscalls import read_syscall, timed_wait, wait_left_s
from gpu_watchdog.sample import proc_stat
from gpu_watchdog.sample.processes import read_task_state, read_wchan

OUTCOMES = ("ok", "py_spy_missing", "permission_denied", "exited", "stopped", "timeout", "error")

PERMISSION_HINT = (
    "py-spy needs CAP_SYS_PTRACE (docker --cap-add SYS_PTRACE, Kubernetes securityContext "
    "capabilities.add: [SYS_PTRACE]) or kernel.yama.ptrace_scope=0, or run gpu-watchdog as root"
)

# Lines of py-spy's stderr that mean "you may not look at this process".
_PERMISSION_RE = re.compile(
    r"Permission Denied|Permission denied|os error 13\b|Operation not permitted|os error 1\)|SYS_PTRACE"
)
_NOT_PYTHON_RE = re.compile(r"Failed to find python version|Failed to find a python interpreter", re.I)


@dataclass(frozen=True)
class DumpResult:
    """One pid's dump. ``threads`` holds py-spy's JSON thread objects (see module docstring)."""

    pid: int
    outcome: str  # one of OUTCOMES
    detail: str  # one line for humans
    threads: tuple[dict[str, Any], ...] = ()
    raw: str = field(default="", repr=False)  # py-spy's stdout + stderr, kept for the incident record
    elapsed_s: float = 0.0
    wakeups_before: int | None = None  # the main thread's voluntary context switches before the dump ...
    wakeups_after: int | None = None  # ... and after it (py-spy's attach itself wakes the thread; read after a
    # failed attempt too, except when the process is gone)
    io_before: int | None = None  # the main thread's own bytes read and written (rchar + wchar) before the dump ...
    io_after: int | None = None  # ... and after it: a reader whose bytes trickle in moves between two dumps
    agent_cpu_s: float = 0.0  # the agent's own CPU for this dump (its /proc reads, parsing), py-spy's not included

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def find_py_spy(explicit: str | None = None) -> str | None:
    """The py-spy executable: ``explicit`` (a path or a name on PATH), else the one installed next to
    this interpreter (a venv's bin/), else PATH. ``None`` when absent; an explicit choice never falls
    back, so a misconfigured path is reported instead of silently replaced."""
    if explicit:
        if os.sep in explicit:
            return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
        return shutil.which(explicit)
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def _first_error_line(text: str) -> str:
    """py-spy's ``Error: …`` line plus its innermost cause, without the Rust backtrace."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = next((ln for ln in lines if ln.startswith("Error:") or ln.startswith("Permission")), "")
    causes = [ln.split(":", 1)[1].strip() for ln in lines if re.match(r"^\d+: ", ln) and "os error" in ln]
    if head and causes:
        return f"{head} ({causes[0]})"
    return head or (lines[0] if lines else "no output")


def _is_gone(pid: int) -> bool:
    """True when the pid no longer names a live process (zombies count as gone: nothing to dump)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


KernelWaits = dict[int, tuple[str, str, str]]  # {tid: (wchan, state letter, /proc syscall line)}


def _read_kernel_waits(pid: int) -> KernelWaits:
    """{tid: (kernel wait channel, scheduler state, syscall line)} of every thread of pid; empty where /proc hides
    it."""
    out: KernelWaits = {}
    for t in proc_stat.threads(pid):
        w, st, sc = read_wchan(pid, t), read_task_state(pid, t), read_syscall(pid, t)
        if w or st or sc:
            out[t] = (w, st, sc)
    return out


def _add_kernel_waits(threads: list[dict[str, Any]], before: KernelWaits, after: KernelWaits,
                      pid: int | None = None) -> None:
    # The kernel wait channel tells sleep (hrtimer_nanosleep) from lock waits (futex_*) when py-spy
    # shows only the calling Python frame. Read before and after the dump: py-spy's ptrace stop
    # interrupts the sleep, and on a busy machine the thread may still be runnable ("0") right
    # after; any non-"0" value is the wait the thread sits in. State D (uninterruptible: a hung NFS mount, a
    # vfork parent) says "waiting in the kernel" whatever the channel's name.
    for th in threads:
        tid = th.get("os_thread_id")
        if not isinstance(tid, int):
            continue
        seen = [w for w in (before.get(tid), after.get(tid)) if w is not None]
        wchans = [w for w, _, _ in seen if w]
        if wchans:
            th["wchan"] = next((w for w in wchans if w != "0"), wchans[0])
        states = [st for _, st, _ in seen if st]
        if states:
            th["kstate"] = "D" if "D" in states else states[0]
        # The call it blocks in, to tell a wait with a timeout (a polling loop) from one without (syscalls.py), and
        # how long until it returns by itself (read when the dump is taken).
        calls = [sc for _, _, sc in seen if sc]
        known = [sc for sc in calls if timed_wait(sc) is not None]
        if known or calls:
            th["syscall"] = (known or calls)[0]
            if pid is not None and known:
                th["wait_left_s"] = wait_left_s(pid, tid, known[-1])


ThreadCounters = dict[int, tuple[int | None, int | None]]  # {tid: (voluntary context switches, bytes read+written)}


def _thread_counters(pid: int) -> ThreadCounters:
    """Every thread's own wakeups and I/O bytes (``/proc/PID/task/TID/{status,io}``): a rank whose work runs on a
    thread other than the main one (Ray Train's training thread) is judged by that thread's."""
    out: ThreadCounters = {}
    for tid in proc_stat.threads(pid):
        wakeups = None
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        wakeups = int(line.split(":", 1)[1])
                        break
        except (OSError, ValueError):
            pass
        out[tid] = (wakeups, _thread_io(pid, tid))
    return out


def _add_thread_counters(threads: list[dict[str, Any]], before: ThreadCounters, after: ThreadCounters,
                         paused: bool) -> None:
    # The same reading as the main thread's (DumpResult.wakeups_*/io_*), per thread: a paused attach may cost each
    # thread one wakeup as it blocks again, which is the dump's, not the job's.
    for th in threads:
        tid = th.get("os_thread_id")
        if not isinstance(tid, int) or tid not in before or tid not in after:
            continue
        (w0, io0), (w1, io1) = before[tid], after[tid]
        th.update(wakeups_before=w0, wakeups_after=w1 + 1 if w1 is not None and paused else w1,
                  io_before=io0, io_after=io1)


def _wakeups(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).num_ctx_switches().voluntary)  # /proc/PID/status: the main thread's
    except psutil.Error:
        return None


def _main_thread_io(pid: int) -> int | None:
    """The main thread's own read and written bytes (``/proc/PID/task/PID/io``): not the process's, whose other
    threads (NCCL's watchdog polling the store, a logger) move bytes while the main thread is stuck."""
    return _thread_io(pid, pid)


def _thread_io(pid: int, tid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/io") as f:
            fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


def _is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill py-spy and anything it started; it runs in its own session for that reason."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


@dataclass
class _Attempt:
    """One pid's dump in progress: its clock and the counters read around it, which every outcome carries."""

    pid: int
    paused: bool  # py-spy stops the process while it reads (native, or not nonblocking)
    t0: float = field(default_factory=lambda: time.monotonic())  # the same clock done() reads
    kernel_waits: KernelWaits = field(default_factory=dict)
    counters: ThreadCounters = field(default_factory=dict)
    wakeups_before: int | None = None
    wakeups_after: int | None = None
    io_before: int | None = None
    io_after: int | None = None

    def done(self, outcome: str, detail: str, raw: str = "", threads: tuple[dict[str, Any], ...] = ()) -> DumpResult:
        return DumpResult(self.pid, outcome, detail, threads, raw, round(time.monotonic() - self.t0, 4),
                          self.wakeups_before, self.wakeups_after, self.io_before, self.io_after)

    def read_before(self) -> None:
        """Read the threads' kernel waits and counters, and the main thread's, before py-spy attaches."""
        self.kernel_waits = _read_kernel_waits(self.pid)
        self.counters = _thread_counters(self.pid)
        self.wakeups_before = _wakeups(self.pid)
        self.io_before = _main_thread_io(self.pid)

    def read_after(self, attached: bool = True) -> None:
        # A paused (blocking) attach may cost the thread one more wakeup just after this read, as it blocks again:
        # it is the dump's, not the job's ("did it wake between two dumps" must not see it). Read after a failed
        # attempt too (a timeout, an error): py-spy may have stopped the thread all the same, and a later dump of
        # the same collection (collect.py's native re-dump) carries these counters on.
        self.io_after = _main_thread_io(self.pid)
        after = _wakeups(self.pid)
        blocking = attached and self.paused
        self.wakeups_after = after + 1 if after is not None and blocking else after


def _dump_one(pid: int, py_spy: str, timeout_s: float, native: bool, nonblocking: bool = False,
              with_locals: bool = False) -> DumpResult:
    run = _Attempt(pid, paused=native or not nonblocking)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return run.done("error", f"invalid pid {pid!r}")
    if _is_stopped(pid):  # py-spy would wait for a stopped process until its timeout: its state says enough
        return run.done("stopped", f"process {pid} is stopped (SIGSTOP or job control, state T): not dumped")
    argv = _py_spy_argv(pid, py_spy, native, nonblocking, with_locals)
    run.read_before()
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as e:  # vanished since find_py_spy, not executable, bad format
        return run.done("py_spy_missing", f"cannot run py-spy at {py_spy}: {e.strerror or e}")
    out_b, err_b, timed_out = _communicate(proc, timeout_s)
    out, err = out_b.decode(errors="replace"), err_b.decode(errors="replace")
    raw = out + err
    if timed_out:
        run.read_after()
        return run.done(
            "timeout",
            f"py-spy did not finish within {timeout_s:g} s and was killed "
            "(process stopped, in uninterruptible sleep, or the machine is overloaded)",
            raw,
        )
    if proc.returncode == 0:
        return _dumped(run, out, raw)
    return _failed(run, proc.returncode, err, raw)


def _py_spy_argv(pid: int, py_spy: str, native: bool, nonblocking: bool, with_locals: bool) -> list[str]:
    argv = [py_spy, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else []) + \
        (["--locals"] if with_locals else [])
    if nonblocking and not native:  # py-spy can only unwind native frames of a paused process
        argv.append("--nonblocking")
    return argv


def _communicate(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[bytes, bytes, bool]:
    """py-spy's stdout and stderr, and whether it ran past ``timeout_s`` (then it was killed with its group)."""
    try:
        out_b, err_b = proc.communicate(timeout=timeout_s)
        return out_b, err_b, False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out_b, err_b = proc.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:  # something outside the group holds the pipes: give up on output
            out_b, err_b = b"", b""
            proc.wait()
        return out_b, err_b, True
    finally:
        if proc.returncode is None:  # an unexpected exception: never leave py-spy attached
            _kill_group(proc)
            proc.wait()


def _dumped(run: _Attempt, out: str, raw: str) -> DumpResult:
    """py-spy exited 0: its JSON threads, with the kernel waits and counters read around the dump."""
    run.read_after()
    try:
        threads = json.loads(out)
        if not isinstance(threads, list):
            raise ValueError("not a JSON list")
    except ValueError as e:
        return run.done("error", f"py-spy printed unreadable JSON for pid {run.pid}: {e}", raw)
    _add_kernel_waits(threads, run.kernel_waits, _read_kernel_waits(run.pid), run.pid)
    _add_thread_counters(threads, run.counters, _thread_counters(run.pid), run.paused)
    return run.done("ok", f"{len(threads)} threads", raw, tuple(threads))


def _failed(run: _Attempt, returncode: int, err: str, raw: str) -> DumpResult:
    # Failed: decide by the process's fate first (the text differs between versions), then by text.
    pid = run.pid
    if _is_gone(pid):
        return run.done("exited", f"process {pid} is not running (exited before or during the dump)", raw)
    run.read_after(attached=not _PERMISSION_RE.search(err))  # a refused attach stopped nothing
    if _PERMISSION_RE.search(err):
        return run.done("permission_denied", f"permission denied reading process {pid}: {PERMISSION_HINT}", raw)
    if _NOT_PYTHON_RE.search(err):
        return run.done("error", f"process {pid} is not a Python process py-spy can read: {_first_error_line(err)}",
                        raw)
    if returncode < 0:  # killed from outside (the OOM killer, an admin): the target was not left traced
        return run.done("error", f"py-spy was killed by {signal.Signals(-returncode).name} during the dump", raw)
    return run.done("error", f"py-spy exited {returncode}: {_first_error_line(err)}", raw)


def _dump_guarded(pid: int, py_spy: str, timeout_s: float, native: bool, nonblocking: bool = False,
                  with_locals: bool = False) -> DumpResult:
    # The agent must keep running whatever one dump does: a bug here becomes an "error" outcome.
    cpu0 = time.thread_time()  # each dump runs on a thread of its own (dump_stacks' pool)
    try:
        res = _dump_one(pid, py_spy, timeout_s, native, nonblocking, with_locals)
    except Exception as e:
        res = DumpResult(pid, "error", f"dump failed: {type(e).__name__}: {e}")
    return replace(res, agent_cpu_s=time.thread_time() - cpu0)


def dump_stacks(
    pids: Iterable[int],
    *,
    timeout_s: float = 5.0,
    concurrency: int = 16,
    native: bool = False,
    py_spy: str | None = None,
    nonblocking: bool = False,
    with_locals: bool = False,
) -> list[DumpResult]:
    """Dump every pid's threads in parallel (at most ``concurrency`` py-spy children at once), each
    bounded by ``timeout_s``. Results come back in input order; failures are outcomes, not exceptions.
    ``py_spy`` is an explicit executable (see ``find_py_spy``)."""
    pid_list = list(pids)
    exe = find_py_spy(py_spy)
    if exe is None:
        where = py_spy or "next to the interpreter or on PATH"
        return [DumpResult(p, "py_spy_missing", f"py-spy not found ({where}); pip install py-spy")
                for p in pid_list]
    if not pid_list:
        return []
    workers = max(1, min(concurrency, len(pid_list)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="py-spy") as pool:
        return list(pool.map(lambda p: _dump_guarded(p, exe, timeout_s, native, nonblocking, with_locals),
                              pid_list))


def _frame_text(fr: dict[str, Any]) -> str:
    line = fr.get("line") or 0
    short = fr.get("short_filename") or fr.get("filename") or "?"
    return f"{fr.get('name', '?')} ({short}:{line})" if line else f"{fr.get('name', '?')} ({short})"


def main_dump_stacks(
    pids: Sequence[int], native: bool, as_json: bool, timeout_s: float, out: TextIO = sys.stdout,
    py_spy: str | None = None,
) -> int:
    """Body of ``gpu-watchdog dump-stacks PID… [--native] [--json]``.

    Text: per pid a header ``pid P: <outcome> (<elapsed> s) <state>`` and the main thread's frames,
    innermost first, as ``name (file:line)``. JSON: a list of ``{pid, outcome, detail, elapsed_s,
    threads}`` in argument order.

    Exit codes: 0 every pid dumped; 1 at least one pid failed (exited, permission, timeout, error);
    69 py-spy is not installed (every pid reports ``py_spy_missing``).
    """
    from gpu_watchdog.evidence.stacks.classify import (  # local: classify is optional for dumping
        classify_thread,
        main_thread,
    )

    results = dump_stacks(pids, timeout_s=timeout_s, native=native, py_spy=py_spy)
    if as_json:
        payload = [
            {"pid": r.pid, "outcome": r.outcome, "detail": r.detail, "elapsed_s": r.elapsed_s,
             "threads": list(r.threads)}
            for r in results
        ]
        json.dump(payload, out, indent=2)
        out.write("\n")
    else:
        for r in results:
            if not r.ok:
                out.write(f"pid {r.pid}: {r.outcome} ({r.elapsed_s:.2f} s) {r.detail}\n")
                continue
            mt = main_thread(r.threads, r.pid)
            if mt is None:
                out.write(f"pid {r.pid}: ok ({r.elapsed_s:.2f} s) no main thread in the dump\n")
                continue
            rs = classify_thread(mt, rank=-1, pid=r.pid)
            state = rs.state + (f" {rs.op}" if rs.op else "") + (" active" if rs.active else " idle")
            out.write(f"pid {r.pid}: ok ({r.elapsed_s:.2f} s) {mt.get('thread_name') or 'main'}: {state}\n")
            for fr in mt.get("frames", []):
                out.write(f"    {_frame_text(fr)}\n")
    if results and all(r.outcome == "py_spy_missing" for r in results):
        return EXIT_UNAVAILABLE
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAILURE
