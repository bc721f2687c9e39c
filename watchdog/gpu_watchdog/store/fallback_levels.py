"""Per-job fallback overlay files (``<state_dir>/jobs/<job>.json``): what ``gpu-watchdog env`` and a restart
hook read to start the next run with the chosen NCCL settings."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gpu_watchdog.atomic import note_write_error
from gpu_watchdog.config.schema import FallbackConfig
from gpu_watchdog.errors import StateUnreadable
from gpu_watchdog.job.protocol import write_json_atomic
from gpu_watchdog.model import validate_job_id
from gpu_watchdog.policy.ladder import FallbackDecision
from gpu_watchdog.store import require_state_dir


class FallbackStore:
    """Per-job fallback level, crash-safe (temp + fsync + rename). A level that cannot be written (full or
    read-only state dir) is kept in memory, so the next restart of this agent's job still gets it."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir) / "jobs"
        self._unsaved: dict[str, dict[str, Any]] = {}
        self._levels: dict[str, int] = {}  # this process is the only writer of its jobs' files: read each once

    def _path(self, job_id: str) -> Path:
        return self.root / f"{validate_job_id(job_id)}.json"

    def load(self, job_id: str) -> dict[str, Any]:
        if job_id in self._unsaved:
            return dict(self._unsaved[job_id])
        try:
            data = json.loads(self._path(job_id).read_text())
        except (OSError, ValueError):
            return {"job_id": job_id, "level": 0, "env": {}, "updated_at": None}
        return data if isinstance(data, dict) else {"job_id": job_id, "level": 0, "env": {}, "updated_at": None}

    def read(self, job_id: str) -> dict[str, Any]:
        """``load`` for a reader that must not mistake an unreadable state dir for level 0 (``gpu-watchdog env``,
        a TaskProlog): only a missing file is level 0; anything else is StateUnreadable naming the path."""
        path = self._path(job_id)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            require_state_dir(self.root.parent, f"fallback of job {job_id}")
            return {"job_id": job_id, "level": 0, "env": {}, "updated_at": None}
        except PermissionError:
            raise StateUnreadable(f"cannot read {path}: permission denied (the state dir is the daemon's; "
                                  "a job gets its level from the TaskProlog)") from None
        except (OSError, ValueError) as e:
            raise StateUnreadable(f"cannot read {path}: {e}") from None
        if not isinstance(data, dict):
            raise StateUnreadable(f"cannot read {path}: not a JSON object")
        return data

    def level(self, job_id: str) -> int:
        """The job's level; read from disk once, then kept (metrics ask for every job on every tick)."""
        if job_id not in self._levels:
            self._levels[job_id] = int(self.load(job_id).get("level", 0))
        return self._levels[job_id]

    def save(self, job_id: str, decision: FallbackDecision, restart_env: dict[str, str],
             now: float | None = None) -> None:
        data = {"job_id": job_id, "level": decision.level, "name": decision.name, "env": restart_env,
                "advice": decision.advice, "reason": decision.reason, "hang_place": decision.hang_place,
                "updated_at": time.time() if now is None else now}
        self._levels[job_id] = decision.level
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self._path(job_id), data)
            self._unsaved.pop(job_id, None)
        except OSError as e:
            note_write_error(f"the fallback level of job {job_id} ({self._path(job_id)})", e)
            self._unsaved[job_id] = data

    def note_healthy(self, job_id: str, healthy_since: float, now: float, cfg: FallbackConfig) -> bool:
        """Drop the job back to level 0 once it has run without a stall for ``healthy_reset_s``."""
        if self.level(job_id) and now - healthy_since >= cfg.healthy_reset_s:
            self.save(job_id, FallbackDecision(0, "none"), {}, now)
            return True
        return False
