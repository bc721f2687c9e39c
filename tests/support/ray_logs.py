"""Ray 2.60's own logs of actors that ended, recorded from real runs of tests/zoo/ray_actor_group.py ``--variant killed
--kill-after-s`` and of ``ray.kill`` / ``ray.actor.exit_actor()`` (tests/data/ray/killed/logs): each worker as
(worker id, pid)."""

from __future__ import annotations

from pathlib import Path

from gpu_watchdog.sample import ray_node
from repo_paths import REPO

KILLED = REPO / "tests" / "data" / "ray" / "killed" / "logs"
# SIGKILLed once its __init__ had returned: its __repr__, Trainer(rank=1), logged; its end not (nothing logs a SIGKILL).
DEAD_AFTER_INIT = ("abddfc89a62b52d953ca34e84ec9561d05b7ec7a65ab85098c689339", 14236)
SURVIVOR = ("1c7291a703b748ac1aa0869119ef8226b59fdfb07a5d38215e2ea30d", 14237)  # its peer: ended by Ray, driver gone
# SIGKILLed inside __init__: leased, its actor id logged, no __repr__ yet.
DEAD_IN_INIT = ("a4aa982043e3b841667f702c65f3163b46541cc0e889f522fc4221af", 23524)
KILLED_BY_RAY = ("8b3ca1c4b2a17d65bbf61f3729ea09364a4b3c7dfb3e7eb3aa3dd87d", 15934)  # ray.kill(actor)
EXITED_ACTOR = ("0cf0912b0103696fb9d76bfc2a8a7dc3a8ddec22b0c4c873fd1f4be9", 15935)  # ray.actor.exit_actor()


def worker(worker_: tuple[str, int], logs: Path = KILLED, pid: int | None = None) -> ray_node.CoreWorker:
    """The worker as its log's name tells (nothing read yet); ``pid``: another pid's copy of it (see ``copy_log``)."""
    return ray_node.CoreWorker(pid=worker_[1] if pid is None else pid, worker_id=worker_[0], driver=False,
                               logs_dir=str(logs))


def copy_log(worker_: tuple[str, int], logs: Path, pid: int) -> ray_node.CoreWorker:
    """The worker's log as if process ``pid`` had written it (a live process stands in for the recorded one)."""
    logs.mkdir(parents=True, exist_ok=True)
    wid, old = worker_
    (logs / f"python-core-worker-{wid}_{pid}.log").write_bytes((KILLED / f"python-core-worker-{wid}_{old}.log")
                                                               .read_bytes())
    return worker(worker_, logs, pid)
