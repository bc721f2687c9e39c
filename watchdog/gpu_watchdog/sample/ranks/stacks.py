"""A member's rank from its stack: an argument or variable ``rank``/``global_rank`` in one ``py-spy dump --locals``
(read by evidence.stacks.spawned_ranks, handed to the scanner as its ``rank_finder``; never blocks a tick)."""

from __future__ import annotations

from gpu_watchdog.sample.ranks.member import Claim, Member


class NoRankFinder:
    """The rank finder of a scanner nobody gave one: it names no rank and has given up at once."""

    def __call__(self, pid: int, create_time: float) -> int | None:
        return None

    def gave_up(self, pid: int, create_time: float) -> bool:
        return True

    def why(self, pid: int) -> str:
        return "no stack reader"


class Stacks:
    def rank(self, member: Member) -> Claim | None:
        rank = member.rank_finder(member.pid, member.create_time)
        return Claim(rank, "a frame of its stack") if rank is not None else None

    def done(self, member: Member) -> bool:
        return member.rank_finder.gave_up(member.pid, member.create_time)


__all__ = ["NoRankFinder", "Stacks"]
