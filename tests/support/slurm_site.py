"""What the real-Slurm test files share (tests/e2e/test_slurm.py: one node; test_slurm_multinode.py: two): the
scheduler scripts, the environment a submitting shell exports, the epilog a site installs, a job's events and the
wait for a job to settle."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from daemon_helpers import GW, wait_for
from gpu_watchdog.demo.runner import read_events
from repo_paths import REPO

SCRIPTS = REPO / "scheduler" / "slurm"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def job_env(cluster_env: Mapping[str, str], **extra: str) -> dict[str, str]:
    """What the submitting shell exports (sbatch --export=ALL): the cluster's environment without this process's
    launcher, job and test variables, gpu-watchdog on PATH and importable, and ``extra``."""
    env = {k: v for k, v in cluster_env.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "NCCL_",
                                "GPU_WATCHDOG", "PYTEST", "SLURM_JOB", "SLURM_PROCID"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(REPO / "watchdog")
    env["GPU_WATCHDOG"] = GW
    env.update(extra)
    return env


def write_epilog(path: Path, socket: Path | str) -> Path:
    """The site's epilog: scheduler/slurm/epilog.sh with gpu-watchdog (a site installs it on PATH; here it is the
    venv's) and the daemon's socket."""
    path.write_text(f"#!/bin/sh\nGPU_WATCHDOG={GW} GPU_WATCHDOG_SOCKET={socket} exec {SCRIPTS / 'epilog.sh'}\n")
    path.chmod(0o755)
    return path


def events(work: Path) -> list[dict[str, Any]]:
    return read_events(work / "events.jsonl")


def wait_settled(job: Callable[[], dict[str, str]], unfinished: Callable[[], bool], timeout: float, what: str,
                 why: Callable[[], str]) -> dict[str, str]:
    """The job's final state: terminal, with none of its incidents unfinished (a requeue hook may still be about to
    run on a job that just ended FAILED), and still so a few seconds later."""
    def settled() -> dict[str, str] | None:
        info = job()
        if info.get("JobState") not in TERMINAL or unfinished():
            return None
        time.sleep(2)
        again = job()
        return again if (again.get("JobState"), again.get("Restarts")) == (info["JobState"],
                                                                          info.get("Restarts")) else None

    return wait_for(settled, timeout, what, why, poll=1.0)
