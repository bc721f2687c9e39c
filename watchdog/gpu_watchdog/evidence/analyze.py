"""Merge the rank stacks that agents on several nodes stored for one job, and diagnose the whole job.

Each node's agent sees only its own ranks; when they all wait in the same collective the culprit is on
another node. ``gpu-watchdog analyze DIR…`` reads every node's incident directory and runs the same
diagnosis over all ranks.

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
from gpu_watchdog.evidence.classify import classify_threads
from gpu_watchdog.evidence.diagnosis import Diagnosis, diagnose, format_ranks
from gpu_watchdog.evidence.stacks import DumpResult
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


def load_records(dirs: Iterable[str | os.PathLike[str]]) -> list[RankRecord]:
    """Every rank record of the given incident (or stacks) directories, merged by rank, sorted."""
    merged: dict[int, RankRecord] = {}
    any_dir = False
    for d in dirs:
        any_dir = True
        base = Path(d)
        sd = base if base.name == "stacks" or not stacks_dir(base).is_dir() else stacks_dir(base)
        if not sd.is_dir():
            raise StacksNotFound(f"{d}: no such directory")
        files = sorted(sd.glob("rank-*.json"))
        if not files:
            raise StacksNotFound(f"{d}: no stacks/rank-<r>.json files")
        for f in files:
            rec = _read_record(f)
            old = merged.get(rec.rank)
            if old is None or rec.stack is not None or old.stack is None:
                merged[rec.rank] = rec
    if not any_dir:
        raise StacksNotFound("no directories given")
    return [merged[r] for r in sorted(merged)]


def diagnose_records(records: Sequence[RankRecord]) -> Diagnosis:
    stacks = [r.stack for r in records if r.stack is not None]
    failed = [r.rank for r in records if r.stack is None]
    sizes = [r.world_size for r in records if r.world_size is not None]
    return diagnose(stacks, world_size=max(sizes) if sizes else None, missing_ranks=failed)


def analyze_dirs(dirs: Iterable[str | os.PathLike[str]]) -> Diagnosis:
    """Diagnose one job from the stacks stored by the agents of all its nodes. Raises StacksNotFound
    (exit 66) or BadStacksFile (exit 65) with one line naming the directory or file."""
    return diagnose_records(load_records(dirs))


def _as_json(diag: Diagnosis, records: Sequence[RankRecord]) -> dict[str, Any]:
    return {
        "culprit_ranks": list(diag.culprit_ranks), "collective": diag.collective, "reason": diag.reason,
        "desync": diag.desync, "groups": [{"key": k, "ranks": list(v)} for k, v in diag.groups],
        "ranks": [
            {"rank": r.rank, "host": r.host, "pid": r.pid, "outcome": r.outcome,
             "state": r.stack.state if r.stack else None, "op": r.stack.op if r.stack else None,
             "where": r.stack.where if r.stack else None, "active": r.stack.active if r.stack else None}
            for r in records
        ],
    }


def main_analyze(dirs: Sequence[str], as_json: bool, out: TextIO = sys.stdout) -> int:
    """Body of ``gpu-watchdog analyze DIR… [--json]``.

    Exit codes: 0 a diagnosis was printed (even "culprit unknown"); 66 a directory is missing or holds no
    stacks; 65 a stacks file is unreadable or malformed (the message names it on stderr)."""
    try:
        records = load_records(dirs)
    except WatchdogError as e:
        sys.stderr.write(f"gpu-watchdog analyze: {e}\n")
        return e.exit_code
    diag = diagnose_records(records)
    if as_json:
        json.dump(_as_json(diag, records), out, indent=2)
        out.write("\n")
        return EXIT_OK
    culprit = format_ranks(diag.culprit_ranks) if diag.culprit_ranks else "unknown"
    out.write(f"culprit: {culprit}\n")
    out.write(f"collective: {diag.collective or '-'}{'  (desync)' if diag.desync else ''}\n")
    out.write(f"reason: {diag.reason}\n")
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
    return EXIT_OK
