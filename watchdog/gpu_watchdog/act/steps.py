"""A recovery's steps and the one table of moves between them (``MOVES``), as ``detect/states.py`` is the detector's.

``act.recovery.Recovery`` moves through these as it acts; each move is checked here and emitted to the transcript
(``act.transcript.Moved``). The last step is the recovery's outcome, the one value the hosts read. A move missing
from the table is a bug in the recovery (``IllegalMove``), never a silent default. The table is where the safety
rules are kept: nothing is restarted, given up or stood down before the job is stopped, and a held job is never
interrupted (HELD comes straight from the judgement).
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    JUDGING = "judging"  # the incident is open: the evidence is gathered (unless another node decided), then judged
    CLAIMED = "claimed"  # the job-wide record of the next run was written or read (fallback.shared_dir)
    CHECKPOINTED = "checkpointed"  # the checkpoint step ended (saved, skipped, or failed)
    STOPPED = "stopped"  # the job's processes (or its hung ranks) were stopped
    # Outcomes: where a recovery ends.
    HELD = "held"  # not acted on (no proof the hang is in communication): the job waits (Engine.hold), watched on
    RESTARTED = "restarted"  # the target restarted the job (launch: a new run; the daemon: the restart hook ran)
    NOT_RESTARTED = "not_restarted"  # stopped, and the target's restart did not happen (hook failed; launch stopping)
    RESTARTED_ELSEWHERE = "restarted_elsewhere"  # stopped; another node's agent restarted the job (its requeue)
    BY_ENGINE = "by_engine"  # the hung ranks ended; the job's own engine restarts them (Ray Train), the job runs on
    GAVE_UP = "gave_up"  # stopped, no next run: the restart budget is spent
    STOOD_DOWN = "stood_down"  # another node's agent decided (and restarts) the next run: ranks here stopped
    GIVEN_UP_ELSEWHERE = "given_up_elsewhere"  # another node's agent decided the job gets no next run

    def __str__(self) -> str:
        return self.value


_AFTER_STOP = frozenset({Phase.RESTARTED, Phase.NOT_RESTARTED, Phase.RESTARTED_ELSEWHERE, Phase.BY_ENGINE,
                         Phase.GAVE_UP, Phase.STOOD_DOWN, Phase.GIVEN_UP_ELSEWHERE})

MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.JUDGING: frozenset({Phase.HELD, Phase.CLAIMED, Phase.CHECKPOINTED}),  # the plan: hold, or act
    Phase.CLAIMED: frozenset({Phase.CHECKPOINTED}),
    Phase.CHECKPOINTED: frozenset({Phase.STOPPED}),
    Phase.STOPPED: _AFTER_STOP,
}
OUTCOMES = frozenset({Phase.HELD, *_AFTER_STOP})  # no move out of these


class IllegalMove(RuntimeError):
    pass


def move(current: Phase, to: Phase) -> Phase:
    """The next step, when the table allows it."""
    if to not in MOVES.get(current, frozenset()):
        raise IllegalMove(f"recovery cannot go from {current} to {to}")
    return to
