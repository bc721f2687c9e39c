"""The fallback ladder: which NCCL settings the next run gets, chosen from the evidence, persisted per job.

Levels come from config (defaults: RESEARCH §3). The choice is evidence-based: an NCCL change only helps a
communication hang, so the ladder climbs only when the evidence says the hang is in communication (``decide``);
a desync, a culprit in its own code (I/O, a data wait, compute, a lock), a job that waited too long and a GPU
fault get advice and the same level. The level reached is
stored in ``<state_dir>/jobs/<job>.json`` and dropped back to 0 after ``healthy_reset_s`` without a stall.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from gpu_watchdog.atomic import note_write_error
from gpu_watchdog.config.schema import FallbackConfig

SMALL_SHM_BYTES = 1 << 30  # NCCL without P2P moves data through /dev/shm (nccl#606)

# Culprit states that are the culprit's own code, not communication: a different NCCL transport cannot help.
_APPLICATION_STATES = {
    "io": "the culprit is stuck in checkpoint I/O: raise the collective timeout or save on rank 0 only",
    "data_wait": "the culprit waits for data: check the dataloader workers and the input pipeline",
    "compute": "the culprit computes while its peers wait (mismatched collectives, e.g. generate() with "
               "different forward counts per rank, or an endless loop): make every rank issue the same collectives",
    "stopped": "a rank was stopped (SIGSTOP: a debugger, job control or a cgroup freezer): find out who stopped "
               "it; no NCCL setting helps",
    "sleep": "the culprit sleeps or polls while its peers wait: check what it waits for",
    "unknown": "the culprit is blocked in its own code (a lock, an event, a thread or process it waits on): see its "
               "stack in the incident",
}
WAITED_ADVICE = ("no rank waits in communication: the job waits on something outside it (a file, a service, a "
                 "lock, a worker); see the stacks in the incident")
DESYNC_ADVICE = ("desync: the ranks are blocked in different collectives, so they issued different sequences of "
                 "collectives. The usual cause is code that runs a different number of forward passes or "
                 "collectives per rank: generate() on a sharded model (FSDP, ZeRO-3) with per-rank decode lengths "
                 "(pass synced_gpus=True, or generate on an unsharded copy), a rank-dependent branch or early exit, "
                 "uneven data (use a DistributedSampler with drop_last, or join()). No NCCL setting helps")


def hang_place(culprit_state: str | None, where: str = "", signature: str = "") -> str:
    """Where a hang sat, to tell "the same hang again": the culprit's state and frame, else the signature."""
    return f"{culprit_state}@{where}" if culprit_state else f"signature:{signature}"


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
           desync: bool = False, communication: str = "", signature: str = "", place: str = "",
           level_advice: bool = True) -> FallbackDecision:
    """The settings for the next run after an incident of ``kind`` whose culprit was in ``culprit_state``.

    The ladder climbs one level only when the evidence says the hang is in communication (``communication``: the
    sources that say so, gather.communication_sources) and the culprit is there too — in a collective or p2p op,
    a device sync, or unknown while every rank waits in communication (a transport hang, or a culprit on another
    node). A culprit in its own code (I/O, a data wait, compute, a sleep, a lock), a desync, a job that waited too
    long, a requested restart and a GPU fault keep the level: no NCCL setting helps them, and "no culprit named"
    alone never climbs. ``level_advice``: whether the level's own advice (about NCCL on GPUs, e.g. P2P hangs on
    PCIe boxes) applies — not to a CPU (gloo) job."""
    name = cfg.levels[current_level - 1].name if 0 < current_level <= len(cfg.levels) else "none"

    def keep(advice: str, reason: str) -> FallbackDecision:
        return FallbackDecision(current_level, name, overlay(cfg, current_level), advice, False, reason, place)

    if kind == "gpu_fault":
        return keep("GPU fault: no NCCL change helps; drain the node and run the job elsewhere", "kept: GPU fault")
    if kind == "restart":
        return keep("", "kept: a requested restart (no hang was judged)")
    if desync:
        return keep(DESYNC_ADVICE, "advice only: desync (the ranks issued different collectives)")
    if signature == "waiting_timeout":
        advice = _APPLICATION_STATES.get(culprit_state or "", WAITED_ADVICE)
        return keep(advice, "advice only: the job waited longer than detect.waiting_timeout_s with no "
                            "communication evidence" if not communication else
                    "advice only: the job waited on a rank longer than detect.waiting_timeout_s")
    if not communication:
        return keep(_APPLICATION_STATES.get(culprit_state or "", WAITED_ADVICE),
                    "advice only: no communication evidence (no rank waits in a collective, no Flight Recorder or "
                    "NCCL RAS finding, no NCCL spin)")
    if culprit_state in _APPLICATION_STATES:
        return keep(_APPLICATION_STATES[culprit_state],
                    f"advice only: {culprit_state.replace('_', ' ')} (the culprit's own code, not communication; "
                    f"its peers wait for it: {communication})")
    if current_level >= len(cfg.levels):
        return keep("the fallback ladder is exhausted: collect the NCCL debug logs and escalate",
                    "kept: the ladder is exhausted")
    level = current_level + 1
    lvl = cfg.levels[level - 1]
    env = overlay(cfg, level)
    advice = lvl.advice if level_advice else ""
    if level_advice and env.get("NCCL_P2P_DISABLE") == "1" and (warning := shm_warning()):
        advice = f"{advice}; WARNING: {warning}" if advice else f"WARNING: {warning}"
    where = f"culprit in {culprit_state}" if culprit_state else "no culprit among these ranks"
    return FallbackDecision(level, lvl.name, env, advice, True, f"climbed: communication hang ({where}); "
                                                                f"evidence: {communication}", place)


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
