"""What the zoo's Ray programs share: a local Ray cluster the way a test may start one — on 127.0.0.1 only, no usage
report, its files under the job's work directory, its token in a home of its own — with the zoo's modules
importable in its workers (they inherit the driver's environment through the raylet)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def start_local_ray(num_cpus: int) -> None:
    """``ray.init()`` of a cluster that is the driver's child: bound to 127.0.0.1 (Ray binds the node's interface
    address unless told the cluster is local), no dashboard, no usage report, nothing under ~/.ray."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # node IP = 127.0.0.1 (ray._private.services)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    import ray

    # A Unix socket path must stay under 108 bytes: the session directory goes under a short temporary root.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    os.environ["HOME"] = temp  # Ray >= 2.5x writes its auth token to ~/.ray/auth_token
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp, log_to_driver=True)
