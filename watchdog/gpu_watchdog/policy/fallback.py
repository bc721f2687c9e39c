"""The fallback ladder: which NCCL settings the next run gets, chosen from the evidence, persisted per job.

Levels come from config (defaults: RESEARCH §3). The choice is diagnosis-aware: an NCCL change only helps a
communication hang, so a desync, a culprit stuck in checkpoint I/O or stopped, a data wait or endless compute
gets advice and the same level (a data wait or compute hang that comes back at the same place climbs after all),
and a GPU fault gets no NCCL change at all (the node needs draining). The level reached is
stored in ``<state_dir>/jobs/<job>.json`` and dropped back to 0 after ``healthy_reset_s`` without a stall.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from gpu_watchdog.atomic import note_write_error
from gpu_watchdog.config.schema import FallbackConfig
from gpu_watchdog.errors import UsageError

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
SMALL_SHM_BYTES = 1 << 30  # NCCL without P2P moves data through /dev/shm (nccl#606)

# Culprit states for which a different NCCL transport cannot help (at first: see ``decide``).
_APPLICATION_STATES = {
    "io": "the culprit is stuck in checkpoint I/O: raise the collective timeout or save on rank 0 only",
    "data_wait": "the culprit waits for data: check the dataloader workers and the input pipeline",
    "compute": "the culprit computes while its peers wait (mismatched collectives, e.g. generate() with "
               "different forward counts per rank): make every rank issue the same collectives",
    "stopped": "a rank was stopped (SIGSTOP: a debugger, job control or a cgroup freezer): find out who stopped "
               "it; no NCCL setting helps",
}
# ... and for which it never helps, however often the hang recurs: a slow file system stays slow, and a stopped
# process was stopped by someone. A data wait or endless compute that comes back at the same place after a
# plain restart may be a collective behind a process boundary (vLLM's workers under generate(), EasyR1 on
# H20s, cured by NCCL_P2P_DISABLE=1): that climbs the ladder.
_NEVER_ESCALATE = frozenset({"io", "stopped"})
DESYNC_ADVICE = ("desync: the ranks are blocked in different collectives, so they issued different sequences of "
                 "collectives. The usual cause is code that runs a different number of forward passes or "
                 "collectives per rank: generate() on a sharded model (FSDP, ZeRO-3) with per-rank decode lengths "
                 "(pass synced_gpus=True, or generate on an unsharded copy), a rank-dependent branch or early exit, "
                 "uneven data (use a DistributedSampler with drop_last, or join()). No NCCL setting helps")


def hang_place(culprit_state: str | None, where: str = "", signature: str = "") -> str:
    """Where a hang sat, to tell "the same hang again": the culprit's state and frame, else the signature."""
    return f"{culprit_state}@{where}" if culprit_state else f"signature:{signature}"


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
    reason: str = ""  # why this level: "advice only: data wait", "escalated: same hang after a plain restart", ...
    hang_place: str = ""  # hang_place() of the hang it answers: the next hang compares with it


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


def decide(cfg: FallbackConfig, current_level: int, kind: str, culprit_state: str | None, *,
           desync: bool = False, place: str = "", last_place: str = "", level_advice: bool = True) -> FallbackDecision:
    """The settings for the next run after an incident of ``kind`` whose culprit was in ``culprit_state``.

    A communication hang (culprit in a collective or a device sync, or unknown) climbs one level. A desync, slow
    I/O, a stopped rank and a GPU fault keep the level and get advice. A data wait or endless compute gets advice
    the first time; when the hang comes back at the same ``place`` as the previous one (``last_place``) after that
    plain restart, the next restart climbs (escalation). ``level_advice``: whether the level's own advice (about
    NCCL on GPUs, e.g. P2P hangs on PCIe boxes) applies — not to a CPU (gloo) job nor to a requested restart."""
    name = cfg.levels[current_level - 1].name if 0 < current_level <= len(cfg.levels) else "none"

    def keep(advice: str, reason: str) -> FallbackDecision:
        return FallbackDecision(current_level, name, overlay(cfg, current_level), advice, False, reason, place)

    if kind == "gpu_fault":
        return keep("GPU fault: no NCCL change helps; drain the node and run the job elsewhere", "kept: GPU fault")
    if desync:
        return keep(DESYNC_ADVICE, "advice only: desync (the ranks issued different collectives)")
    why = "climbed: communication hang" + (f" (culprit in {culprit_state})" if culprit_state else
                                           " (no culprit named)")
    if culprit_state in _APPLICATION_STATES:
        recurred = bool(place) and place == last_place and culprit_state not in _NEVER_ESCALATE
        if not recurred:
            again = "" if culprit_state in _NEVER_ESCALATE else " (the same hang again climbs the ladder)"
            return keep(_APPLICATION_STATES[culprit_state], f"advice only: {culprit_state.replace('_', ' ')}{again}")
        why = f"escalated: the same hang ({place}) came back after a restart"
    if current_level >= len(cfg.levels):
        return keep("the fallback ladder is exhausted: collect the NCCL debug logs and escalate",
                    "kept: the ladder is exhausted")
    level = current_level + 1
    lvl = cfg.levels[level - 1]
    env = overlay(cfg, level)
    advice = lvl.advice if level_advice else ""
    if level_advice and env.get("NCCL_P2P_DISABLE") == "1" and (warning := shm_warning()):
        advice = f"{advice}; WARNING: {warning}" if advice else f"WARNING: {warning}"
    return FallbackDecision(level, lvl.name, env, advice, True, why, place)


def diagnostics_env(cfg: FallbackConfig, incident_dir: Path, base_env: dict[str, str]) -> dict[str, str]:
    """Logs for the restarted run, kept inside the incident directory."""
    env = dict(cfg.diagnostics_env)
    for sub in ("nccl", "flight-recorder"):
        try:
            (incident_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:  # NCCL then logs nowhere; the restart matters more
            note_write_error(f"{incident_dir / sub}", e)
    env["NCCL_DEBUG_FILE"] = str(incident_dir / "nccl" / "%h.%p.log")
    if "TORCH_FR_BUFFER_SIZE" not in base_env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in base_env:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(incident_dir / "flight-recorder" / "rank-"))
    return env


def task_prolog_lines(env: dict[str, str]) -> str:
    """Slurm's TaskProlog protocol: ``export NAME=VALUE`` taken verbatim to the end of the line (no shell
    quoting); a value with a line break cannot be said that way and is left out with a ``print`` line."""
    out = []
    for k, v in sorted(env.items()):
        if "\n" in v or "\r" in v or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            out.append(f"print gpu-watchdog: {k!r} not exported (not expressible in a TaskProlog line)\n")
        else:
            out.append(f"export {k}={v}\n")
    return "".join(out)


def export_lines(env: dict[str, str]) -> str:
    import shlex

    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
