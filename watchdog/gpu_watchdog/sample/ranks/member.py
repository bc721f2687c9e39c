"""What a source of a member's rank is: one protocol for every way the number of a process that joined its job's
process group is read, when the environment it started with names none (``mp.spawn``, Ray actors, Ray Train).

A source says which rank the member is and from what evidence (``Claim``), or nothing yet, and whether it has said
all it ever will (``done``). The scanner asks the registered sources in order (``sample.ranks.MEMBER_SOURCES``) and
takes the first claim; a member every source is done with and none named is watched as ``model.unknown_rank``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gpu_watchdog.sample import ray_node


class RankFinder(Protocol):
    """Reads the rank of a process handed its rank in code from its stack (evidence.stacks.spawned_ranks). Never
    blocks."""

    def __call__(self, pid: int, create_time: float) -> int | None:
        """Its rank once learned, None meanwhile."""

    def gave_up(self, pid: int, create_time: float) -> bool:
        """Every look is done and none named its rank."""

    def why(self, pid: int) -> str:
        """Why it has no rank (the last look's answer)."""


@dataclass(frozen=True)
class Claim:
    rank: int
    evidence: str  # in words: "Ray Train's record of its worker"
    identity: Mapping[str, str] = field(default_factory=dict)  # RANK, LOCAL_RANK, WORLD_SIZE where the source read them


class Member(Protocol):
    """A member as the sources see it, for one look (``ProcessScanner`` keeps its state between looks)."""

    pid: int
    create_time: float
    pipe_stem: str  # TORCH_NCCL_DEBUG_INFO_PIPE_FILE from its starting environment
    env_read_at: float  # monotonic: its live environment is not read again before; 0.0: never read
    rank_finder: RankFinder

    @property
    def ray(self) -> ray_node.CoreWorker | None:
        """Its Ray facts as this look read them (never read again within the look)."""

    @property
    def ray_final(self) -> bool:
        """Its Ray facts are all its log will tell (or it is no Ray worker)."""

    def read_ray(self) -> ray_node.CoreWorker | None:
        """Its Ray facts, read afresh once per look while incomplete."""

    def keep_ray(self, worker: ray_node.CoreWorker) -> None:
        """Keep what a source learned of its Ray worker (Ray Train's record)."""

    def command(self) -> tuple[str, ...]: ...


class MemberRankSource(Protocol):
    def rank(self, member: Member) -> Claim | None:
        """The member's rank and from what, or None (not known to this source, or not yet)."""

    def done(self, member: Member) -> bool:
        """This source has said all it ever will of the member (judged on the facts this look read)."""


__all__ = ["Claim", "Member", "MemberRankSource", "RankFinder"]
