"""NCCL's RAS socket: the client protocol as NCCL's own ``ncclras`` speaks it, the JSON report, and its culprits.

Every NCCL process (NCCL >= 2.24, RAS on by default) listens on ``localhost:28028`` (``NCCL_RAS_ADDR``) and
answers for every communicator of the whole job, across all nodes. The exchange (NCCL ``src/ras/client.cc`` and
``client_support.cc``), one command per line::

    → CLIENT PROTOCOL 2          ← SERVER PROTOCOL <n>
    → TIMEOUT <s>                ← OK          (how long RAS waits on its peers; ERROR: ... when refused)
    → SET FORMAT json            ← OK          (NCCL >= 2.28.7; older servers: ERROR: Unknown command ...)
    → STATUS | VERBOSE STATUS    ← the report, then the server closes the connection

The JSON report (``communicators[]`` of ``hash``, ``size``, ``ranks[]`` and ``missing_ranks[]``) is parsed into
value objects; ``analyze_report`` names the communicator ranks behind the others' collective counts and the
missing ones, mapped to the job's global ranks through (host, pid).
"""

from __future__ import annotations

import json
import math
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpu_watchdog.errors import EXIT_DATAERR, EXIT_UNAVAILABLE, UsageError, WatchdogError

DEFAULT_PORT = 28028  # NCCL_RAS_CLIENT_PORT
DEFAULT_ADDR = f"localhost:{DEFAULT_PORT}"
ADDR_ENV = "NCCL_RAS_ADDR"
CLIENT_PROTOCOL = 2  # NCCL_RAS_CLIENT_PROTOCOL
_MAX_REPORT_BYTES = 64 << 20  # a 100k-rank job's report is well below this; a runaway server is cut off

HostPid = tuple[str, int]


