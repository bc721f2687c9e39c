"""How a rank is read from a process's environment — the torchrun family (torchrun, ``torch.distributed.launch``,
Accelerate, DeepSpeed), Slurm's ``srun`` tasks, anything that exports ``RANK`` — and which job that environment
names.

Job ids: ``GPU_WATCHDOG_JOB_ID`` > ``SLURM_JOB_ID`` > ``TORCHELASTIC_RUN_ID`` > the rendezvous endpoint. torchrun
sets ``TORCHELASTIC_RUN_ID=none`` when no ``--rdzv-id`` is given: that names no job, so its ranks are told apart
by ``MASTER_ADDR:MASTER_PORT`` (``torchrun-HOST:PORT``, the same on every node of the job), or without a usable
endpoint by their torchrun agent (``torchrun-pidPID-START``, named by the scanner, which knows the process table).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from gpu_watchdog.model import JobIdentity

# The launcher sets this in the job's environment; it wins over scheduler-given ids.
JOB_ID_ENV = "GPU_WATCHDOG_JOB_ID"
_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
_JOB_ID_SOURCES = (JOB_ID_ENV, "SLURM_JOB_ID", _RUN_ID_ENV)
_SLURM_STEP_ENV = "SLURM_STEP_ID"  # set for an srun task; a batch step's shell (and all it starts) has none
_NO_RUN_ID = "none"  # torchrun's --rdzv-id default: every job launched without one says so
LAUNCHED_ID_PREFIX = "torchrun-"
MAX_JOB_ID = 128  # model.JOB_ID_RE: ^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$
_NOT_ID_CHAR = re.compile(r"[^A-Za-z0-9._:@+-]")


def int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _real_run_id(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("", _NO_RUN_ID)


def endpoint_job_id(env: Mapping[str, str]) -> str | None:
    """``torchrun-ADDR:PORT`` from ``MASTER_ADDR``/``MASTER_PORT``, or None without a usable endpoint.

    Every node of a multi-node job sees the same endpoint (so incidents of one job still merge across nodes);
    two single-node jobs on one node cannot share a listening port. Port 0 (``--master-port 0``) is no endpoint.
    IPv6 addresses lose their brackets (``[::1]`` → ``::1``); characters a job id may not hold become ``_``.
    """
    addr = (env.get("MASTER_ADDR") or "").strip().strip("[]")
    port = int_or_none((env.get("MASTER_PORT") or "").strip() or None)
    if not addr or port is None or not 0 < port < 65536:
        return None
    host = _NOT_ID_CHAR.sub("_", addr)
    while ".." in host:  # never a path component like ".."
        host = host.replace("..", "._")
    job_id = f"{LAUNCHED_ID_PREFIX}{host}:{port}"
    if len(job_id) > MAX_JOB_ID:  # a very long host name: a stable digest of it instead
        job_id = f"{LAUNCHED_ID_PREFIX}{hashlib.sha1(addr.encode()).hexdigest()[:20]}:{port}"
    return job_id


def _job_id_from_env(env: Mapping[str, str], has_rank: bool) -> str | None:
    """The first id source that names a job. A torchrun rank without a real run id (``none``) takes its
    rendezvous endpoint; without one it stays None here and the scanner names it after its agent."""
    for key in _JOB_ID_SOURCES:
        value = env.get(key)
        if key == _RUN_ID_ENV:
            if _real_run_id(value):
                return value
        elif value:
            return value
    if has_rank and _RUN_ID_ENV in env:
        return endpoint_job_id(env)
    return None


def wants_launcher_id(env: Mapping[str, str], ident: JobIdentity | None) -> bool:
    """A torchrun rank whose environment names neither a job nor a usable endpoint: the scanner gives it its
    agent's id (the parent process), which only the process table knows."""
    return (ident is not None and ident.rank is not None and _RUN_ID_ENV in env
            and _job_id_from_env(env, True) is None)


def rank_from_env(env: Mapping[str, str]) -> int | None:
    """``RANK``; else ``SLURM_PROCID``, but only in an srun task (``SLURM_STEP_ID`` set). A batch step's shell
    carries ``SLURM_PROCID=0`` and hands it to everything it starts (torchrun's agent, wrappers, ``srun``
    itself): none of those is a rank."""
    if env.get("RANK") is not None:
        return int_or_none(env.get("RANK"))
    if env.get("SLURM_PROCID") is not None and env.get(_SLURM_STEP_ENV):
        return int_or_none(env.get("SLURM_PROCID"))
    return None


def identity_from_env(env: Mapping[str, str]) -> JobIdentity | None:
    """The job identity a process carries in its environment, or None when it is not a rank of a job.

    A torchrun rank without a run id or endpoint is ``unknown`` here; ``ProcessScanner`` names it after its
    torchrun agent."""
    rank = rank_from_env(env)
    job_id = _job_id_from_env(env, rank is not None)
    if rank is None and job_id is None:
        return None
    return JobIdentity(
        job_id=job_id or "unknown",
        rank=rank,
        local_rank=int_or_none(env.get("LOCAL_RANK", env.get("SLURM_LOCALID"))),
        world_size=int_or_none(env.get("WORLD_SIZE", env.get("SLURM_NTASKS"))),
    )


__all__ = ["JOB_ID_ENV", "LAUNCHED_ID_PREFIX", "MAX_JOB_ID", "endpoint_job_id", "identity_from_env", "int_or_none",
           "rank_from_env", "wants_launcher_id"]
