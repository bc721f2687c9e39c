"""The daemon's crash-safe state: SQLite in WAL mode at ``<state_dir>/daemon.sqlite3``.

Tables: ``jobs`` (registrations), ``incidents`` (one row per incident the daemon handles, with its phase),
``actions`` (every action logged when it starts and again when it finishes) and ``restart_budgets``.
Fallback levels are not here: their one copy is the overlay file ``<state_dir>/jobs/<job>.json``
(store/fallback_levels.py) that ``gpu-watchdog env`` and restart hooks read. A ``fallback`` table left by an older
version is ignored.

Resume rule after a crash (``unfinished_incidents``): an action that started and never finished is
*never re-run* when it has external side effects that may already have happened — the restart hook
(a requeue or pod delete that ran twice could kill the *next* run of the job). It is recorded as
``interrupted, not re-run``. Idempotent steps (the stop ladder, which only signals processes whose
pid and create time were recorded) are simply run again.

A store that cannot be opened or written (corrupt file, read-only disk) is reported once with the reason
and replaced by an in-memory database: the daemon keeps detecting and recovering, it only loses crash-safety
until the next start. ``Store.problem`` says why.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from gpu_watchdog.model import RegisteredPid, Registration

log = logging.getLogger("gpu_watchdog.store.db")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    pids TEXT NOT NULL,            -- JSON [{"pid": int, "create_time": float, "uid": int}]
    cgroup TEXT,
    restart_hook TEXT,
    checkpoint_opt_in INTEGER NOT NULL DEFAULT 0,
    registered_by_uid INTEGER NOT NULL,
    registered_at REAL NOT NULL,
    run INTEGER                    -- the scheduler's run of the job (Slurm: SLURM_RESTART_COUNT); NULL: none
);
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY,
    job_id TEXT,
    kind TEXT NOT NULL,
    dir TEXT NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL,
    outcome TEXT
);
CREATE TABLE IF NOT EXISTS actions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    incident_id TEXT NOT NULL,
    action TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    ok INTEGER,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS actions_incident ON actions(incident_id);
CREATE TABLE IF NOT EXISTS restart_budgets (
    job_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,           -- JSON: recovery.RestartBudget.state()
    updated_at REAL NOT NULL
);
"""