class RasUnavailable(WatchdogError):
    """No RAS socket answered at the address (nothing listening, a timeout, not a RAS server)."""

    exit_code = EXIT_UNAVAILABLE


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` (NCCL_RAS_ADDR's form) → (host, port); UsageError naming the value."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise UsageError(f"bad RAS address {text!r}: expected HOST:PORT (e.g. {DEFAULT_ADDR})")
    return host, int(port)


# -- the exchange ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RasReply:
    """What one query got: the report's raw text and whether the server agreed to JSON."""

    addr: str
    server_protocol: int | None
    format: str  # "json" | "text" (the server refused SET FORMAT json: NCCL older than 2.28.7)
    text: str
    elapsed_s: float
    note: str = ""  # why the format is text, a protocol-version mismatch


class _Conn:
    """One connection whose every operation shares the query's deadline."""

    def __init__(self, addr: str, host: str, port: int, deadline: float) -> None:
        self.addr = addr
        self.deadline = deadline
        self.buf = b""
        try:
            self.sock = socket.create_connection((host, port), timeout=self._left())
        except OSError as e:
            raise RasUnavailable(f"no NCCL RAS socket answers at {addr}: {_why(e)}") from None

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RasUnavailable(f"NCCL RAS at {self.addr} did not answer in time")
        return left

    def send(self, line: str) -> None:
        try:
            self.sock.settimeout(self._left())
            self.sock.sendall(line.encode())
        except OSError as e:
            raise RasUnavailable(f"NCCL RAS at {self.addr}: {_why(e)}") from None

    def _recv(self) -> bytes:
        try:
            self.sock.settimeout(self._left())
            return self.sock.recv(65536)
        except OSError as e:
            raise RasUnavailable(f"NCCL RAS at {self.addr}: {_why(e)}") from None

    def line(self) -> str:
        """One response line (the server ends each with a newline)."""
        while b"\n" not in self.buf:
            chunk = self._recv()
            if not chunk:
                raise RasUnavailable(f"NCCL RAS at {self.addr} closed the connection unexpectedly")
            self.buf += chunk
            if len(self.buf) > 4096:
                raise RasUnavailable(f"{self.addr} does not speak the NCCL RAS protocol")
        raw, _, self.buf = self.buf.partition(b"\n")
        return raw.decode(errors="replace").rstrip("\r")

    def until_closed(self) -> str:
        data = bytearray(self.buf)
        while True:
            chunk = self._recv()
            if not chunk:
                return data.decode(errors="replace")
            data += chunk
            if len(data) > _MAX_REPORT_BYTES:
                raise RasUnavailable(f"NCCL RAS at {self.addr} sent more than {_MAX_REPORT_BYTES >> 20} MiB")

    def close(self) -> None:
        self.sock.close()


def _why(e: OSError) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return e.strerror or type(e).__name__


def server_timeout_s(timeout_s: float) -> int:
    """The ``TIMEOUT`` to ask of RAS so that its gathering (up to twice that across nodes, NCCL's
    RAS_COLLECTIVE_LEG_TIMEOUT + RAS_COLLECTIVE_EXTRA_TIMEOUT) ends inside our own deadline. Whole seconds:
    servers before 2.28 parse it as an integer."""
    return max(1, math.floor(timeout_s / 2.5))


def query(addr: str, timeout_s: float, verbose: bool = False, want_json: bool = True) -> RasReply:
    """Ask the RAS socket at ``addr`` for the job's status. Every socket operation is bounded by one deadline
    ``timeout_s`` from now. RasUnavailable when nothing answers or the peer is not a RAS server."""
    host, port = parse_addr(addr)
    t0 = time.monotonic()
    conn = _Conn(addr, host, port, t0 + timeout_s)
    try:
        conn.send(f"CLIENT PROTOCOL {CLIENT_PROTOCOL}\n")
        greeting = conn.line()
        if not greeting.upper().startswith("SERVER PROTOCOL "):
            raise RasUnavailable(f"{addr} does not speak the NCCL RAS protocol (answered {greeting[:80]!r})")
        digits = re.match(r"\d+", greeting[len("SERVER PROTOCOL "):].strip())
        protocol = int(digits.group()) if digits else None
        note = "" if protocol == CLIENT_PROTOCOL else f"server protocol {protocol} (client {CLIENT_PROTOCOL})"
        conn.send(f"TIMEOUT {server_timeout_s(timeout_s)}\n")
        answer = conn.line()
        if answer.upper() != "OK":  # the server keeps its default (5 s per leg): still within our deadline
            note = _join(note, f"TIMEOUT refused: {answer[:80]}")
        fmt = "text"
        if want_json:
            conn.send("SET FORMAT json\n")
            answer = conn.line()
            if answer.upper() == "OK":
                fmt = "json"
            else:
                note = _join(note, f"RAS text only (SET FORMAT json refused: {answer[:80]})")
        conn.send("VERBOSE STATUS\n" if verbose else "STATUS\n")
        text = conn.until_closed()
    finally:
        conn.close()
    return RasReply(addr, protocol, fmt, text, time.monotonic() - t0, note)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


# -- the report -----------------------------------------------------------------------------------------------
def _host_pid(host: str, pid: int) -> HostPid | None:
    """Where a rank's process runs, or None when RAS could not tell (host "unknown", pid -1)."""
    return (host, pid) if pid >= 0 and host and host != "unknown" else None


@dataclass(frozen=True)
class RasRank:
    rank: int  # the rank in its communicator
    host: str  # an IP address as RAS prints it; "unknown" when RAS could not tell
    pid: int  # -1 when unknown
    cuda_dev: int = -1
    nvml_dev: int = -1
    status: Mapping[str, Any] = field(default_factory=dict)  # init_state, async_error, *_flag, finalize_called
    collective_counts: Mapping[str, int] = field(default_factory=dict)  # AllReduce, AllGather, ... → launches

    @property
    def key(self) -> HostPid | None:
        return _host_pid(self.host, self.pid)


@dataclass(frozen=True)
class RasMissingRank:
    rank: int
    host: str
    pid: int
    cuda_dev: int = -1
    nvml_dev: int = -1
    unresponsive: bool = False  # its process did not answer RAS at all
    considered_dead: bool = False  # RAS declared the process dead (unreachable)

    @property
    def key(self) -> HostPid | None:
        return _host_pid(self.host, self.pid)


@dataclass(frozen=True)
class RasCommunicator:
    hash: str
    secondary_hash: str
    size: int
    ranks: tuple[RasRank, ...]
    missing_ranks: tuple[RasMissingRank, ...]

    @property
    def id(self) -> str:
        """commHash alone is not unique; NCCL pairs it with the first rank's host and pid hashes."""
        return f"{self.hash}/{self.secondary_hash}" if self.secondary_hash else self.hash


@dataclass(frozen=True)
class RasReport:
    communicators: tuple[RasCommunicator, ...]
    nccl_version: str = ""
    timeouts_count: int = 0  # RAS legs that timed out while gathering: the data may be incomplete
    text_only: bool = False  # an older server: only the readable text, no per-rank counts
    text_findings: tuple[str, ...] = ()  # text only: the report's error and warning headlines


class RasReportError(WatchdogError):
    """The report is not the JSON NCCL writes (nor its known 2.28.9 defect)."""

    exit_code = EXIT_DATAERR


# NCCL 2.28.9 writes each missing_ranks entry's ``"nvml_dev": N`` without the comma before ``"status"``. Only that
# exact spot is repaired; anything else malformed is refused.
_MISSING_COMMA = re.compile(r'("nvml_dev"\s*:\s*-?\d+)(\s*\n\s*"status"\s*:)')


def parse_report(text: str) -> RasReport:
    """The JSON report → RasReport. RasReportError with one line when it is not NCCL's JSON."""
    try:
        data = json.loads(text)
    except ValueError:
        repaired = _MISSING_COMMA.sub(r"\1,\2", text)
        try:
            data = json.loads(repaired)
        except ValueError as e:
            raise RasReportError(f"RAS report is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("communicators"), list):
        raise RasReportError("RAS report has no communicators list")
    comms = tuple(_communicator(i, c) for i, c in enumerate(data["communicators"]))
    ras = _obj(data.get("ras"))
    return RasReport(comms, str(data.get("nccl_version") or ""), _int(ras.get("timeouts_count"), 0))


def _obj(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _communicator(i: int, c: Any) -> RasCommunicator:
    if not isinstance(c, dict) or not isinstance(c.get("ranks", []), list) \
            or not isinstance(c.get("missing_ranks", []), list):
        raise RasReportError(f"RAS report: communicators[{i}] is not a communicator object")
    ranks = []
    for j, r in enumerate(c.get("ranks", [])):
        if not isinstance(r, dict) or _int(r.get("rank"), -1) < 0:
            raise RasReportError(f"RAS report: communicators[{i}].ranks[{j}] has no rank")
        counts = _obj(r.get("collective_counts"))
        ranks.append(RasRank(r["rank"], str(r.get("host", "unknown")), _int(r.get("pid"), -1),
                             _int(r.get("cuda_dev"), -1), _int(r.get("nvml_dev"), -1),
                             _obj(r.get("status")),
                             {str(k): v for k, v in counts.items() if _int(v, -1) >= 0}))
    missing = []
    for j, r in enumerate(c.get("missing_ranks", [])):
        if not isinstance(r, dict) or _int(r.get("rank"), -1) < 0:
            raise RasReportError(f"RAS report: communicators[{i}].missing_ranks[{j}] has no rank")
        st = _obj(r.get("status"))
        missing.append(RasMissingRank(r["rank"], str(r.get("host", "unknown")), _int(r.get("pid"), -1),
                                      _int(r.get("cuda_dev"), -1), _int(r.get("nvml_dev"), -1),
                                      st.get("unresponsive") is True, st.get("considered_dead") is True))
    size = _int(c.get("size"), len(ranks) + len(missing))
    return RasCommunicator(str(c.get("hash", "")), str(c.get("secondary_hash", "")), size,
                           tuple(sorted(ranks, key=lambda r: r.rank)),
                           tuple(sorted(missing, key=lambda r: r.rank)))


# The headlines of the text report's Errors and Warnings sections ("#0-0 (hash) INCOMPLETE", "DEAD", ...).
_TEXT_FINDING = re.compile(r"^(#\d+-\d+ \([0-9a-fA-F]+\) )?(INCOMPLETE|ERROR|MISMATCH|DEAD|TIMEOUT)\b")


def parse_text_report(text: str) -> RasReport:
    """What an older (text-only) server's report tells: its NCCL version and the problems it headlines, each
    with its first detail line. It has no per-rank counts, so no culprits come from it."""
    version = re.search(r"^NCCL version (\S+)", text, re.M)
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if _TEXT_FINDING.match(line):
            detail = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("  ") else ""
            found.append(f"{line.strip()}: {detail}" if detail else line.strip())
    return RasReport((), version.group(1) if version else "", text_only=True, text_findings=tuple(found))


def read_reply(reply: RasReply) -> RasReport:
    return parse_report(reply.text) if reply.format == "json" else parse_text_report(reply.text)


# -- culprits ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Suspect:
    """One communicator rank that holds the others up: behind their counts, or missing from the report."""

    comm: str  # RasCommunicator.id
    rank: int  # in that communicator
    global_rank: int | None  # in the job; None when (host, pid) maps to no known rank
    host: str
    pid: int
    why: str  # "behind" | "missing" | "desync" (it launched other collectives than the rest of its communicator)
    behind: Mapping[str, int] = field(default_factory=dict)  # collective type → launches behind the leaders
    unresponsive: bool = False
    considered_dead: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"comm": self.comm, "rank": self.rank, "global_rank": self.global_rank,
                               "host": self.host, "pid": self.pid, "why": self.why}
        if self.why in ("behind", "desync"):
            out["behind"] = dict(self.behind)
        else:
            out.update(unresponsive=self.unresponsive, considered_dead=self.considered_dead)
        return out


def behind_ranks(comm: RasCommunicator) -> dict[int, dict[str, int]]:
    """Each rank whose count for some collective type is below the highest count of that type in the
    communicator → {type: how many launches behind}. All counts equal → {}."""
    ops = sorted({op for r in comm.ranks for op in r.collective_counts})
    top = {op: max(r.collective_counts.get(op, 0) for r in comm.ranks) for op in ops}
    out: dict[int, dict[str, int]] = {}
    for r in comm.ranks:
        gaps = {op: top[op] - r.collective_counts.get(op, 0) for op in ops if r.collective_counts.get(op, 0) < top[op]}
        if gaps:
            out[r.rank] = gaps
    return out


def desync_ranks(comm: RasCommunicator) -> tuple[int, ...] | None:
    """The odd ranks of a communicator whose ranks launched *different* collectives, or None when they did not.

    Ranks that merely lag are behind on every type where they differ; a desync shows as each side ahead of the
    other on some type (rank 1 launched an AllGather where ranks 0 and 2 launched a Broadcast: Broadcast 2/1/2,
    AllGather 0/1/0). Then no group of ranks with equal counts has the highest count of every type, and the odd
    ranks are the ones outside the largest such group; with no single largest group, nobody is named: ()."""
    ops = sorted({op for r in comm.ranks for op in r.collective_counts})
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in comm.ranks:
        groups.setdefault(tuple(r.collective_counts.get(op, 0) for op in ops), []).append(r.rank)
    if len(groups) < 2:
        return None
    top = tuple(max(v[i] for v in groups) for i in range(len(ops)))
    if top in groups:
        return None  # one group launched everything the others did: they are behind, not desynced
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    if sizes[0] == sizes[1]:
        return ()
    largest = max(groups.values(), key=len)
    return tuple(sorted(r.rank for r in comm.ranks if r.rank not in largest))


def rank_map_from_report(report: RasReport, world_size: int | None = None) -> dict[HostPid, int]:
    """(host, pid) → global rank from the communicator that spans the job (size == world size; when the world
    size is unknown, the largest): torch creates its default group's communicator with comm rank = global rank."""
    if not report.communicators:
        return {}
    size = world_size or max(c.size for c in report.communicators)
    out: dict[HostPid, int] = {}
    for c in report.communicators:
        if c.size != size:
            continue
        for key, rank in [(r.key, r.rank) for r in c.ranks] + [(m.key, m.rank) for m in c.missing_ranks]:
            if key is not None:
                out.setdefault(key, rank)
    return out


@dataclass(frozen=True)
class RasAnalysis:
    report: RasReport
    suspects: tuple[Suspect, ...]
    comms_behind: tuple[str, ...]  # communicators whose ranks' counts differ
    comms_missing: tuple[str, ...]  # communicators with missing ranks
    comms_desync: tuple[str, ...] = ()  # communicators whose ranks launched different collectives

    @property
    def desync(self) -> bool:
        return bool(self.comms_desync)

    @property
    def culprit_ranks(self) -> list[int]:
        """The global ranks that hold a communicator up (behind or missing), sorted."""
        return sorted({s.global_rank for s in self.suspects if s.global_rank is not None})

    @property
    def healthy(self) -> bool:
        return not self.suspects and not self.comms_desync and not self.report.text_only

    def to_json(self) -> dict[str, Any]:
        rep = self.report
        return {
            "format": "text" if rep.text_only else "json",
            "nccl_version": rep.nccl_version,
            "timeouts_count": rep.timeouts_count,
            "communicators": [_comm_json(c, self) for c in rep.communicators],
            "culprit_ranks": self.culprit_ranks,
            "desync": self.desync,
            "suspects": [s.to_json() for s in self.suspects],
            "unmapped_suspects": [s.to_json() for s in self.suspects if s.global_rank is None],
            "healthy": self.healthy,
            **({"text_findings": list(rep.text_findings)} if rep.text_only else {}),
        }


def _comm_json(c: RasCommunicator, a: RasAnalysis) -> dict[str, Any]:
    ops = sorted({op for r in c.ranks for op in r.collective_counts})
    counts = {op: {"min": min(r.collective_counts.get(op, 0) for r in c.ranks),
                   "max": max(r.collective_counts.get(op, 0) for r in c.ranks)} for op in ops}
    return {"hash": c.hash, "secondary_hash": c.secondary_hash, "size": c.size, "ranks_count": len(c.ranks),
            "missing_ranks_count": len(c.missing_ranks), "collective_counts": counts,
            "behind": [s.to_json() for s in a.suspects if s.comm == c.id and s.why in ("behind", "desync")],
            "missing_ranks": [s.to_json() for s in a.suspects if s.comm == c.id and s.why == "missing"]}


def analyze_report(report: RasReport, rank_map: Mapping[HostPid, int] | None = None,
                   world_size: int | None = None, comms: Iterable[str] | None = None) -> RasAnalysis:
    """Name the suspects of every communicator (or only of ``comms``, by id): ranks behind the others' counts
    for some collective type, and missing ranks. Global ranks come from ``rank_map`` first (the agent's own
    rank processes), then from the communicator that spans the job."""
    mapping = {**rank_map_from_report(report, world_size), **(rank_map or {})}
    size = world_size or max((c.size for c in report.communicators), default=0)
    only = set(comms) if comms is not None else None
    suspects: list[Suspect] = []
    behind_ids, missing_ids, desync_ids = [], [], []
    for c in report.communicators:
        if only is not None and c.id not in only:
            continue

        def global_of(rank: int, key: HostPid | None, comm: RasCommunicator = c) -> int | None:
            if key is not None and key in mapping:
                return mapping[key]
            return rank if comm.size == size else None  # the job-wide communicator: comm rank is the global rank

        by_rank = {r.rank: r for r in c.ranks}
        behind = behind_ranks(c)
        if behind:
            behind_ids.append(c.id)
        odd = desync_ranks(c)
        if odd is not None:
            desync_ids.append(c.id)
        for rank, gaps in sorted(behind.items()):
            if odd is not None and rank not in odd:
                continue  # a desync: only the odd ranks hold the others up
            r = by_rank[rank]
            suspects.append(Suspect(c.id, rank, global_of(rank, r.key), r.host, r.pid,
                                    "behind" if odd is None else "desync", gaps))
        if c.missing_ranks:
            missing_ids.append(c.id)
        for m in c.missing_ranks:
            suspects.append(Suspect(c.id, m.rank, global_of(m.rank, m.key), m.host, m.pid, "missing",
                                    unresponsive=m.unresponsive, considered_dead=m.considered_dead))
    return RasAnalysis(report, tuple(suspects), tuple(behind_ids), tuple(missing_ids), tuple(desync_ids))


_SHOWN_PER_COMM = 16  # a lost node of a large job is missing from every communicator: keep the text readable


def format_analysis(a: RasAnalysis, addr: str) -> str:
    """The readable form: one block per communicator with a problem, then the verdict."""
    rep = a.report
    lines = [f"NCCL RAS at {addr}" + (f" (NCCL {rep.nccl_version})" if rep.nccl_version else "")]
    if rep.text_only:
        lines.append("RAS text only: this NCCL does not offer the JSON report, so no per-rank counts")
        lines += [f"  {f}" for f in rep.text_findings] or ["  the report headlines no errors or warnings"]
        return "\n".join(lines) + "\n"
    lines.append(f"{len(rep.communicators)} communicator(s)"
                 + (f"; {rep.timeouts_count} RAS timeout(s) while gathering: data may be incomplete"
                    if rep.timeouts_count else ""))
    for c in rep.communicators:
        mine = [s for s in a.suspects if s.comm == c.id]
        state = "ok" if not mine else "PROBLEM"
        lines.append(f"  comm {c.hash} size {c.size}: {len(c.ranks)} rank(s) reported, "
                     f"{len(c.missing_ranks)} missing - {state}")
        for s in mine[:_SHOWN_PER_COMM]:
            who = f"rank {s.rank}" + (f" (global {s.global_rank})" if s.global_rank is not None else "")
            where = f"pid {s.pid} on {s.host}" if s.pid >= 0 else "process unknown"
            if s.why in ("behind", "desync"):
                gaps = ", ".join(f"{op} -{n}" for op, n in sorted(s.behind.items()))
                odd = " - launched other collectives than the rest (desync)" if s.why == "desync" else ""
                lines.append(f"    {who} behind: {gaps}{odd} ({where})")
            else:
                flags = [f for f, on in (("unresponsive", s.unresponsive), ("dead", s.considered_dead)) if on]
                lines.append(f"    {who} missing{' (' + ', '.join(flags) + ')' if flags else ''} ({where})")
        if len(mine) > _SHOWN_PER_COMM:
            lines.append(f"    ... and {len(mine) - _SHOWN_PER_COMM} more (--json lists them all)")
    if a.healthy:
        lines.append("nothing wrong: every communicator's ranks are present with equal collective counts")
    else:
        ranks = ",".join(map(str, a.culprit_ranks)) or "none mapped to a global rank"
        lines.append(f"culprit_ranks: {ranks}")
    return "\n".join(lines) + "\n"
