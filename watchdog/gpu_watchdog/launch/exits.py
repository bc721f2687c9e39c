"""Which rank died first, and how: the evidence of a ``rank_exited`` incident under ``launch``."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpu_watchdog.model import rank_known, rank_label, unknown_rank
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.proc_stat import read_stat
from gpu_watchdog.sample.unranked import Unranked

_TEARDOWN = (signal.SIGTERM, signal.SIGKILL)  # what torchrun sends the surviving workers


_ALONE_S = 0.05  # an exit this much before every other was seen on its own (not in the same wakeup as the rest)

Exits = Mapping[int, tuple[float, int | None]]  # rank → (when seen exited, its exit status in waitpid form if read)


@dataclass(frozen=True)
class TorchrunReport:
    """What torchrun printed of its workers' ends before it exited (launch.output reads it off the job's stderr): the
    ChildFailedError report lists every worker that ended with a non-zero code (a worker that ran to exit code 0 is
    no failure and is not listed), and ``Sending process PID closing signal`` names each worker it tore down. The
    agent's own read of a zombie is lost when torchrun reaps it first; this is printed after torchrun reaped them."""

    failures: Mapping[int, tuple[int, int]]  # global rank → (exit code as torchrun gives it, -6: SIGABRT; pid)
    torn_down: frozenset[int] = field(default_factory=frozenset)  # pids torchrun sent a closing signal

    def status(self, rank: int) -> int | None:
        """``rank``'s exit status (waitpid form) as the report proves it: a listed rank's own; exit code 0 for an
        unlisted one when every worker torchrun tore down is listed (a signalled worker that exited 0 would be
        unlisted too); None when it cannot tell."""
        if rank in self.failures:
            code = self.failures[rank][0]
            return -code & 0x7F if code < 0 else (code & 0xFF) << 8
        listed = {pid for _, pid in self.failures.values()}
        return 0 if self.torn_down <= listed else None


def with_report(exits: Exits, report: TorchrunReport | None, ranks: Iterable[int], at: float
                ) -> dict[int, tuple[float, int | None]]:
    """``exits`` completed by torchrun's report: a status the agent could not read (the parent reaped it first) is
    the report's, and a rank of ``ranks`` the agent never saw exit is added as seen at ``at`` (the command's end:
    torchrun reports before it exits). What the agent read itself is kept."""
    out = dict(exits)
    if report is None:
        return out
    for r in set(ranks) | exits.keys():
        if not rank_known(r):
            continue  # a process no rank was known for: torchrun's report lists ranks only
        told = report.status(r)
        seen, own = out.get(r, (at, None))
        if told is not None and own is None:
            out[r] = (seen, told)
    return out


@dataclass(frozen=True)
class UnrankedExit:
    """A process of the job that died before any source named its rank, named by what is known after its end."""

    process: Unranked  # as Ray's records tell after its end
    rank: int  # the rank Ray's records give it, or model.unknown_rank(pid)
    source: str  # the record that gave its rank; "" when none did

    def label(self) -> str:
        """``rank 1 (pid 4242, Ray actor Trainer …; its rank from …, read after it died)`` or ``rank unknown (pid
        4242, Ray actor Trainer …)``."""
        if not self.source:
            return f"rank unknown (pid {self.process.pid}, {self.process.what()})"
        return f"rank {self.rank} (pid {self.process.pid}, {self.process.what()}; its rank from {self.source}, read " \
               "after it died)"


