"""Restarts a job's own engine performs, where it has one: Ray Train restarts a failed worker group from its latest
checkpoint while its ``FailureConfig(max_failures)`` has a restart left (sample.ray_node reads both from Ray's own
files). Ending only the hung workers then turns a silent hang into a failure the engine handles, with the driver
and the Ray cluster kept. Such a restart cannot carry new NCCL settings (the new workers inherit the raylet's
environment): policy.plan takes it only for a restart at the same fallback level."""

from __future__ import annotations

from collections.abc import Mapping

from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.group_members import fd_targets


def engine_restart(rank_pids: Mapping[int, int]) -> str:
    """What the job's own engine offers to restart its hung ranks, in one line; "" when nothing does. Offered only
    when every rank on this node is a Ray Train worker of one run whose fault tolerance has a restart left."""
    runs: set[tuple[str, str]] = set()
    for pid in rank_pids.values():
        worker = ray_node.core_worker(pid, fd_targets(pid))
        if worker is None or worker.train is None:
            return ""
        runs.add((worker.logs_dir, worker.train.run_name))
    if len(runs) != 1:
        return ""
    ft = ray_node.train_fault_tolerance(*runs.pop())
    return ft.describe() if ft is not None and ft.restarts_left else ""


__all__ = ["engine_restart"]
