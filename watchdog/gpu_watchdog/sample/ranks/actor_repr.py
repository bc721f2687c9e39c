"""A Ray actor's rank from the ``__repr__`` it declares (``rank=N``; Ray's docs advise defining ``__repr__`` so that
actors can be told apart in logs), logged by Ray once the actor's ``__init__`` returned (sample.ray_node)."""

from __future__ import annotations

from gpu_watchdog.sample.ranks.member import Claim, Member


class ActorRepr:
    def rank(self, member: Member) -> Claim | None:
        declared = member.ray.rank() if member.ray is not None and not member.ray.driver else None
        return Claim(*declared) if declared is not None else None

    def done(self, member: Member) -> bool:
        return member.ray_final


__all__ = ["ActorRepr"]