def name_unranked(ended: Mapping[int, tuple[float, int | None, Unranked]], named: Iterable[int],
                  live: Mapping[int, int]) -> dict[int, tuple[tuple[float, int | None], UnrankedExit]]:
    """The exits of processes that died with no rank named (``ExitWatch.unranked_exits``), told by rank: rank → (when
    seen exited and its status, what names it). Each is read again from the records that outlive it (Ray's): its
    rank is theirs, unless another process holds that rank (``named``: the ranks whose exits were seen; ``live``: rank
    → pid of the job's ranks last sampled) — never another's, then ``model.unknown_rank``. Left out: a process not
    known to be the job's work (it neither joined the group nor hosts an actor of the job), and a Ray worker that Ray
    ended on purpose (its actor killed, its owner gone): no failure."""
    out: dict[int, tuple[tuple[float, int | None], UnrankedExit]] = {}
    taken = set(named) | set(live)
    for pid, (seen, status, last) in sorted(ended.items()):
        proc = last.after_exit()
        if not proc.may_be_rank or (proc.ray is not None and proc.ray.ended_by_ray):
            continue
        given = proc.rank()
        rank, source = given if given is not None and given[0] not in taken else (unknown_rank(pid), "")
        taken.add(rank)
        out[rank] = ((seen, status), UnrankedExit(proc, rank, source))
    return out


def exit_label(rank: int, late: Mapping[int, tuple[tuple[float, int | None], UnrankedExit]],
               ray_ranks: Mapping[int, Unranked]) -> str:
    """A dead rank as the incident's finding names it: one named after its end by what is known (``late``), a Ray
    worker by its rank, pid and actor (``ExitWatch.ray_ranks``: a process Ray starts names its actor, not its rank, in
    Ray's own logs and dashboard), else by its rank."""
    if rank in late:
        return late[rank][1].label()
    if (w := ray_ranks.get(rank)) is not None:
        return f"{rank_label(rank)} (pid {w.pid}, {w.what()})"
    return rank_label(rank)


def exit_sections(named: Mapping[int, tuple[tuple[float, int | None], UnrankedExit]], host: str,
                  ray_ranks: Mapping[int, Unranked] | None = None) -> dict[str, object]:
    """The incident's ``unknown_ranks`` (rank → host, pid, command, ray) of the processes ``name_unranked`` named with
    no rank, and ``ray_workers`` (rank → what Ray calls the worker) of those it named with a rank and of the named
    ranks that were Ray workers (``ray_ranks``) (docs/json-contract.md)."""
    unknown = {str(r): e.process.describe(host) for r, (_, e) in sorted(named.items()) if not rank_known(r)}
    workers = {**(ray_ranks or {}), **{r: e.process for r, (_, e) in named.items()}}
    ray = {str(r): ray_node.describe_worker(w.ray, w.command) for r, w in sorted(workers.items())
           if w.ray is not None and not w.ray.driver and rank_known(r)}
    return {k: v for k, v in (("unknown_ranks", unknown), ("ray_workers", ray)) if v}


def ended_by_ray(ray_ranks: Mapping[int, Unranked]) -> dict[int, str]:
    """rank → why Ray ended it on purpose (its owner, the driver, gone; its actor killed), of the dead Ray workers
    (``ExitWatch.ray_ranks``) whose own Ray log says so: Ray's teardown, never the job's failure."""
    return {r: why for r, w in ray_ranks.items() if w.ray is not None and (why := w.ray.ended_by_ray)}


