"""The fallback ladder: which NCCL settings the next run gets, chosen from the evidence, persisted per job.

Levels come from config (defaults: RESEARCH §3). The choice is diagnosis-aware: an NCCL change only helps a
communication hang, so a culprit stuck in checkpoint I/O, a data wait or endless compute gets advice and the
same level, and a GPU fault gets no NCCL change at all (the node needs draining). The level reached is
stored in ``<state_dir>/jobs/<job>.json`` and dropped back to 0 after ``healthy_reset_s`` without a stall.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_watchdog.config import FallbackConfig
from gpu_watchdog.errors import UsageError
from gpu_watchdog.jobproto import write_json_atomic

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
SMALL_SHM_BYTES = 1 << 30  # NCCL without P2P moves data through /dev/shm (nccl#606)

# Culprit states for which a different NCCL transport cannot help.
_APPLICATION_STATES = {
    "io": "the culprit is stuck in checkpoint I/O: raise the collective timeout or save on rank 0 only",
    "data_wait": "the culprit waits for data: check the dataloader workers and the input pipeline",
    "compute": "the culprit computes while its peers wait (mismatched collectives, e.g. generate() with "
               "different forward counts per rank): make every rank issue the same collectives",
}


def validate_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID_RE.fullmatch(job_id) or ".." in job_id:
        raise UsageError(f"invalid job id {job_id!r}: use letters, digits and ._:@+- (no '/', '..' or control "
                         "characters, at most 128)")
    return job_id


@dataclass(frozen=True)
class FallbackDecision:
    level: int  # 0 = no overlay
    name: str
    env: dict[str, str] = field(default_factory=dict)  # the overlay for the next run (level + network)
    advice: str = ""
    changed: bool = False  # the NCCL settings differ from the last run's


def shm_warning() -> str:
    try:
        total = shutil.disk_usage("/dev/shm").total
    except OSError:
        return "/dev/shm is missing: NCCL without P2P needs it"
    if total < SMALL_SHM_BYTES:
        return (f"/dev/shm is only {total >> 20} MiB: NCCL without P2P goes through it; give the container "
                "--shm-size=8g or more")
    return ""


def overlay(cfg: FallbackConfig, level: int) -> dict[str, str]:
    if level <= 0:
        return {}
    env = dict(cfg.levels[min(level, len(cfg.levels)) - 1].env)
    env.update(cfg.network_env)
    return env


def decide(cfg: FallbackConfig, current_level: int, kind: str, culprit_state: str | None) -> FallbackDecision:
    """The settings for the next run after an incident of ``kind`` whose culprit was in ``culprit_state``."""
    name = cfg.levels[current_level - 1].name if 0 < current_level <= len(cfg.levels) else "none"
    keep = FallbackDecision(current_level, name, overlay(cfg, current_level))
    if kind == "gpu_fault":
        return FallbackDecision(keep.level, keep.name, keep.env,
                                "GPU fault: no NCCL change helps; drain the node and run the job elsewhere")
    if culprit_state in _APPLICATION_STATES:
        return FallbackDecision(keep.level, keep.name, keep.env, _APPLICATION_STATES[culprit_state])
    if current_level >= len(cfg.levels):
        return FallbackDecision(keep.level, keep.name, keep.env,
                                "the fallback ladder is exhausted: collect the NCCL debug logs and escalate")
    level = current_level + 1
    lvl = cfg.levels[level - 1]
    env = overlay(cfg, level)
    advice = lvl.advice
    if env.get("NCCL_P2P_DISABLE") == "1" and (warning := shm_warning()):
        advice = f"{advice}; WARNING: {warning}" if advice else f"WARNING: {warning}"
    return FallbackDecision(level, lvl.name, env, advice, changed=True)


def diagnostics_env(cfg: FallbackConfig, incident_dir: Path, base_env: dict[str, str]) -> dict[str, str]:
    """Logs for the restarted run, kept inside the incident directory."""
    env = dict(cfg.diagnostics_env)
    (incident_dir / "nccl").mkdir(exist_ok=True)
    (incident_dir / "flight-recorder").mkdir(exist_ok=True)
    env["NCCL_DEBUG_FILE"] = str(incident_dir / "nccl" / "%h.%p.log")
    if "TORCH_FR_BUFFER_SIZE" not in base_env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in base_env:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(incident_dir / "flight-recorder" / "rank-"))
    return env


class FallbackStore:
    """Per-job fallback level, crash-safe (temp + rename)."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir) / "jobs"

    def _path(self, job_id: str) -> Path:
        return self.root / f"{validate_job_id(job_id)}.json"

    def load(self, job_id: str) -> dict[str, Any]:
        try:
            data = json.loads(self._path(job_id).read_text())
        except (OSError, ValueError):
            return {"job_id": job_id, "level": 0, "env": {}, "updated_at": None}
        return data if isinstance(data, dict) else {"job_id": job_id, "level": 0, "env": {}, "updated_at": None}

    def level(self, job_id: str) -> int:
        return int(self.load(job_id).get("level", 0))

    def save(self, job_id: str, decision: FallbackDecision, restart_env: dict[str, str],
             now: float | None = None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self._path(job_id), {
            "job_id": job_id, "level": decision.level, "name": decision.name, "env": restart_env,
            "advice": decision.advice, "updated_at": time.time() if now is None else now})

    def note_healthy(self, job_id: str, healthy_since: float, now: float, cfg: FallbackConfig) -> bool:
        """Drop the job back to level 0 once it has run without a stall for ``healthy_reset_s``."""
        data = self.load(job_id)
        if data.get("level", 0) and now - healthy_since >= cfg.healthy_reset_s:
            self.save(job_id, FallbackDecision(0, "none"), {}, now)
            return True
        return False


def export_lines(env: dict[str, str]) -> str:
    import shlex

    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
