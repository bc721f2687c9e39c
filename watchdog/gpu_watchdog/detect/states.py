"""The detector's job states (``model.JobState``) and the one table of moves between them.

Each tick the detector observes a job's facts and reduces them to one ``Event``; ``transition`` looks the move up in
``TRANSITIONS``. A pair missing from the table is a bug in the detector (``IllegalTransition``), never a silent
default. docs/detector-states.md prints the table; tests/unit/detect/test_states.py walks every row.
"""

from __future__ import annotations

from enum import Enum

from gpu_watchdog.model import JobState


class Event(str, Enum):
    """One tick of a job reduced to what decides its next state."""

    PROGRESS = "progress"  # every rank moved (or NCCL's counts rose)
    PARTIAL = "partial"  # some ranks moved and others did not; or they moved only in their stacks; or GPUs worked
    QUIET = "quiet"  # nothing moved, for less than suspect_after_s
    QUIET_LONG = "quiet_long"  # nothing moved for suspect_after_s, not proven yet
    PROVEN = "proven"  # nothing moved for suspect_after_s, and two unchanged dumps (or confirm_after_s) prove it
    HELD_QUIET = "held_quiet"  # a held stall (judged, not in communication) is still quiet
    TIMED_OUT = "timed_out"  # a wait (partial, or held) lasted waiting_timeout_s
    NOT_CLEARED = "not_cleared"  # a stalled job progressed, for less than clear_after_s so far

    def __str__(self) -> str:
        return self.value


RUNNING, SUSPECT, STALLED, WAITING = JobState.RUNNING, JobState.SUSPECT, JobState.STALLED, JobState.WAITING
JOB_STATES = tuple(JobState)

# (state, event) → next state. Why each row holds is in docs/detector-states.md.
TRANSITIONS: dict[tuple[JobState, Event], JobState] = {
    (RUNNING, Event.PROGRESS): RUNNING,
    (RUNNING, Event.PARTIAL): WAITING,
    (RUNNING, Event.QUIET): RUNNING,
    (RUNNING, Event.QUIET_LONG): SUSPECT,
    (RUNNING, Event.PROVEN): STALLED,
    (RUNNING, Event.TIMED_OUT): STALLED,
    (SUSPECT, Event.PROGRESS): RUNNING,
    (SUSPECT, Event.PARTIAL): WAITING,
    (SUSPECT, Event.QUIET): RUNNING,  # the streak's onset moved on: it starts again
    (SUSPECT, Event.QUIET_LONG): SUSPECT,
    (SUSPECT, Event.PROVEN): STALLED,
    (SUSPECT, Event.TIMED_OUT): STALLED,
    (WAITING, Event.PROGRESS): RUNNING,
    (WAITING, Event.PARTIAL): WAITING,
    (WAITING, Event.QUIET): WAITING,
    (WAITING, Event.QUIET_LONG): SUSPECT,
    (WAITING, Event.PROVEN): STALLED,
    (WAITING, Event.HELD_QUIET): WAITING,
    (WAITING, Event.TIMED_OUT): STALLED,
    (RUNNING, Event.HELD_QUIET): WAITING,  # a held stall waits whatever came between (never seen: total anyway)
    (SUSPECT, Event.HELD_QUIET): WAITING,
    (STALLED, Event.QUIET): STALLED,  # a confirmed stall stays confirmed while nothing moves, however long
    (STALLED, Event.NOT_CLEARED): STALLED,  # cleared only after clear_after_s of progress
    (STALLED, Event.PROGRESS): RUNNING,
    (STALLED, Event.PARTIAL): WAITING,
    (STALLED, Event.HELD_QUIET): WAITING,
    (STALLED, Event.TIMED_OUT): STALLED,
}


class IllegalTransition(RuntimeError):
    """The detector produced an event its job's state has no move for: a bug, never a job's fault."""


def transition(state: JobState | str, event: Event) -> JobState:
    try:
        return TRANSITIONS[(JobState(state), event)]
    except KeyError:
        raise IllegalTransition(f"no move from {state} on {event}") from None


__all__ = ["JOB_STATES", "RUNNING", "STALLED", "SUSPECT", "TRANSITIONS", "WAITING", "Event", "IllegalTransition",
           "transition"]
