"""The straggler verdict (pure): a rank named only when its peers keep waiting for it in every slice of a whole
window; uniform jobs, one-off slow phases and thin evidence never name one."""

from __future__ import annotations

import random

import pytest
from gpu_watchdog.evidence.straggler.score import Thresholds, WaitWindow

TH = Thresholds(window_s=60.0, slices=6, min_peer_wait_share=0.2, max_share_ratio=0.5)


def _feed(window: WaitWindow, seconds: int, state_of, start: float = 0.0) -> float:
    """One round per second: ``state_of(t, rank)`` for ranks 0..3; returns the last round's time."""
    t = start
    for i in range(seconds):
        t = start + i
        window.add(t, {r: state_of(t, r) for r in range(4)}, TH.window_s)
    return t


def _slow_rank(slow: int, rng: random.Random):
    # The others wait in a collective 60 % of the time, the slow rank computes nearly always.
    def state(t: float, r: int) -> str:
        if r == slow:
            return "collective" if rng.random() < 0.05 else "compute"
        return "collective" if rng.random() < 0.6 else "compute"
    return state


@pytest.mark.parametrize("seed", range(5))
def test_a_rank_the_others_always_wait_for_is_named_once_a_whole_window_was_watched(seed: int) -> None:
    w, rng = WaitWindow(), random.Random(seed)
    t = _feed(w, 50, _slow_rank(2, rng))
    assert w.verdict(t, TH).stragglers == ()  # not a whole window yet
    t = _feed(w, 40, _slow_rank(2, rng), start=t + 1)
    v = w.verdict(t, TH)
    assert v.stragglers == (2,)
    assert v.since == t - TH.window_s
    s = v.scores[2]
    assert s.wait_share < 0.15 and 0.4 < v.peer_wait_share(2) < 0.8 and s.score == pytest.approx(
        v.peer_wait_share(2) - s.wait_share)
    assert all(v.scores[r].score < 0.2 for r in (0, 1, 3))


@pytest.mark.parametrize("seed", range(5))
def test_a_uniform_job_never_has_a_straggler_however_much_it_waits(seed: int) -> None:
    w, rng = WaitWindow(), random.Random(seed)

    def state(t: float, r: int) -> str:  # each step one random rank arrives last and the rest wait for it
        return "collective" if rng.random() < 0.7 else "compute"

    for end in range(60, 300, 7):
        _feed(w, 7, state, start=end - 7)
        assert w.verdict(end - 1, TH).stragglers == ()


def test_a_one_off_slow_phase_no_longer_than_the_window_less_two_slices_is_never_a_straggler() -> None:
    """Rank 0 evaluates for 40 s while the others wait in a barrier the whole time: it cannot reach both the first
    and the last of the window's 6 slices of 10 s."""
    w, rng = WaitWindow(), random.Random(1)

    def state(t: float, r: int) -> str:
        if 100 <= t < 140:
            return "compute" if r == 0 else "collective"
        return "collective" if rng.random() < 0.3 else "compute"

    for now in range(61, 260):
        w.add(float(now), {r: state(now, r) for r in range(4)}, TH.window_s)
        assert w.verdict(float(now), TH).stragglers == (), now


def test_ranks_that_barely_wait_or_have_too_few_samples_name_nobody() -> None:
    w = WaitWindow()
    # Peers wait 10 % of the time only: the job loses little; no straggler however idle-free rank 3 is.
    _feed(w, 70, lambda t, r: "compute" if r == 3 or int(t) % 10 else "collective")
    assert w.verdict(69, TH).stragglers == ()
    thin = WaitWindow()
    for t in range(0, 70, 5):  # a round every 5 s: 2 per 10 s slice, below the minimum
        thin.add(float(t), {0: "compute", 1: "collective", 2: "collective"}, TH.window_s)
    assert thin.verdict(65, TH).stragglers == ()
    assert thin.verdict(65, TH).scores[0].wait_share == 0.0  # scores are still given


def test_input_waits_are_the_ranks_own_time_and_unknown_states_are_not_counted() -> None:
    w = WaitWindow()

    def state(t: float, r: int) -> str:
        if r == 1:
            return "data_wait" if int(t) % 4 else "unknown"
        return "collective" if int(t) % 3 else "compute"

    t = _feed(w, 70, state)
    v = w.verdict(t, TH)
    assert v.stragglers == (1,)
    assert v.scores[1].input_share == 1.0 and v.scores[1].samples < v.scores[0].samples


def test_reset_starts_a_new_window() -> None:
    w, state = WaitWindow(), _slow_rank(1, random.Random(0))
    t = _feed(w, 70, state)
    while not w.verdict(t, TH).stragglers:  # 10 samples a slice: a noisy slice can put it off, never for long
        t += 1
        w.add(t, {r: state(t, r) for r in range(4)}, TH.window_s)
        assert t < 130
    assert w.verdict(t, TH).stragglers == (1,)
    w.reset()
    assert len(w) == 0 and w.verdict(t, TH).stragglers == ()
