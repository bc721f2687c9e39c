"""What the zoo's Ray programs share: ``ray.init()`` the way a test may run it — a local cluster on 127.0.0.1 only,
with no usage report, its files under a temporary directory and its auth token in a home of its own; or, with
``RAY_ADDRESS`` set, the running cluster there (``ray start``) — and the zoo's modules and the run's count handed
to the workers through the job's ``runtime_env``, as a Ray user hands a job its environment."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What a worker needs from the driver's environment: the zoo's modules, and the run (zoo_common.fault_armed).
_HANDED = ("GPU_WATCHDOG_RESTART_COUNT",)


def start_ray(num_cpus: int) -> None:
    """``ray.init()``: of the cluster at ``RAY_ADDRESS`` when set, else of a local cluster that is the driver's child —
    bound to 127.0.0.1 (Ray binds the node's interface address unless told the cluster is local), no dashboard, no
    usage report, nothing under the user's ~/.ray."""
    import ray

    env_vars = {"PYTHONPATH": str(HERE), **{k: os.environ[k] for k in _HANDED if k in os.environ}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env={"env_vars": env_vars})
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # node IP = 127.0.0.1 (ray._private.services)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # A Unix socket path must stay under 108 bytes: the session directory goes under a short temporary root.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    os.environ["HOME"] = temp  # Ray >= 2.5x writes its auth token to ~/.ray/auth_token
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp, runtime_env={"env_vars": env_vars})
