"""Asking NCCL RAS about a job, and the two-poll rule that turns its counts into evidence.

One snapshot of collective counts cannot tell a hung communicator from ranks caught a launch apart: counts that
differ between ranks **and stay unchanged across two polls** ``ras.confirm_gap_s`` apart can, and so can the same
ranks missing from both. ``RasPoller`` queries jobs on a thread of its own (never the sampling path): the engine
has it watch every NCCL job whose rank 0 runs on this node every ``ras.watch_interval_s`` — NCCL's own counts are
the job's progress, and each pair of polls becomes a ``CommProgress`` for the detector — and ask about any suspect
or stalled job every ``ras.poll_interval_s``; a failing socket is "no evidence". An incident asks it for the
evidence (``incident_evidence``), reusing the last background poll when it is recent.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_watchdog.atomic import note_write_error, write_atomic
from gpu_watchdog.config.schema import RasConfig
from gpu_watchdog.errors import WatchdogError
from gpu_watchdog.evidence.nccl_ras.client import (
    ADDR_ENV,
    DEFAULT_ADDR,
    HostPid,
    RasAnalysis,
    RasCommunicator,
    RasReply,
    RasReport,
    analyze_report,
    behind_ranks,
    parse_addr,
    query,
    read_reply,
)
from gpu_watchdog.model import CommProgress

log = logging.getLogger("gpu_watchdog.ras")

# Watching may take at most this share of a core per job: a report grows with the job (measured on a 2-core box:
# 0.7 ms of agent CPU per query for 2 nodes, 39 ms for 128, 309 ms for 1,000 — benchmarks/bench_ras_watch.py), so
# a large job is watched less often than ``ras.watch_interval_s``; a suspect job is asked at ``poll_interval_s``.
WATCH_CPU_SHARE = 0.0025
MAX_LOOKUP_BACKOFF_S = 300.0  # a watched job without a RAS socket is looked at again at least this often

Query = Callable[[str, float], RasReply]


@dataclass(frozen=True)
class RasPoll:
    at: float  # wall clock, for the record
    mono: float  # monotonic, for the gap between polls
    reply: RasReply | None = None
    report: RasReport | None = None
    error: str = ""  # the socket failed or the report was unreadable: no evidence from this poll

    def to_json(self) -> dict[str, Any]:
        r = self.reply
        return {"at": self.at, "error": self.error or None, "format": r.format if r else None,
                "elapsed_s": round(r.elapsed_s, 3) if r else None, "note": r.note if r else "",
                "raw": r.text if r else None}


def _counts(c: RasCommunicator) -> dict[int, dict[str, int]]:
    return {r.rank: dict(r.collective_counts) for r in c.ranks}


def hung_communicators(prev: RasReport, cur: RasReport) -> list[str]:
    """Communicators whose ranks' counts differ now and did not move since ``prev`` (every rank, every type),
    or that miss the same ranks in both reports."""
    before = {c.id: c for c in prev.communicators}
    out = []
    for c in cur.communicators:
        p = before.get(c.id)
        if p is None:
            continue
        stuck = bool(behind_ranks(c)) and _counts(p) == _counts(c)
        missing = bool(c.missing_ranks) and {m.rank for m in c.missing_ranks} == {m.rank for m in p.missing_ranks}
        if stuck or missing:
            out.append(c.id)
    return out


@dataclass(frozen=True)
class RasEvidence:
    addr: str
    polls: tuple[RasPoll, ...]
    hung: tuple[str, ...] = ()  # communicator ids hung by the two-poll rule
    analysis: RasAnalysis | None = None  # the last poll's suspects, restricted to the hung communicators
    # No communicator hung, and every rank of every communicator launched the same collectives with no count moving
    # between the polls: between two collectives, or every rank inside one that never completes.
    frozen_equal: bool = False

    @property
    def culprit_ranks(self) -> list[int]:
        return self.analysis.culprit_ranks if self.analysis is not None else []

    @property
    def desync(self) -> bool:
        """A hung communicator whose ranks launched different collectives (``nccl_ras.desync_ranks``)."""
        return self.analysis is not None and self.analysis.desync

    @property
    def summary(self) -> str:
        ok = [p for p in self.polls if p.report is not None]
        if not ok:
            return f"no NCCL RAS evidence from {self.addr}: {self.polls[-1].error if self.polls else 'not polled'}"
        if ok[-1].report is not None and ok[-1].report.text_only:
            return f"NCCL RAS at {self.addr}: RAS text only, no per-rank counts"
        if len(ok) < 2:
            return f"NCCL RAS at {self.addr}: one report only, the two-poll rule cannot tell"
        if not self.hung and self.frozen_equal:
            return (f"NCCL RAS at {self.addr}: every rank launched the same collectives and no count moved across "
                    "two polls (with spinning GPUs: a hang inside a launched collective)")
        if not self.hung:
            return f"NCCL RAS at {self.addr}: no communicator hung across two polls"
        ranks = ",".join(map(str, self.culprit_ranks)) or "none mapped to a global rank"
        what = " whose ranks launched different collectives (a desync)" if self.desync else ""
        return f"NCCL RAS at {self.addr}: {len(self.hung)} hung communicator(s){what}; culprit ranks {ranks}"

    def to_json(self) -> dict[str, Any]:
        last = next((p.report for p in reversed(self.polls) if p.report is not None), None)
        return {"addr": self.addr, "polls": [p.to_json() for p in self.polls], "hung_communicators": list(self.hung),
                "hung": self.analysis.to_json() if self.analysis is not None else None,
                "last_report": analyze_report(last).to_json() if last is not None else None,
                "culprit_ranks": self.culprit_ranks, "summary": self.summary}


def comm_progress(job_id: str, prev: RasReport, cur: RasReport, t: float,
                  rank_map: Mapping[HostPid, int] | None = None, world_size: int | None = None,
                  source: str = "") -> CommProgress | None:
    """What two reports say about the job's progress: ``moving`` when some rank's count of some collective rose
    (or a communicator appeared), else ``frozen_unequal`` with the global ranks behind the others or missing (in
    a desync, the odd ranks that launched other collectives), else ``frozen_equal``. None when they carry no
    counts (an old server's text report)."""
    if prev.text_only or cur.text_only:
        return None
    before = {c.id: _counts(c) for c in prev.communicators}
    for c in cur.communicators:
        old = before.get(c.id)
        if old is None or any(n > old.get(rank, {}).get(op, 0) for rank, counts in _counts(c).items()
                              for op, n in counts.items()):
            return CommProgress(job_id, t, "moving", source=source)
    a = analyze_report(cur, rank_map, world_size)
    if not (a.comms_behind or a.comms_missing):
        return CommProgress(job_id, t, "frozen_equal", source=source)
    return CommProgress(job_id, t, "frozen_unequal", tuple(a.culprit_ranks), source, a.desync)


def compare_polls(addr: str, polls: tuple[RasPoll, ...], rank_map: Mapping[HostPid, int] | None = None,
                  world_size: int | None = None) -> RasEvidence:
    """The two-poll rule over the last two readable JSON reports."""
    good = [p.report for p in polls if p.report is not None and not p.report.text_only]
    if len(good) < 2:
        return RasEvidence(addr, polls)
    prev, cur = good[-2], good[-1]
    hung = hung_communicators(prev, cur)
    analysis = analyze_report(cur, rank_map, world_size, comms=hung) if hung else None
    frozen_equal = not hung and bool(cur.communicators) and comm_progress("", prev, cur, 0.0) == CommProgress(
        "", 0.0, "frozen_equal")
    return RasEvidence(addr, polls, tuple(hung), analysis, frozen_equal)


def poll_once(addr: str, timeout_s: float, query_fn: Query = query) -> RasPoll:
    """One query; any failure is recorded in the poll, never raised (a failing socket is no evidence)."""
    at, mono = time.time(), time.monotonic()
    try:
        reply = query_fn(addr, timeout_s)
        return RasPoll(at, mono, reply, read_reply(reply))
    except WatchdogError as e:
        return RasPoll(at, mono, error=str(e))
    except Exception as e:  # a bug must not cost the incident its other evidence
        return RasPoll(at, mono, error=f"{type(e).__name__}: {e}")


def write_ras_evidence(incident_dir: Path, evidence: RasEvidence) -> None:
    """``ras.json``: both polls' raw reports, the hung communicators, their suspects and ``culprit_ranks``."""
    path = incident_dir / "ras.json"
    try:
        write_atomic(path, json.dumps(evidence.to_json(), indent=1) + "\n")
    except OSError as e:
        note_write_error(f"RAS evidence ({path})", e)


# -- which jobs, at which address -----------------------------------------------------------------------------
def _environ(pid: int) -> dict[str, str]:
    try:
        import psutil

        return dict(psutil.Process(pid).environ())
    except Exception:
        return {}


def port_listening(port: int, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> bool | None:
    """Whether any socket of this network namespace listens on TCP ``port`` (None: the tables cannot be read). One
    read of the kernel's socket tables: far cheaper than a process's descriptors, and on a node without NCCL RAS
    (a gloo job, RAS off) it answers for every job at once."""
    want = f":{port:04X}"
    readable = False
    for table in tables:
        try:
            with open(table) as f:
                readable = True
                next(f, None)  # the header
                for line in f:
                    fields = line.split(None, 4)
                    if len(fields) > 3 and fields[3] == "0A" and fields[1].endswith(want):  # 0A: TCP_LISTEN
                        return True
        except OSError:
            continue
    return False if readable else None


def _listens_on(pid: int, port: int) -> bool:
    """Whether the process has a listening TCP socket on ``port``: every NCCL process with RAS running binds the
    RAS client port (SO_REUSEPORT), so this is "RAS answers for this job" without connecting anywhere."""
    try:
        import psutil

        proc = psutil.Process(pid)
        conns = (getattr(proc, "net_connections", None) or proc.connections)(kind="inet")
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)
    except Exception:
        return False


def ras_target(cfg: RasConfig, pids: list[int]) -> str | None:
    """The RAS address to ask about a job of these rank processes, or None when it is not asked: ``off``, or
    ``auto`` and no rank listens on the RAS port (a gloo job, NCCL not initialised yet, NCCL_RAS_ENABLE=0)."""
    if cfg.enabled == "off" or not pids:
        return None
    addr = cfg.addr or _environ(pids[0]).get(ADDR_ENV) or DEFAULT_ADDR
    if cfg.enabled == "auto":
        try:
            port = parse_addr(addr)[1]
        except WatchdogError:
            return None  # a job's own NCCL_RAS_ADDR that NCCL would refuse too
        if port_listening(port) is False or not any(_listens_on(p, port) for p in pids):
            return None
    return addr


def local_rank_map(rank_pids: Mapping[int, int]) -> dict[HostPid, int]:
    """(this node's address, pid) → global rank for the job's local rank processes. RAS names a process by the
    IP of its bootstrap interface, so every address of this node is paired with each pid."""
    try:
        import psutil

        addrs = {a.address.split("%")[0] for nics in psutil.net_if_addrs().values() for a in nics
                 if a.family.name in ("AF_INET", "AF_INET6")}
    except Exception:
        addrs = set()
    return {(ip, pid): rank for rank, pid in rank_pids.items() for ip in addrs}


# -- the poller ----------------------------------------------------------------------------------------------
@dataclass
class _JobRas:
    pids: tuple[int, ...]
    addr: str | None  # None: the job is not asked
    polls: tuple[RasPoll, ...] = ()
    next_at: float = 0.0  # monotonic: not before this (while the job is not asked)
    misses: int = 0  # lookups in a row that found no RAS socket in the job
    looked_at: float = 0.0  # monotonic: the last such lookup
    rank_map: Mapping[HostPid, int] | None = None  # this node's (address, pid) → global rank
    cost_s: float = 0.0  # the agent's CPU for the last query (connection, report, comparison)


class RasPoller:
    """Background RAS queries, kept per job, each on a thread of its own; each pair of readable polls of a job
    becomes a ``CommProgress`` that ``take_progress`` hands to the detector once."""

    def __init__(self, cfg: Callable[[], RasConfig], query_fn: Query = query,
                 target: Callable[[RasConfig, list[int]], str | None] = ras_target) -> None:
        self._cfg = cfg  # read at each use: a reload takes effect at the next poll
        self._query = query_fn
        self._target = target
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobRas] = {}
        self._inflight: set[str] = set()
        self._progress: list[CommProgress] = []

    def _job(self, job_id: str, rank_pids: Mapping[int, int]) -> _JobRas:
        """The job's state. Its address is looked up again for a new set of rank pids (a restart) and while none
        was found (RAS may start later: NCCL initialises on the first collective)."""
        pids = tuple(pid for _, pid in sorted(rank_pids.items()))
        with self._lock:
            js = self._jobs.get(job_id)
            if js is not None and js.pids == pids and js.addr is not None:
                return js
        addr = self._target(self._cfg(), list(pids))
        with self._lock:
            if js is None or js.pids != pids:
                js = self._jobs[job_id] = _JobRas(pids, addr, rank_map=local_rank_map(rank_pids))
            js.addr = addr
        return js

    def poll_due(self, job_id: str, rank_pids: Mapping[int, int], watch_s: float | None = None,
                 world_size: int | None = None) -> None:
        """Start a query for the job unless one runs or the last was under ``poll_interval_s`` ago — or, for a
        job only watched, ``watch_s`` and at least what keeps its queries under ``WATCH_CPU_SHARE`` of a core.
        Never blocks on the socket; the (cheap, /proc) address lookup runs once per run of the job, on the poll
        thread."""
        now = time.monotonic()
        with self._lock:
            js = self._jobs.get(job_id)
            poll_s = self._cfg().poll_interval_s
            interval = poll_s if watch_s is None else max(
                watch_s, (js.cost_s if js is not None else 0.0) / WATCH_CPU_SHARE)
            # A suspect job without a RAS socket is looked at again after poll_interval_s, whatever the backoff.
            not_before = 0.0 if js is None else (js.next_at if watch_s is not None else
                                                 min(js.next_at, js.looked_at + poll_s))
            if job_id in self._inflight or (js is not None and js.polls and now < js.polls[-1].mono + interval) \
                    or now < not_before:
                return
            self._inflight.add(job_id)
        # A daemon thread per query in flight (at most one per job): a query outliving the agent's exit is
        # dropped, never waited for.
        threading.Thread(target=self._background, args=(job_id, dict(rank_pids), world_size, watch_s is not None),
                         name=f"ras-{job_id}", daemon=True).start()

    def _background(self, job_id: str, rank_pids: dict[int, int], world_size: int | None = None,
                    watching: bool = False) -> None:
        try:
            js = self._job(job_id, rank_pids)
            cfg = self._cfg()
            if js.addr is None:
                # Not asked (no RAS socket in the job: gloo, RAS off, NCCL not up yet). A suspect job is looked at
                # again after poll_interval_s; a watched one ever less often (NCCL starts RAS with its first
                # communicator, early in a run): the lookup reads the kernel's socket tables, ~10 ms here.
                js.misses += 1
                js.looked_at = time.monotonic()
                backoff = cfg.poll_interval_s * (2 ** min(js.misses - 1, 6) if watching else 1)
                js.next_at = time.monotonic() + min(backoff, MAX_LOOKUP_BACKOFF_S)
                return
            cpu0 = time.thread_time()
            poll = poll_once(js.addr, cfg.timeout_s, self._query)
            if poll.error:
                log.debug("RAS poll of job %s: %s", job_id, poll.error)
            with self._lock:
                before = next((p for p in reversed(js.polls) if p.report is not None), None)
                js.polls = (*js.polls, poll)[-2:]
                js.next_at = 0.0
            progress = None
            if before is not None and before.report is not None and poll.report is not None:
                progress = comm_progress(job_id, before.report, poll.report, poll.at, js.rank_map, world_size,
                                         f"NCCL RAS at {js.addr}")
            with self._lock:
                js.cost_s = time.thread_time() - cpu0
                if progress is not None:
                    self._progress.append(progress)
        finally:
            with self._lock:
                self._inflight.discard(job_id)

    def take_progress(self) -> list[CommProgress]:
        """The observations made since the last call, oldest first (each is handed out once)."""
        with self._lock:
            out, self._progress = self._progress, []
        return out

    def evidence(self, job_id: str) -> RasEvidence | None:
        """The two-poll verdict over the polls made so far (None: the job was never asked)."""
        with self._lock:
            js = self._jobs.get(job_id)
        if js is None or js.addr is None:
            return None
        return compare_polls(js.addr, js.polls)

    def address(self, job_id: str, rank_pids: Mapping[int, int]) -> str | None:
        """The RAS address the job is asked at; None: it is not asked (not NCCL, ``ras.enabled = off``)."""
        return self._job(job_id, rank_pids).addr

    def incident_evidence(self, job_id: str, rank_pids: Mapping[int, int],
                          world_size: int | None = None) -> RasEvidence:
        """Two polls at least ``confirm_gap_s`` apart, compared; the last background poll counts as the first
        when it is readable and under ``poll_interval_s`` + ``confirm_gap_s`` old. Blocks at most about two
        ``timeout_s`` plus the gap; a first poll that fails ends it (no evidence). Call after ``address``."""
        js = self._job(job_id, rank_pids)
        if js.addr is None:
            return RasEvidence("", ())
        cfg = self._cfg()
        with self._lock:
            recent = [p for p in js.polls if p.report is not None
                      and time.monotonic() - p.mono <= cfg.poll_interval_s + cfg.confirm_gap_s]
        first = recent[-1] if recent else poll_once(js.addr, cfg.timeout_s, self._query)
        polls: tuple[RasPoll, ...] = (first,)
        if first.report is not None and not first.report.text_only:
            wait = cfg.confirm_gap_s - (time.monotonic() - first.mono)
            if wait > 0:
                time.sleep(wait)
            polls += (poll_once(js.addr, cfg.timeout_s, self._query),)
        with self._lock:
            js.polls = polls[-2:]
        return compare_polls(js.addr, polls, local_rank_map(rank_pids), world_size)

    def jobs(self) -> set[str]:
        with self._lock:
            return set(self._jobs)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)
