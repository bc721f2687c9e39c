"""A member's rank from the environment it has now: ``RANK`` set in code with ``os.environ[…]`` (OpenRLHF's actors
before ``init_process_group("env://")``, Ray Train's workers), which ``/proc/PID/environ`` never shows; read from the
process's memory (sample.live_env) every few seconds, not each tick."""

from __future__ import annotations

import time

from gpu_watchdog.sample.live_env import live_env
from gpu_watchdog.sample.ranks.environment import rank_from_env
from gpu_watchdog.sample.ranks.member import Claim, Member

REREAD_S = 3.0
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


class LiveEnvironment:
    def rank(self, member: Member) -> Claim | None:
        now = time.monotonic()
        if now < member.env_read_at:
            return None
        member.env_read_at = now + REREAD_S
        env = live_env(member.pid, _RANK_ENV)
        rank = rank_from_env(env) if env else None
        return Claim(rank, "RANK in its live environment", dict(env)) if rank is not None and env else None

    def done(self, member: Member) -> bool:
        return member.env_read_at != 0.0  # read at least once


__all__ = ["LiveEnvironment", "REREAD_S"]
