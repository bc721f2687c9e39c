"""The rank of a process that was handed its rank in code (``mp.spawn``, Lightning ``ddp_spawn``, an
``mp.Process`` loop), read from its stack: one ``py-spy dump --locals`` per process, off the sampling path.

Where the rank is, in the order it is believed (main thread, outermost frame first):
1. an argument named ``global_rank`` or ``rank`` holding an int (the tutorial's ``demo_basic(rank, world_size)``,
   ``init_process_group(rank=…)``);
2. a local variable of those names (``rank = node_rank * nprocs + local_rank``);
3. the spawn index — ``i`` of ``torch.multiprocessing.spawn._wrap`` (``mp.spawn``, ``start_processes``,
   Accelerate's ``notebook_launcher``) or ``process_idx`` of Lightning's ``_wrapping_function`` — which is the
   rank on one node.
A process none of these name stays unranked (the launcher says so, with the reason).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psutil

from gpu_watchdog.evidence.stacks.dump import dump_stacks
from gpu_watchdog.sample.processes import command_text

RANK_NAMES = ("global_rank", "rank")
# (file path suffix, function name suffix, argument): the index a spawning launcher hands each process.
SPAWN_INDEX = (("torch/multiprocessing/spawn.py", "_wrap", "i"),
               ("strategies/launchers/multiprocessing.py", "_wrapping_function", "process_idx"))
_PRUNE_AT = 1024  # lookups kept before those of ended processes are dropped (a long-lived daemon)
# Asked only about processes that joined the process group (past their imports), so a few looks settle it: a frame
# may still be missing (a dump that caught init_process_group's own frame with its default rank -1). After the last
# one the scanner watches the process with its rank unknown.
MAX_TRIES = 3
RETRY_S = 3.0


def _int(text: Any) -> int | None:
    try:
        value = int(str(text))
    except ValueError:
        return None
    return value if value >= 0 else None


def _main_frames(threads: Iterable[Mapping[str, Any]], pid: int) -> list[Mapping[str, Any]]:
    for t in threads:
        if t.get("os_thread_id") == pid or t.get("thread_name") == "MainThread":
            return list(t.get("frames") or ())
    return []


def rank_from_stack(threads: Iterable[Mapping[str, Any]], pid: int) -> tuple[int | None, str]:
    """(rank, where it was read) from a ``py-spy dump --json --locals`` of ``pid``; (None, why not) otherwise."""
    frames = list(reversed(_main_frames(threads, pid)))  # outermost first: the entry point's own arguments
    if not frames:
        return None, "no main-thread stack"
    for want_arg in (True, False):
        for fr in frames:
            for loc in fr.get("locals") or ():
                if bool(loc.get("arg")) == want_arg and loc.get("name") in RANK_NAMES:
                    value = _int(loc.get("repr"))
                    if value is not None:
                        kind = "argument" if want_arg else "variable"
                        return value, f"{kind} {loc['name']} of {fr.get('name', '?')}"
    for fr in frames:
        path, name = str(fr.get("filename") or ""), str(fr.get("name") or "")
        for suffix, func, arg in SPAWN_INDEX:
            if path.endswith(suffix) and name.endswith(func):
                for loc in fr.get("locals") or ():
                    if loc.get("name") == arg and (value := _int(loc.get("repr"))) is not None:
                        return value, f"spawn index {arg} of {name}"
    return None, "no frame names a rank (no global_rank/rank variable, no mp.spawn or Lightning spawn frame)"


@dataclass
class _Lookup:
    create_time: float
    tries: int = 0
    next_at: float = 0.0  # monotonic: not asked again before
    future: Future[tuple[int | None, str]] | None = None
    rank: int | None = None
    why: str = "not looked at yet"


def _settle(lk: _Lookup) -> None:
    """Take a finished dump's answer into ``lk`` (callers hold the finder's lock)."""
    if lk.future is not None and lk.future.done():
        lk.rank, lk.why = lk.future.result()
        lk.future = None


class SpawnedRanks:
    """``ProcessScanner.rank_finder``: ``finder(pid, create_time)`` answers at once — the rank once a dump named
    it, None meanwhile — and asks py-spy in the background (one dump per process, retried a few times)."""

    def __init__(self, py_spy: str | None = None, timeout_s: float = 5.0) -> None:
        self._py_spy = py_spy or None
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank-locals")
        self._lookups: dict[int, _Lookup] = {}
        self._lock = threading.Lock()

    def __call__(self, pid: int, create_time: float) -> int | None:
        with self._lock:
            lk = self._lookups.get(pid)
            if lk is None or lk.create_time != create_time:
                if len(self._lookups) >= _PRUNE_AT:
                    self._lookups = {p: v for p, v in self._lookups.items() if psutil.pid_exists(p)}
                lk = self._lookups[pid] = _Lookup(create_time)
            _settle(lk)
            if lk.rank is None and lk.future is None and lk.tries < MAX_TRIES and time.monotonic() >= lk.next_at:
                lk.tries += 1
                lk.next_at = time.monotonic() + RETRY_S
                lk.future = self._pool.submit(self._look, pid)
            return lk.rank

    def gave_up(self, pid: int, create_time: float) -> bool:
        """Every look at ``pid`` is done and none named its rank."""
        with self._lock:
            lk = self._lookups.get(pid)
            if lk is None or lk.create_time != create_time:
                return False
            _settle(lk)
            return lk.rank is None and lk.future is None and lk.tries >= MAX_TRIES

    def why(self, pid: int) -> str:
        """Why ``pid`` has no rank yet (the last dump's answer)."""
        with self._lock:
            lk = self._lookups.get(pid)
            if lk is None:
                return "not looked at yet"
            _settle(lk)
            return "its stack is being read" if lk.future is not None else lk.why

    def _look(self, pid: int) -> tuple[int | None, str]:
        # Not paused (as the engine's dumps): a paused thread's timed wait reads as restart_syscall from then on.
        res = dump_stacks([pid], timeout_s=self._timeout_s, py_spy=self._py_spy, with_locals=True,
                          nonblocking=True)[0]
        if not res.ok:
            return None, f"py-spy: {res.detail}"
        return rank_from_stack(res.threads, pid)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _command(pid: int) -> str:
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return "(gone)"
    return command_text(argv, 80)


def no_rank_warning(job_id: str, waited_s: float, unranked: Iterable[int], rankless: Iterable[int],
                    why: Any = None) -> str:
    """The one line said when a job shows no rank ``waited_s`` after it started: what was seen instead, and what
    to do. ``unranked``: processes that joined a process group but whose rank was not read (``why(pid)``);
    ``rankless``: the job's other processes."""
    unranked, rankless = list(unranked), list(rankless)
    seen = []
    if unranked:
        reasons = "; ".join(f"pid {p}: {why(p) if why else 'unknown'}" for p in unranked[:4])
        seen.append(f"{len(unranked)} process(es) joined a process group but their rank could not be read "
                    f"({reasons})")
    if rankless:
        shown = ", ".join(f"pid {p} ({_command(p)})" for p in rankless[:4])
        more = f" and {len(rankless) - 4} more" if len(rankless) > 4 else ""
        seen.append(f"{len(rankless)} process(es) with no RANK that joined no process group: {shown}{more}")
    what = "; ".join(seen) or "no process at all"
    return (f"WARNING: job {job_id}: no rank found {waited_s:.0f} s after it started, so its hangs go unseen. "
            f"Seen: {what}. Ranks are found by RANK (torchrun, srun) in their environment, or once they join the "
            "process group (mp.spawn and the like) and py-spy can read their rank.")


__all__ = ["SpawnedRanks", "no_rank_warning", "rank_from_stack"]