class Store:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "daemon.sqlite3"
        self.problem = ""  # non-empty: the on-disk store is unusable, we run on an in-memory one
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = self._open(str(self.path))
        except (sqlite3.Error, OSError) as e:
            self._degrade(f"cannot use {self.path}: {e}")

    @staticmethod
    def _open(target: str) -> sqlite3.Connection:
        db = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=5.0)
        if target != ":memory:":
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"journal_mode is {mode}, not wal")
            db.execute("PRAGMA synchronous=NORMAL")
            ok = db.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {ok}")
        db.executescript(SCHEMA)
        if "run" not in {row[1] for row in db.execute("PRAGMA table_info(jobs)")}:  # a store from before runs
            db.execute("ALTER TABLE jobs ADD COLUMN run INTEGER")
        return db

    def _degrade(self, why: str) -> None:
        self.problem = f"state store unusable ({why}); running without crash-safe state"
        log.error("%s", self.problem)
        self._db = self._open(":memory:")

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                if self.problem:
                    raise
                self._degrade(f"{self.path}: {e}")
                return self._db.execute(sql, args).fetchall()

    # -- jobs ----------------------------------------------------------------------------------------
    def put_job(self, reg: Registration) -> None:
        self._exec("INSERT OR REPLACE INTO jobs (job_id, pids, cgroup, restart_hook, checkpoint_opt_in,"
                   " registered_by_uid, registered_at, run) VALUES (?,?,?,?,?,?,?,?)",
                   (reg.job_id, json.dumps([p.to_json() for p in reg.pids]), reg.cgroup, reg.restart_hook,
                    int(reg.checkpoint_opt_in), reg.registered_by_uid, reg.registered_at or time.time(), reg.run))

    def delete_job(self, job_id: str) -> bool:
        existed = bool(self._exec("SELECT 1 FROM jobs WHERE job_id=?", (job_id,)))
        self._exec("DELETE FROM jobs WHERE job_id=?", (job_id,))
        return existed

    def jobs(self) -> dict[str, Registration]:
        out = {}
        for row in self._exec("SELECT job_id, pids, cgroup, restart_hook, checkpoint_opt_in, registered_by_uid,"
                              " registered_at, run FROM jobs"):
            out[row[0]] = Registration(row[0], tuple(RegisteredPid.from_json(p) for p in json.loads(row[1])), row[2],
                                       row[3], bool(row[4]), int(row[5]), row[7], float(row[6] or 0.0))
        return out

    # -- incidents and actions -----------------------------------------------------------------------
    def add_incident(self, incident_id: str, job_id: str | None, kind: str, directory: str) -> None:
        self._exec("INSERT OR IGNORE INTO incidents (id, job_id, kind, dir, created_at) VALUES (?,?,?,?,?)",
                   (incident_id, job_id, kind, directory, time.time()))

    def finish_incident(self, incident_id: str, outcome: str) -> None:
        self._exec("UPDATE incidents SET finished_at=?, outcome=? WHERE id=?", (time.time(), outcome, incident_id))

    def begin_action(self, incident_id: str, action: str, detail: str = "") -> int:
        with self._lock:
            try:
                cur = self._db.execute("INSERT INTO actions (incident_id, action, started_at, detail) "
                                       "VALUES (?,?,?,?)", (incident_id, action, time.time(), detail))
                return int(cur.lastrowid or 0)
            except sqlite3.Error as e:
                if self.problem:
                    raise
                self._degrade(f"{self.path}: {e}")
        return self.begin_action(incident_id, action, detail)

    def end_action(self, seq: int, ok: bool | None, detail: str) -> None:
        self._exec("UPDATE actions SET finished_at=?, ok=?, detail=? WHERE seq=?",
                   (time.time(), None if ok is None else int(ok), detail, seq))

    def actions(self, incident_id: str) -> list[dict[str, Any]]:
        return [{"seq": r[0], "action": r[1], "started_at": r[2], "finished_at": r[3],
                 "ok": None if r[4] is None else bool(r[4]), "detail": r[5]}
                for r in self._exec("SELECT seq, action, started_at, finished_at, ok, detail FROM actions "
                                    "WHERE incident_id=? ORDER BY seq", (incident_id,))]

    def unfinished_incidents(self) -> list[dict[str, Any]]:
        return [{"id": r[0], "job_id": r[1], "kind": r[2], "dir": r[3], "created_at": r[4]}
                for r in self._exec("SELECT id, job_id, kind, dir, created_at FROM incidents "
                                    "WHERE finished_at IS NULL ORDER BY created_at")]

    def incidents(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._exec("SELECT id, job_id, kind, dir, created_at, finished_at, outcome FROM incidents "
                          "ORDER BY created_at DESC LIMIT ?", (limit,))
        return [{"id": r[0], "job_id": r[1], "kind": r[2], "dir": r[3], "created_at": r[4], "finished_at": r[5],
                 "outcome": r[6], "actions": self.actions(r[0])} for r in reversed(rows)]

    def forget_incident(self, incident_id: str) -> None:
        self._exec("DELETE FROM actions WHERE incident_id=?", (incident_id,))
        self._exec("DELETE FROM incidents WHERE id=?", (incident_id,))

    # -- restart budgets -----------------------------------------------------------------------------
    def put_budget(self, job_id: str, state: dict[str, Any]) -> None:
        self._exec("INSERT OR REPLACE INTO restart_budgets VALUES (?,?,?)", (job_id, json.dumps(state), time.time()))

    def budget(self, job_id: str) -> dict[str, Any] | None:
        rows = self._exec("SELECT state FROM restart_budgets WHERE job_id=?", (job_id,))
        return json.loads(rows[0][0]) if rows else None

    def prune_budgets(self, older_than: float) -> list[str]:
        """Forget budgets not touched since ``older_than`` (unix time); returns their job ids."""
        gone = [r[0] for r in self._exec("SELECT job_id FROM restart_budgets WHERE updated_at < ?", (older_than,))]
        self._exec("DELETE FROM restart_budgets WHERE updated_at < ?", (older_than,))
        return gone

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
