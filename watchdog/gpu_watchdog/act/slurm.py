"""Is a Slurm job still in the run an agent saw hang? Asked right before ``scontrol requeue``.

Slurm has no "requeue only if this is still run N", and a running job can be requeued: an agent that acts late —
another node's agent already requeued it, or the job is already in its next run — must not requeue again.
``scontrol -o show job ID`` gives every node the job's ``JobState`` and ``Restarts`` (the run counter the TaskProlog
registers as ``--run``)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

_FIELD = re.compile(r"(?:^|\s)(JobState|Restarts)=(\S+)")
SCONTROL_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class SlurmJob:
    state: str  # RUNNING, PENDING, REQUEUED, COMPLETING, …
    restarts: int


def parse_show_job(text: str) -> SlurmJob | None:
    """``scontrol -o show job`` output (one line, or the usual lines) → its JobState and Restarts; None when either
    is missing."""
    fields = dict(_FIELD.findall(text))
    if "JobState" not in fields or not fields.get("Restarts", "").isdigit():
        return None
    return SlurmJob(fields["JobState"], int(fields["Restarts"]))


def show_job(job_id: str, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> SlurmJob | None:
    """The job's state from ``scontrol``; None when scontrol is missing, fails or says something unreadable."""
    try:
        done = run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                   timeout=SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_show_job(done.stdout) if done.returncode == 0 else None


# States of a job that someone already requeued. A job the agent itself just stopped is COMPLETING, FAILED or
# COMPLETED, and ``scontrol requeue`` takes it back: those states are no sign of another agent.
_REQUEUED_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def moved_on(job: SlurmJob | None, run: int) -> str:
    """Why the job is no longer in run ``run`` ("" when it still is, or when Slurm could not say: then the requeue
    goes ahead, as without this check). Slurm counts ``Restarts`` up in the requeue itself, so it is the proof."""
    if job is None:
        return ""
    if job.restarts > run:
        return f"the job is already in run {job.restarts} (Restarts={job.restarts}, JobState={job.state})"
    if job.state in _REQUEUED_STATES:
        return f"the job is already requeued (JobState={job.state}, Restarts={job.restarts})"
    return ""


def cancelled(job: SlurmJob | None) -> bool:
    """A job someone cancelled is not requeued: a requeue would bring back what a person ended."""
    return job is not None and job.state == "CANCELLED"
