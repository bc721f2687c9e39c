"""The detector's state table: every move, the moves it lacks, the strings the contract relies on, and the page
in docs/ that prints it."""

from __future__ import annotations

import json
import re

import pytest
from gpu_watchdog.detect.states import JOB_STATES, TRANSITIONS, Event, IllegalTransition, transition
from gpu_watchdog.model import JobState
from repo_paths import REPO


@pytest.mark.parametrize(("state", "event", "to"), [(s, e, t) for (s, e), t in TRANSITIONS.items()],
                         ids=lambda v: str(v))
def test_every_move_of_the_table(state: JobState, event: Event, to: JobState) -> None:
    assert transition(state, event) is to
    assert transition(state.value, event) is to  # a status read back from JSON moves the same way


def test_a_move_the_table_lacks_is_a_bug_not_a_default() -> None:
    missing = [(s, e) for s in JobState for e in Event if (s, e) not in TRANSITIONS]
    assert set(missing) == {(JobState.RUNNING, Event.NOT_CLEARED), (JobState.SUSPECT, Event.NOT_CLEARED),
                            (JobState.WAITING, Event.NOT_CLEARED), (JobState.STALLED, Event.QUIET_LONG),
                            (JobState.STALLED, Event.PROVEN)}
    for state, event in missing:
        with pytest.raises(IllegalTransition, match=f"no move from {state.value} on {event.value}"):
            transition(state, event)
    with pytest.raises(ValueError):
        transition("sleeping", Event.QUIET)


def test_every_state_is_reached_and_left() -> None:
    assert set(TRANSITIONS.values()) == set(JobState)
    assert {s for s, _ in TRANSITIONS} == set(JobState)


def test_the_states_are_the_contracts_strings() -> None:
    assert [str(s) for s in JOB_STATES] == ["running", "suspect", "stalled", "waiting"]
    assert f"{JobState.STALLED}" == "stalled" and JobState.STALLED == "stalled"
    assert json.dumps({"state": JobState.WAITING}) == '{"state": "waiting"}'


def test_the_docs_print_the_codes_table() -> None:
    text = (REPO / "docs" / "detector-states.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (\w+) \| (\w+) \|$", text.split("## Moves", 1)[1], re.M)
    doc = {(JobState(a), Event(b)): JobState(c) for a, b, c in rows if a != "from"}
    assert doc == TRANSITIONS