def first_to_exit(exits: Exits, command_exited_at: float | None = None) -> tuple[int, ...]:
    """The rank(s) that failed: the first exit, when it was alone first and ended by a signal or unread; else, of
    the exits seen within a second of the first, those that did not end by torchrun's teardown signals; else the
    earliest ones seen. Exit code 0 is no failure. A rank that exited after the launched command itself
    (``command_exited_at``) was torn down by the command's end (Ray's workers exit when their driver is gone, with
    an exit code of their own): never the one that failed, unless every rank did."""
    exits = {r: v for r, v in exits.items() if v[1] != 0}  # a rank that ran to exit code 0 never failed
    before = {r: v for r, v in exits.items() if command_exited_at is None or v[0] <= command_exited_at}
    if before:
        first, (seen, status) = min(before.items(), key=lambda kv: kv[1][0])
        alone = all(t - seen >= _ALONE_S for r, (t, _) in exits.items() if r != first)
        if alone and (status is None or (status & 0x7F) in _TEARDOWN):
            # Killed (the OOM killer's SIGKILL) or reaped by its parent before its status could be read (Ray's
            # raylet reaps at once), alone and before the command ended: a teardown never comes first — torchrun's
            # signals follow a failure — and the later exits' codes of their own (a peer's collective failing on
            # the dead rank, Ray's workers exiting as their driver shuts Ray down) are its consequences.
            return (first,)
    exits = before or exits
    if not exits:
        return ()
    first_t = min(t for t, _ in exits.values())
    early = {r: st for r, (t, st) in exits.items() if t - first_t < 1.0}
    own = tuple(sorted(r for r, st in early.items() if st is not None and (st & 0x7F) not in _TEARDOWN))
    return own or tuple(sorted(r for r, (t, _) in exits.items() if t - first_t < 0.01))


def finished_work(failed: tuple[int, ...], ranks: tuple[int, ...], exits: Exits, done: dict[int, int | None],
                  command_exited_at: float | None = None, report: TorchrunReport | None = None) -> str | None:
    """Why the job had finished its work before ``failed`` died (PyTorch's teardown abort at interpreter exit,
    pytorch/pytorch#190489), or None when that is not shown. ``done``: rank → last step, of the ranks whose in-job
    client saw their training loop end without an exception. Without the client: every peer ran its script to
    exit code 0 on its own (its last collective needed every rank, the failed one included) and each failed rank was
    ended by a signal of its own, not by an exception's exit code. The exit codes are the agent's own read or
    torchrun's ``report``, whichever was had: the same verdict either way, and none when the two disagree."""
    if not failed:
        return None
    if all(r in done for r in failed):
        steps = sorted({s for r in failed if (s := done[r]) is not None})
        at = f" (last step {steps[-1]})" if steps else ""
        return (f"{_ranks_text(failed)} had ended {'its' if len(failed) == 1 else 'their'} training loop{at} before "
                "dying: a death at teardown")
    peers = tuple(r for r in ranks if r not in failed)
    if not (peers and _teardown_death(failed, peers, exits, command_exited_at, report)):
        return None
    why = (f"{_ranks_text(peers)} exited 0 (their last collective needed every rank) and {_ranks_text(failed)} died "
           "by a signal: a death at teardown")
    if not _teardown_death(failed, peers, exits, command_exited_at, None):
        why += " (exit statuses from torchrun's report: it reaped the ranks before the agent read them)"
    return why


def _teardown_death(failed: tuple[int, ...], peers: tuple[int, ...], exits: Exits, command_exited_at: float | None,
                    report: TorchrunReport | None) -> bool:
    """Every peer ran to exit code 0 on its own and every failed rank died by a signal of its own; torchrun reports
    no other failure."""
    if report is not None and not set(report.failures) <= set(failed):
        return False
    until = command_exited_at if command_exited_at is not None else float("inf")
    return (all(_ran_to_0(r, exits.get(r), until, report) for r in peers)
            and all(_own_signal(r, exits.get(r), report) for r in failed))


def _ran_to_0(rank: int, seen: tuple[float, int | None] | None, until: float, report: TorchrunReport | None) -> bool:
    """``rank`` exited 0 on its own before the launched command ended. torchrun's report of exit 0 is: it reports
    before it exits, and lists every worker it tore down. The agent's read is timed (Ray tears its workers down
    after their driver exited, and they may exit 0)."""
    own = seen[1] if seen is not None else None
    told = report.status(rank) if report is not None else None
    if own not in (None, 0) or told not in (None, 0):
        return False  # one source saw it fail
    return told == 0 or (seen is not None and own == 0 and seen[0] <= until)


