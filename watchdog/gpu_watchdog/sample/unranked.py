"""A process of a job that may be one of its ranks but whose rank no source has given yet, as the scanner last saw it
alive (``ProcessScanner.unranked_processes``): what names it meanwhile, and after it died.

A rank learned after its process died can only come from records that outlive it: Ray's (the actor's ``__repr__``
and Ray Train's worker record, both written to disk as the worker runs; ``ray_node.reread``). Nothing else is read
then, and a process is never given the rank of another.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from gpu_watchdog.sample import ray_node


def command_text(argv: Iterable[str], limit: int) -> str:
    """A command line on one line, at most ``limit`` characters (``...`` where cut); runs of spaces collapsed (a Ray
    worker's title is padded with hundreds)."""
    text = " ".join(" ".join(argv).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class Unranked:
    pid: int
    create_time: float
    command: tuple[str, ...]
    joined: bool  # joined its job's process group (sample.group_members)
    ray: ray_node.CoreWorker | None = None  # the Ray worker it is, as its log told when last read

    def after_exit(self) -> Unranked:
        """This process as Ray's records tell after it ended (they are written as the worker runs, and kept)."""
        return replace(self, ray=ray_node.reread(self.ray)) if self.ray is not None else self

    @property
    def ray_actor(self) -> bool:
        """A Ray worker leased to host an actor of the job (Ray's records name the actor from the lease on)."""
        return self.ray is not None and not self.ray.driver and bool(self.ray.actor_id)

    @property
    def may_be_rank(self) -> bool:
        """Its end may be a rank's: it joined the job's process group, or it hosts an actor of the job."""
        return self.joined or self.ray_actor

    def rank(self) -> tuple[int, str] | None:
        """Its rank and the record that gives it, from Ray's records; None when they give none."""
        return self.ray.rank() if self.ray is not None and not self.ray.driver else None

    def what(self) -> str:
        """What names it, in words: ``Ray actor Trainer c6c25460… (worker abddfc89…)``, else its command."""
        if self.ray is not None and not self.ray.driver:
            cls = ray_node.actor_class(self.command) or "?"
            return (f"Ray actor {cls} {self.ray.actor_id[:8] or '?'}… (worker {self.ray.worker_id[:8]}…)")
        return command_text(self.command, 120) or "?"

    def describe(self, host: str) -> dict[str, object]:
        """Its entry in an incident's ``unknown_ranks`` (docs/json-contract.md): host, pid, command, and ``ray``."""
        out: dict[str, object] = {"host": host, "pid": self.pid, "command": command_text(self.command, 200)}
        if self.ray is not None and not self.ray.driver:
            out["ray"] = ray_node.describe_worker(self.ray, self.command)
        return out


UnrankedProcesses = Mapping[int, Unranked]  # pid → the process as last seen alive

__all__ = ["Unranked", "UnrankedProcesses", "command_text"]
