"""An NCCL rank's number from the Flight Recorder dump pipe it holds open,
``<TORCH_NCCL_DEBUG_INFO_PIPE_FILE><rank>.pipe`` (``launch`` turns the pipe on; sample.group_members). Asked each
look: a rank opens it once its group is up."""

from __future__ import annotations

from gpu_watchdog.sample import group_members
from gpu_watchdog.sample.ranks.member import Claim, Member


class NcclDumpPipe:
    def rank(self, member: Member) -> Claim | None:
        rank = group_members.pipe_rank(member.pid, member.pipe_stem)
        return Claim(rank, "the NCCL dump pipe it holds open") if rank is not None else None

    def done(self, member: Member) -> bool:
        return True  # a gloo rank never opens one: nothing to wait for


__all__ = ["NcclDumpPipe"]