def _own_signal(rank: int, seen: tuple[float, int | None] | None, report: TorchrunReport | None) -> bool:
    """``rank`` was ended by a signal of its own (SIGABRT, SIGSEGV), not torchrun's teardown, as every source that
    read its status tells."""
    statuses = [st for st in (seen[1] if seen is not None else None,
                              report.status(rank) if report is not None else None) if st is not None]
    return bool(statuses) and all(st & 0x7F and (st & 0x7F) not in _TEARDOWN for st in statuses)


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return ", ".join(rank_label(r) for r in sorted(ranks))


class ExitWatch:
    """Which rank died first, and how. torchrun reaps a dead worker within its monitor interval (0.1 s) and then
    tears the others down, all between two sampling ticks. This thread holds a pidfd per process of the job and
    sleeps in poll(2) until one becomes readable — the process exited — then reads the zombie's exit status before
    its parent reaps it: no CPU while the job runs. Without pidfds (Linux < 5.3) it reads /proc/PID/stat every
    ``poll_s``. Exits are timed per process, from when the process was first sampled, and told by rank when the
    sampling loop names it: a rank named late (a Ray actor's rank comes from Ray's records) is still timed when its
    process ended, not when it was named. The processes that may become ranks are watched too, from when the scanner
    first sees them (a Ray worker: from its lease), with what names each (``watch_unranked``): one that dies before
    its rank is known is told by what is known (``unranked_exits``, ``name_unranked``)."""

    def __init__(self, poll_s: float = 0.05, keep_unnamed_s: float = 60.0) -> None:
        self.poll_s = poll_s
        self.keep_unnamed_s = keep_unnamed_s  # how long the exit of a process no rank was named for is kept
        self._ranks: dict[int, int] = {}  # rank → pid, set by the sampling loop
        self._ended: dict[int, tuple[float, int | None]] = {}  # pid → (when seen exited, its exit status if caught)
        self._unranked: dict[int, Unranked] = {}  # pid → what names it, of the processes that may become ranks
        self._ray_workers: dict[int, Unranked] = {}  # pid → the Ray worker it is (its records, its title)
        self._handed: set[int] = set()  # every pid handed in
        self._pending: set[int] = set()  # of those, the ones the thread does not watch yet
        self._command: int | None = None
        self.command_exited_at: float | None = None  # when the launched command itself was seen exiting
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)
        self._thread.start()

    @property
    def exits(self) -> dict[int, tuple[float, int | None]]:
        """rank → (when seen exited, its exit status if caught), of the ranks named so far."""
        with self._lock:
            return {r: self._ended[pid] for r, pid in self._ranks.items() if pid in self._ended}

    def watch(self, rank_pids: dict[int, int]) -> None:
        with self._lock:
            self._ranks.update(rank_pids)
            self._hand(rank_pids.values())

    def watch_processes(self, pids: Iterable[int]) -> None:
        """Every process of the job as sampled, before any rank is named for it (called every tick)."""
        with self._lock:
            self._hand(pids)

    def watch_unranked(self, procs: Mapping[int, Unranked]) -> None:
        """The job's processes that may be ranks whose rank is not known yet, as the scanner saw them this tick
        (``ProcessScanner.not_yet_ranked``): watched from now on; one that dies keeps what named it when last seen
        alive (a zombie's fds, its log among them, are gone). One still alive that the scanner no longer lists (a Ray
        worker back to idle, a rank now named) is dropped."""
        with self._lock:
            for pid in [p for p in self._unranked if p not in procs and p not in self._ended]:
                st = read_stat(pid)
                if st is not None and st.state != "Z":
                    del self._unranked[pid]
            self._unranked.update((pid, u) for pid, u in procs.items() if pid not in self._ended)  # seen alive: kept
            self._hand(procs)

    def watch_ray_workers(self, workers: Mapping[int, Unranked]) -> None:
        """The job's Ray workers as last seen alive (``ProcessScanner.ray_workers``): after its end, whether Ray
        ended one on purpose is read from its records (``ended_by_ray``), and a rank's is named by them
        (``ray_ranks``)."""
        with self._lock:
            self._ray_workers.update((pid, w) for pid, w in workers.items() if pid not in self._ended)

    def ray_ranks(self) -> dict[int, Unranked]:
        """rank → its Ray worker as Ray's records tell after its end, of the named ranks that exited and were Ray
        workers: what names the dead process (its pid, its actor) besides its rank."""
        with self._lock:
            workers = {r: w for r, pid in self._ranks.items() if pid in self._ended
                       and (w := self._ray_workers.get(pid)) is not None}
        return {r: w.after_exit() for r, w in workers.items()}


    @property
    def unranked_exits(self) -> dict[int, tuple[float, int | None, Unranked]]:
        """pid → (when seen exited, its exit status if caught, what named it), of the processes that may have been
        ranks and ended with no rank named for them."""
        with self._lock:
            named = set(self._ranks.values())
            return {pid: (*self._ended[pid], u) for pid, u in self._unranked.items()
                    if pid in self._ended and pid not in named}

    def watch_command(self, pid: int) -> None:
        """The launched command: ranks that exit after it were torn down by its end (``first_to_exit``)."""
        with self._lock:
            self._command = pid
            self._hand((pid,))

    def _hand(self, pids: Iterable[int]) -> None:  # under the lock
        new = set(pids) - self._handed
        self._handed |= new
        self._pending |= new

    def forget(self) -> None:
        """The job's engine restarted its ranks in place (Ray Train): the ended ones are no exit of the job's."""
        with self._lock:
            self._ranks.clear()
            self._ended.clear()
            self._unranked.clear()
            self._ray_workers.clear()

    def _exited(self, pid: int) -> None:
        if pid == self._command:
            if self.command_exited_at is None:
                self.command_exited_at = time.time()
            return
        st = read_stat(pid)  # a zombie until its parent reaps it: its exit status is still there
        now = time.time()
        with self._lock:
            self._ended.setdefault(pid, (now, st.exit_code if st is not None else None))
            # Forget unnamed exits (dataloader workers come and go), but not a Ray worker's or a group member's: one
            # named later (Ray's records) or never (no source gives its rank) may be the job's first failure.
            named = set(self._ranks.values()) | {p for p, u in self._unranked.items() if u.joined or u.ray is not None}
            old = {p for p, e in self._ended.items() if p not in named and e[0] < now - self.keep_unnamed_s}
            for p in old:
                self._unranked.pop(p, None)
                self._ray_workers.pop(p, None)
            self._ended = {p: e for p, e in self._ended.items() if p not in old}
            self._handed -= old  # a pid the kernel reuses is watched afresh

    def _run(self) -> None:
        import select

        poller = select.poll() if hasattr(os, "pidfd_open") else None
        fds: dict[int, int] = {}  # pidfd → pid
        try:
            while not self._stop.is_set():
                with self._lock:
                    new, self._pending = self._pending, set()
                for pid in new:
                    if poller is not None:
                        try:
                            fd = os.pidfd_open(pid)
                        except ProcessLookupError:
                            self._exited(pid)
                            continue
                        except OSError:  # no pidfd support here: read /proc instead
                            poller = None
                            continue
                        fds[fd] = pid
                        poller.register(fd, select.POLLIN)
                if poller is None:
                    self._read_proc()
                    self._stop.wait(self.poll_s)
                    continue
                for fd, _event in poller.poll(200):  # wakes at once on an exit; 200 ms to pick up new processes
                    poller.unregister(fd)
                    os.close(fd)
                    self._exited(fds.pop(fd))
        finally:
            for fd in fds:
                os.close(fd)

    def _read_proc(self) -> None:
        with self._lock:
            live = self._handed - self._ended.keys()
        for pid in live:
            if pid == self._command and self.command_exited_at is not None:
                continue
            st = read_stat(pid)
            if st is None or st.state == "Z":
                self._exited(pid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
