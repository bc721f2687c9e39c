"""The job's own deadline in the detector (pure): when it governs a wait, and how long the wait may then last.

Some ranks wait in a collective while the ranks they wait on visibly progress (write a checkpoint, evaluate,
read): the job's own collective timeout ends that wait if it never completes, and acting earlier only destroys
the work in flight. So such a wait becomes a stall no sooner than the deadline plus ``detect.deadline_margin_s``
(and never sooner than ``waiting_timeout_s``, today's bound). A wait the deadline does not govern — unknown, or the
waiting ranks are not in communication (nothing ends it by itself) — keeps ``waiting_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.evidence.stacks.classify import COMMUNICATION_STATES
from gpu_watchdog.model import Deadline, StackEvidence


def deadline_applies(deadline: Deadline | None, waiting_on: Sequence[int], evidence: Sequence[StackEvidence],
                     still_s: float | None, cfg: DetectConfig, governed: Deadline | None = None) -> Deadline | None:
    """``deadline`` when it governs the wait: known; the waited-on ranks visibly progress — their CPU time, I/O or
    step heartbeat moved within ``detect.deadline_still_max_s`` (``still_s``: how long ago; None: never seen move),
    unlike a read that never returns or a rank in uninterruptible sleep on a dead mount, where nothing moves and
    ``waiting_timeout_s`` stands; and the waiting ranks wait in communication — the Flight Recorder found the pending
    collective it is the timeout of, or the wait's latest stack dump shows a rank that is not waited on inside a
    collective or a device sync. Else None.

    ``governed``: the deadline that already governs this same wait. It keeps governing it (the newest known
    deadline) while the waited-on ranks visibly progress: which ranks the tick sees waiting, and which dump is the
    latest, flip as the wait ends (every rank moves again at once), and a wait must never lose its deadline — and
    become a stall past ``waiting_timeout_s`` — on such a tick."""
    if still_s is None or still_s > cfg.deadline_still_max_s:
        return None
    if governed is not None:
        return deadline if deadline is not None and deadline.known else governed
    if deadline is None or not deadline.known:
        return None
    if deadline.source == "flight_recorder":
        return deadline
    if not evidence:
        return None
    waiters = [r for r in evidence[-1].ranks if r.rank not in waiting_on]
    return deadline if any(r.state in COMMUNICATION_STATES for r in waiters) else None


def wait_limit_s(waiting_since: float, deadline: Deadline | None, cfg: DetectConfig) -> float:
    """How long a wait that began at ``waiting_since`` may last before it is a stall: ``waiting_timeout_s``, or
    until the governing deadline plus ``deadline_margin_s`` when that is later."""
    limit = cfg.waiting_timeout_s
    due = deadline.due_at(waiting_since) if deadline is not None else None
    if due is not None:
        limit = max(limit, due + cfg.deadline_margin_s - waiting_since)
    return limit

