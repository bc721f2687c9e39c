"""Incident directories: one per incident under ``<state_dir>/incidents/<id>/``.

Each holds ``summary.json`` (the contract in docs/json-contract.md: id, job_id, kind, signature, onset, detected_at,
culprit_ranks, collective, stacks_dir, actions, fallback — plus host, ranks, reason, advice, and ``finding``,
the detector's own words, kept when ``reason`` is replaced by the stack diagnosis), ``stacks/`` (raw py-spy
output per rank), ``report.txt`` (readable: culprit first, then the grouped stacks) and whatever else the
recovery collected (Flight Recorder dumps, NCCL debug logs of the restart), and ``trace.jsonl``: the node's
samples of the ``agent.incident_trace_s`` before confirmation, in the trace format (``replay`` runs on it).
``summary.json`` is rewritten atomically after every change, so a crash never leaves half of it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_watchdog.atomic import note_write_error, write_atomic
from gpu_watchdog.errors import NoInputError, UsageError
from gpu_watchdog.model import Finding
from gpu_watchdog.store.db import Store

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class Incident:
    dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    journal: Store | None = None  # the daemon's SQLite store: actions logged there before and after they run
    _seqs: dict[int, int] = field(default_factory=dict, repr=False)
    _kept: dict[str, str] = field(default_factory=dict, repr=False)  # files written once, held until on disk

    @property
    def id(self) -> str:
        return str(self.summary["id"])

    @property
    def stacks_dir(self) -> Path:
        return self.dir / "stacks"

    def save(self) -> None:
        """Write summary.json. A full or read-only state dir keeps the summary in memory (the next save tries
        again, so it lands once space returns) instead of stopping the recovery that is writing it."""
        if self._write("summary.json", json.dumps(self.summary, indent=1, sort_keys=True) + "\n"):
            self._write_kept()

    def keep_file(self, name: str, text: str) -> None:
        """Write a file the incident has only once (its trace): held in memory until it is on disk, so a full
        disk or a deleted directory gets it on a later save, like the summary."""
        self._kept[name] = text
        self._write_kept()

    def _write_kept(self) -> None:
        for name, text in list(self._kept.items()):
            if not (self.dir / name).exists():
                self._write(name, text)

    def _write(self, name: str, text: str) -> bool:
        try:
            (self.dir / "stacks").mkdir(parents=True, exist_ok=True)
            write_atomic(self.dir / name, text)
            return True
        except OSError as e:
            note_write_error(f"incident {self.id} ({self.dir / name})", e)
            return False

    def update(self, **fields: Any) -> None:
        self.summary.update(fields)
        self.save()

    def begin_action(self, action: str, detail: str = "") -> dict[str, Any]:
        """Log an action before it runs (ok = null), so a crash mid-action is visible and resumable."""
        seq = self.journal.begin_action(self.id, action, detail) if self.journal else None  # the durable record first
        entry: dict[str, Any] = {"action": action, "at": time.time(), "ok": None, "detail": detail}
        self.summary["actions"].append(entry)
        if seq is not None:
            self._seqs[id(entry)] = seq
        self.save()
        return entry

    def end_action(self, entry: dict[str, Any], ok: bool, detail: str, outcome: str | None = None) -> None:
        """``outcome``: "ok" or "failed" by default; "skipped" or "not_available" (with ``ok`` false) for an action
        that neither ran nor failed — a checkpoint the job did not opt in to, Flight Recorder dumps nothing can
        trigger."""
        entry.update(ok=ok, detail=detail, done_at=time.time(), outcome=outcome or ("ok" if ok else "failed"))
        self.save()
        seq = self._seqs.pop(id(entry), None)
        if seq is not None and self.journal is not None:
            self.journal.end_action(seq, ok, detail)

    def finish(self, outcome: str) -> None:
        """The incident is over (nothing left to resume after a restart of the agent)."""
        self.update(outcome=outcome, finished_at=time.time())
        if self.journal is not None:
            self.journal.finish_incident(self.id, outcome)

    def record_action(self, action: str, ok: bool, detail: str, outcome: str | None = None) -> None:
        self.end_action(self.begin_action(action), ok, detail, outcome)

    def write_report(self, text: str) -> None:
        if not self._write("report.txt", text):
            import sys

            print(text, file=sys.stderr, flush=True)  # the report still reaches the console / journal


class IncidentStore:
    def __init__(self, state_dir: str | Path, journal: Store | None = None) -> None:
        self.root = Path(state_dir) / "incidents"
        self.journal = journal

    def create(self, finding: Finding, host: str, now: float | None = None) -> Incident:
        now = time.time() if now is None else now
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
        job = re.sub(r"[^A-Za-z0-9._-]", "_", finding.job_id or "node")[:48]
        base = f"{stamp}-{job}-{finding.kind}"
        n = 0
        while True:  # mkdir is the atomic claim of an id
            iid = base if n == 0 else f"{base}-{n}"
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                (self.root / iid).mkdir()
                break
            except FileExistsError:
                n += 1
            except OSError as e:  # full or read-only: the incident lives in memory; saves retry the directory
                note_write_error(f"incident directory {self.root / iid}", e)
                break
        d = self.root / iid
        inc = Incident(d, {
            "id": iid, "job_id": finding.job_id, "kind": finding.kind, "signature": finding.signature,
            "onset": finding.onset, "detected_at": finding.confirmed_at, "host": host,
            "ranks": list(finding.ranks), "culprit_ranks": list(finding.culprit_ranks), "collective": None,
            "reason": finding.detail, "finding": finding.detail, "evidence": finding.basis,
            "devices": list(finding.devices),
            "stacks_dir": str(d / "stacks"), "actions": [], "fallback": None, "advice": None,
        }, self.journal)
        inc.save()
        if self.journal is not None:
            self.journal.add_incident(iid, finding.job_id, finding.kind, str(d))
        return inc

    def list(self) -> list[dict[str, Any]]:
        """Every readable incident summary, oldest first (by detection time, then id)."""
        out: list[dict[str, Any]] = []
        if not self.root.is_dir():
            return out
        for d in self.root.iterdir():
            try:
                s = json.loads((d / "summary.json").read_text())
            except (OSError, ValueError):
                continue
            if isinstance(s, dict) and "id" in s:
                out.append(s)
        out.sort(key=lambda s: (s.get("detected_at") or 0, s["id"]))
        return out

    def get(self, incident_id: str) -> Incident:
        if not _ID_RE.match(incident_id):
            raise UsageError(f"not an incident id: {incident_id!r}")
        d = self.root / incident_id
        try:
            return Incident(d, json.loads((d / "summary.json").read_text()), self.journal)
        except FileNotFoundError:
            raise NoInputError(f"no incident {incident_id!r} in {self.root}") from None
