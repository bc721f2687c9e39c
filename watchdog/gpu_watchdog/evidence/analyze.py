"""Merge the rank stacks that agents on several nodes stored for one job, and diagnose the whole job.

Each node's agent sees only its own ranks; when they all wait in the same collective the culprit is on
another node. ``gpu-watchdog analyze DIR…`` reads every node's incident directory and runs the same
diagnosis over all ranks. An incident directory also holds the ranks' Flight Recorder dumps
(``flight-recorder/fr-rank-<rank>.pkl``); a directory may hold only dumps (raw ``<prefix><rank>`` files). With
both, ``evidence.culprit.merge_evidence`` decides: the FR analysis (``evidence.flight_recorder.analysis``) names the
culprit when the stacks cannot tell the ranks apart, and disagreements are reported (docs/evidence.md).

On-disk format (version 1), one file per rank under an incident directory::

    <incident_dir>/stacks/rank-<rank>.json
    {
      "version": 1,
      "rank": 3, "pid": 4242, "host": "node-a",
      "outcome": "ok",            # DumpResult.outcome (ok, py_spy_missing, permission_denied, exited, ...)
      "detail": "5 threads",      # DumpResult.detail, one line
      "elapsed_s": 0.04,          # how long py-spy took
      "t": 1795302149.0,          # unix seconds the file was written
      "world_size": 8,            # or null when unknown (then missing ranks cannot be inferred)
      "job_id": "…",              # or null
      "threads": [ … ]            # py-spy's JSON thread objects (+ "wchan"), empty unless outcome == "ok"
    }

Files are written to a temp name and renamed, so a reader never sees half a file. ``analyze`` accepts
an incident directory or its ``stacks/`` directory itself. When two directories hold the same rank, a
successful dump beats a failed one, and otherwise the later directory on the command line wins.
A rank whose dump failed, or a rank below ``world_size`` that no directory holds, counts as missing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gpu_watchdog.atomic import note_write_error, write_atomic
from gpu_watchdog.errors import EXIT_DATAERR, EXIT_NOINPUT, EXIT_OK, WatchdogError
from gpu_watchdog.evidence.culprit import SOURCE_TITLES, Verdict, merge_evidence
from gpu_watchdog.evidence.flight_recorder.analysis import (
    DEFAULT_MIN_WAIT_S,
    FrAnalysis,
    RankTrace,
    analyze_traces,
    rank_trace,
)
from gpu_watchdog.evidence.flight_recorder.dumps import FlightRecorderError, dump_files, dump_rank, load_dump
from gpu_watchdog.evidence.stacks.classify import classify_threads
from gpu_watchdog.evidence.stacks.diagnosis import Diagnosis, diagnose, format_ranks
from gpu_watchdog.evidence.stacks.dump import DumpResult
from gpu_watchdog.model import RankStack

FORMAT_VERSION = 1


class StacksNotFound(WatchdogError):
    exit_code = EXIT_NOINPUT


class BadStacksFile(WatchdogError):
    exit_code = EXIT_DATAERR


@dataclass(frozen=True)
class RankRecord:
    """One stored rank dump as read back, with its classification when the dump succeeded."""

    rank: int
    pid: int
    host: str
    outcome: str
    world_size: int | None
    stack: RankStack | None
    source: Path


def stacks_dir(incident_dir: str | os.PathLike[str]) -> Path:
    return Path(incident_dir) / "stacks"


def write_rank_stacks(
    incident_dir: str | os.PathLike[str], rank: int, host: str, result: DumpResult, *,
    world_size: int | None = None, job_id: str | None = None, worker: bool = False,
) -> Path | None:
    """Store one rank's dump as ``<incident_dir>/stacks/rank-<rank>.json`` (atomically); return the path. A dump
    of one of the rank's worker processes (``worker``) goes to ``stacks/workers/rank-<rank>-pid-<pid>.json``.
    None when the state dir cannot take it (full, read-only): the recovery goes on without the raw dump."""
    d = stacks_dir(incident_dir) / ("workers" if worker else "")
    doc = {
        "version": FORMAT_VERSION, "rank": rank, "pid": result.pid, "host": host, "outcome": result.outcome,
        "detail": result.detail, "elapsed_s": result.elapsed_s, "t": time.time(), "world_size": world_size,
        "job_id": job_id, "threads": list(result.threads), "raw": result.raw,
    }
    path = d / (f"rank-{rank}-pid-{result.pid}.json" if worker else f"rank-{rank}.json")
    try:
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(doc))
    except OSError as e:
        note_write_error(f"the stacks of rank {rank} ({path})", e)
        return None
    return path


def _read_record(path: Path) -> RankRecord:
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise BadStacksFile(f"{path}: cannot read: {e.strerror}") from e
    except ValueError as e:
        raise BadStacksFile(f"{path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise BadStacksFile(f"{path}: expected a JSON object")
    for key, typ in (("rank", int), ("pid", int), ("outcome", str), ("threads", list)):
        if not isinstance(doc.get(key), typ) or isinstance(doc.get(key), bool):
            raise BadStacksFile(f"{path}: field '{key}' missing or not {typ.__name__}")
    if doc.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise BadStacksFile(f"{path}: unsupported version {doc.get('version')!r} (expected {FORMAT_VERSION})")
    ws = doc.get("world_size")
    stack = classify_threads(doc["threads"], doc["rank"], doc["pid"]) if doc["outcome"] == "ok" else None
    return RankRecord(doc["rank"], doc["pid"], str(doc.get("host") or "?"), doc["outcome"],
                      ws if isinstance(ws, int) and not isinstance(ws, bool) else None, stack, path)


def _stack_files(base: Path) -> list[Path]:
    sd = base if base.name == "stacks" or not stacks_dir(base).is_dir() else stacks_dir(base)
    return sorted(sd.glob("rank-*.json"))


def _fr_files(base: Path) -> list[Path]:
    """An incident's ``flight-recorder/`` dumps, or the dumps in ``base`` itself (a directory of raw
    ``<prefix><rank>`` files) when it holds neither ``stacks/`` nor ``flight-recorder/``."""
    if fr_dir(base).is_dir():
        return dump_files(fr_dir(base))
    if base.name == "stacks" or stacks_dir(base).is_dir():
        return []
    return dump_files(base)


def fr_dir(incident_dir: str | os.PathLike[str]) -> Path:
    return Path(incident_dir) / "flight-recorder"


@dataclass(frozen=True)
class Evidence:
    """Everything ``analyze`` read from the directories: stack records and Flight Recorder traces."""

    records: list[RankRecord]
    traces: list[RankTrace]
    confirmed: bool = False  # some dumps come from an incident: the agent took them on a confirmed stall


def _load_rank_trace(path: Path) -> RankTrace:
    try:
        doc = load_dump(path)
    except FlightRecorderError as e:
        raise BadStacksFile(str(e)) from e
    rank = dump_rank(path, doc)
    if rank is None:
        raise BadStacksFile(f"{path}: Flight Recorder dump without a rank (no 'rank' field, no trailing digits)")
    try:
        mtime: float | None = path.stat().st_mtime
    except OSError:
        mtime = None
    return rank_trace(doc, rank, mtime)


def load_evidence(dirs: Iterable[str | os.PathLike[str]]) -> Evidence:
    """Every rank record and FR dump of the given incident, stacks or dump directories, merged by rank.
    Raises StacksNotFound (66) for a missing directory or one holding neither, BadStacksFile (65) for a bad file."""
    merged: dict[int, RankRecord] = {}
    traces: dict[int, RankTrace] = {}
    any_dir = confirmed = False
    for d in dirs:
        any_dir = True
        base = Path(d)
        if not base.is_dir():
            raise StacksNotFound(f"{d}: no such directory")
        files, dumps = _stack_files(base), _fr_files(base)
        confirmed = confirmed or (bool(dumps) and fr_dir(base).is_dir())
        if not files and not dumps:
            raise StacksNotFound(f"{d}: no stacks/rank-<r>.json files and no Flight Recorder dumps "
                                 "(flight-recorder/<prefix><rank>, or <prefix><rank> files in the directory)")
        for f in files:
            rec = _read_record(f)
            old = merged.get(rec.rank)
            if old is None or rec.stack is not None or old.stack is None:
                merged[rec.rank] = rec
        for f in dumps:
            t = _load_rank_trace(f)
            traces[t.rank] = t  # the later directory wins, as for stacks
    if not any_dir:
        raise StacksNotFound("no directories given")
    return Evidence([merged[r] for r in sorted(merged)], [traces[r] for r in sorted(traces)], confirmed)


def load_records(dirs: Iterable[str | os.PathLike[str]]) -> list[RankRecord]:
    """Every rank record of the given incident (or stacks) directories, merged by rank, sorted."""
    records = load_evidence(dirs).records
    if not records:
        raise StacksNotFound(f"{', '.join(map(str, dirs))}: no stacks/rank-<r>.json files")
    return records


def diagnose_records(records: Sequence[RankRecord]) -> Diagnosis:
    stacks = [r.stack for r in records if r.stack is not None]
    failed = [r.rank for r in records if r.stack is None]
    sizes = [r.world_size for r in records if r.world_size is not None]
    return diagnose(stacks, world_size=max(sizes) if sizes else None, missing_ranks=failed)


def analyze_dirs(dirs: Iterable[str | os.PathLike[str]]) -> Diagnosis:
    """Diagnose one job from the stacks stored by the agents of all its nodes. Raises StacksNotFound
    (exit 66) or BadStacksFile (exit 65) with one line naming the directory or file."""
    return diagnose_records(load_records(dirs))


@dataclass(frozen=True)
class JobVerdict:
    """The merged verdict over every source ``analyze`` found."""

    evidence: Evidence
    diagnosis: Diagnosis | None  # from the stacks; None without stacks
    flight_recorder: FrAnalysis | None  # None without dumps
    verdict: Verdict


def judge(ev: Evidence, *, min_wait_s: float = DEFAULT_MIN_WAIT_S) -> JobVerdict:
    """The verdict over every source. Dumps of an incident were taken on a confirmed stall: every wait counts there
    (as when the agent judged them), ``min_wait_s`` only guards raw dumps, which may catch a merely slow rank."""
    diag = diagnose_records(ev.records) if ev.records else None
    min_wait_s = 0.0 if ev.confirmed else min_wait_s
    sizes = [r.world_size for r in ev.records if r.world_size is not None]
    fr = analyze_traces(ev.traces, world_size=max(sizes) if sizes else None, min_wait_s=min_wait_s) \
        if ev.traces else None
    return JobVerdict(ev, diag, fr, merge_evidence(diag, fr))


def _collective(jv: JobVerdict) -> str | None:
    if jv.diagnosis is not None and jv.diagnosis.collective:
        return jv.diagnosis.collective
    stuck = [g for g in (jv.flight_recorder.groups if jv.flight_recorder else ()) if g.kind != "in_progress"]
    # the collective of a group that blames a culprit (a 16-rank job has many groups merely blocked behind it)
    blaming = [g for g in stuck if set(g.culprits) & set(jv.verdict.culprit_ranks)]
    return (blaming or stuck)[0].op if stuck else None


def _as_json(jv: JobVerdict) -> dict[str, Any]:
    diag, fr, v, records = jv.diagnosis, jv.flight_recorder, jv.verdict, jv.evidence.records
    return {
        "culprit_ranks": list(v.culprit_ranks), "culprit_evidence": v.evidence, "collective": _collective(jv),
        "reason": v.reason, "desync": bool(diag and diag.desync), "disagreements": list(v.disagreements),
        "groups": [{"key": k, "ranks": list(r)} for k, r in diag.groups] if diag else [],
        "ranks": [
            {"rank": r.rank, "host": r.host, "pid": r.pid, "outcome": r.outcome,
             "state": r.stack.state if r.stack else None, "op": r.stack.op if r.stack else None,
             "where": r.stack.where if r.stack else None, "active": r.stack.active if r.stack else None}
            for r in records
        ],
        "process_groups": [g.as_json() for g in fr.groups] if fr else [],
        "flight_recorder": None if fr is None else {
            "culprit_ranks": list(fr.culprit_ranks), "reason": fr.reason, "ranks": list(fr.ranks),
            "no_dump": list(fr.no_dump), "versions": list(fr.versions), "notes": list(fr.notes)},
    }


def _write_text(jv: JobVerdict, out: TextIO) -> None:
    diag, fr, v, records = jv.diagnosis, jv.flight_recorder, jv.verdict, jv.evidence.records
    culprit = format_ranks(v.culprit_ranks) if v.culprit_ranks else "unknown"
    out.write(f"culprit: {culprit}\n")
    out.write(f"collective: {_collective(jv) or '-'}{'  (desync)' if diag and diag.desync else ''}\n")
    out.write(f"reason: {v.reason}\n")
    out.write(f"evidence: {SOURCE_TITLES.get(v.evidence, v.evidence) if v.evidence else 'none names a culprit'}\n")
    for line in v.disagreements:
        out.write(f"disagreement: {line}\n")
    if fr is not None:
        versions = ",".join(fr.versions) or "?"
        dumped = format_ranks(fr.ranks) if fr.ranks else "no ranks"
        out.write(f"flight recorder: dumps of {dumped} (version {versions}); culprit "
                  f"{format_ranks(fr.culprit_ranks) if fr.culprit_ranks else 'unknown'}\n")
        for g in fr.groups:
            waited = f"  waited {g.waited_s:.0f} s" if g.waited_s is not None else ""
            out.write(f"  {g.kind:<11} {g.detail}{waited}\n")
        for note in fr.notes:
            out.write(f"  note: {note}\n")
    if diag is not None:
        out.write("groups:\n")
        for key, ranks in diag.groups:
            out.write(f"  {len(ranks):>4}  {format_ranks(ranks)}: {key}\n")
        out.write("ranks:\n")
        for r in records:
            if r.stack is None:
                out.write(f"  {r.rank:>4}  {r.host}  pid {r.pid}  {r.outcome}\n")
            else:
                s = r.stack
                state = s.state + (f" {s.op}" if s.op else "") + (" active" if s.active else "")
                out.write(f"  {r.rank:>4}  {r.host}  pid {r.pid}  {state}  {s.where}\n")


def main_analyze(dirs: Sequence[str], as_json: bool, out: TextIO = sys.stdout, *,
                 min_wait_s: float = DEFAULT_MIN_WAIT_S) -> int:
    """Body of ``gpu-watchdog analyze DIR… [--json]``.

    Exit codes: 0 a diagnosis was printed (even "culprit unknown"); 66 a directory is missing or holds neither
    stacks nor Flight Recorder dumps; 65 a stacks file or dump is unreadable or malformed (the message names it
    on stderr)."""
    try:
        ev = load_evidence(dirs)
    except WatchdogError as e:
        sys.stderr.write(f"gpu-watchdog analyze: {e}\n")
        return e.exit_code
    jv = judge(ev, min_wait_s=min_wait_s)
    if as_json:
        json.dump(_as_json(jv), out, indent=2)
        out.write("\n")
    else:
        _write_text(jv, out)
    return EXIT_OK
