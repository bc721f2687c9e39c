"""How a job's ranks are found, one module per way: the environment a process started with (``environment``: the
torchrun family, Slurm, anything exporting ``RANK``), and for a process that joined its job's process group with no
rank there, the sources of its number (``member``'s protocol): Ray Train's record, NCCL's dump pipe, the live
environment, a Ray actor's ``__repr__``, the stack. ``sample.processes.ProcessScanner`` composes them; a new source is
one module and one line below.
"""

from __future__ import annotations

from gpu_watchdog.sample.ranks.actor_repr import ActorRepr
from gpu_watchdog.sample.ranks.live_environment import LiveEnvironment
from gpu_watchdog.sample.ranks.member import Claim, Member, MemberRankSource
from gpu_watchdog.sample.ranks.nccl_pipe import NcclDumpPipe
from gpu_watchdog.sample.ranks.ray_train import RayTrainRecord
from gpu_watchdog.sample.ranks.stacks import Stacks

# A member's number: the first source, in this order, that names it.
MEMBER_SOURCES: tuple[MemberRankSource, ...] = (
    RayTrainRecord(),
    NcclDumpPipe(),
    LiveEnvironment(),
    ActorRepr(),
    Stacks(),
)


def first_claim(member: Member) -> Claim | None:
    """The member's rank from the first source that names it, or None."""
    for source in MEMBER_SOURCES:
        if (claim := source.rank(member)) is not None:
            return claim
    return None


def none_will_name(member: Member) -> bool:
    """Every source has said all it will, and none named the member (judged on this look's facts)."""
    return all(source.done(member) for source in MEMBER_SOURCES)


__all__ = ["MEMBER_SOURCES", "Claim", "Member", "MemberRankSource", "first_claim", "none_will_name"]
