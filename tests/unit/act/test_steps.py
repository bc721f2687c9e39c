"""The recovery's table of moves (act.steps): every path from the open incident to an outcome, and the safety rules
it keeps — nothing restarted, given up or stood down before the job is stopped; a held job is never interrupted."""

from __future__ import annotations

import pytest
from gpu_watchdog.act.steps import MOVES, OUTCOMES, IllegalMove, Phase, move

J, C, K, S = Phase.JUDGING, Phase.CLAIMED, Phase.CHECKPOINTED, Phase.STOPPED


def paths(start: Phase = Phase.JUDGING) -> list[tuple[Phase, ...]]:
    if start in OUTCOMES:
        return [(start,)]
    return [(start, *rest) for nxt in sorted(MOVES[start]) for rest in paths(nxt)]


def test_every_path_ends_in_an_outcome_and_every_outcome_is_reached() -> None:
    ends = {p[-1] for p in paths()}
    assert ends == set(OUTCOMES)
    assert all(p[0] == J for p in paths())


def test_only_a_held_job_is_left_running_and_held_comes_straight_from_the_judgement() -> None:
    for p in paths():
        if p[-1] == Phase.HELD:
            assert p[-2] == J and S not in p and K not in p, p
        else:
            assert p[-2] == S and p.index(K) < p.index(S), p  # checkpoint asked, then stopped, then the outcome


def test_the_paths_are_held_or_acted_on_claimed_job_wide_or_not() -> None:
    after_stop = sorted(OUTCOMES - {Phase.HELD})
    expected = {(J, Phase.HELD)} | {(J, C, K, S, out) for out in after_stop} | {(J, K, S, out) for out in after_stop}
    assert set(paths()) == expected and len(paths()) == len(expected) == 15


@pytest.mark.parametrize("frm,to", [(J, S), (J, Phase.RESTARTED), (K, Phase.GAVE_UP), (Phase.HELD, K),
                                    (Phase.RESTARTED, Phase.RESTARTED), (S, Phase.HELD)])
def test_a_move_outside_the_table_is_a_bug_not_a_default(frm: Phase, to: Phase) -> None:
    with pytest.raises(IllegalMove):
        move(frm, to)


def test_the_outcomes_read_as_the_strings_the_hosts_and_json_used() -> None:
    assert Phase.RESTARTED == "restarted" and str(Phase.GIVEN_UP_ELSEWHERE) == "given_up_elsewhere"
    assert {Phase.BY_ENGINE: "x"}["by_engine"] == "x"
