"""Who makes the others wait (pure): per-rank wait shares over a sliding window of stack samples.

Each sampling round classifies every rank's main thread (evidence.stacks.classify). A rank *waits* when it sits in a
collective or a device sync: on its peers (or, on a GPU, on work queued behind a collective). Its *own* time is
everything else it was seen doing — compute, input (a data loader, I/O), sleep. A straggler is the rank the others
keep waiting for: its peers' samples are largely waits while its own are not.

The verdict is deliberately slow and strict. The window is cut into ``slices`` equal parts and a rank is the
straggler only when it is one in **every** slice: its wait share at most ``max_share_ratio`` × the median of its
peers', with that median at least ``min_peer_wait_share`` (the job loses real time). A one-off slow phase — a save,
an eval, a first-step compile — can tip only the slices it overlaps, and one overlapping a slice only partly may tip
it; so a single pause no longer than ``window_s − 2 × window_s / slices`` (it cannot reach both the first and the
last slice) never makes a straggler, however long the others wait during it.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from gpu_watchdog.config.schema import MIN_SLICE_SAMPLES

WAITING_STATES = frozenset({"collective", "device_sync"})
# In a collective while its cgroup throttles it (as_sampled): gloo reduces and sends on the rank's own CPU, so a rank
# starved of CPU is slow *in* its collectives, and that time is its own.
COLLECTIVE_OWN_WORK = "collective_own_work"
INPUT_STATES = frozenset({"data_wait", "io"})
# Not counted at all: a stopped rank (the hang detector's), a thread no rule reads (neither wait nor work).
UNCOUNTED_STATES = frozenset({"stopped", "unknown"})


@dataclass(frozen=True)
class RankScore:
    """One rank over the whole window."""

    rank: int
    samples: int
    wait_share: float  # share of its samples spent waiting on its peers
    input_share: float  # share spent waiting for its input (data loader, I/O)
    score: float  # its peers' median wait share minus its own, ≥ 0: how much of their time it costs them

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "samples": self.samples, "wait_share": round(self.wait_share, 3),
                "input_share": round(self.input_share, 3), "score": round(self.score, 3)}


@dataclass(frozen=True)
class Verdict:
    """The window's scores, and the ranks that were the straggler in every slice (usually none, at most a few)."""

    scores: Mapping[int, RankScore]
    stragglers: tuple[int, ...] = ()
    since: float | None = None  # the window's start: how long it has been slow at least

    def peer_wait_share(self, rank: int) -> float:
        return _median([s.wait_share for r, s in self.scores.items() if r != rank])


@dataclass(frozen=True)
class Thresholds:
    window_s: float
    slices: int
    min_peer_wait_share: float
    max_share_ratio: float


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


# One rank in one round: the state its stack sample shows, or the shares of the interval it spent in each state
# (the cheap signals: evidence.straggler.signals), summing to at most 1.
Observed = str | Mapping[str, float]


class WaitWindow:
    """The rounds of one job's samples within ``window_s`` (newest last)."""

    def __init__(self) -> None:
        self._rounds: deque[tuple[float, Mapping[int, Mapping[str, float]]]] = deque()
        self.started: float | None = None  # the first round kept since the last reset

    def add(self, t: float, states: Mapping[int, Observed], window_s: float) -> None:
        """One round: rank → its main thread's state at ``t`` (or its shares of states since the last round)."""
        if self.started is None:
            self.started = t
        self._rounds.append((t, {r: {s: 1.0} if isinstance(s, str) else dict(s) for r, s in states.items()}))
        while self._rounds and self._rounds[0][0] < t - window_s:
            self._rounds.popleft()

    def reset(self) -> None:
        self._rounds.clear()
        self.started = None

    def __len__(self) -> int:
        return len(self._rounds)

    def verdict(self, now: float, th: Thresholds) -> Verdict:
        """Scores over the window ending at ``now``; stragglers only once a whole window was watched."""
        start = now - th.window_s
        width = th.window_s / th.slices
        parts: list[dict[int, list[float]]] = [{} for _ in range(th.slices)]
        for t, states in self._rounds:  # one pass: each round into its slice (the window's end in the last)
            if t >= start:
                _count(parts[min(th.slices - 1, int((t - start) / width))], states)
        whole: dict[int, list[float]] = {}
        for part in parts:  # the window's counts are its slices' summed
            for rank, c in part.items():
                w = whole.setdefault(rank, [0, 0.0, 0.0, 0.0])
                for i in range(4):
                    w[i] += c[i]
        scores = _scores(whole)
        if self.started is None or self.started > start or len(scores) < 2:
            return Verdict(scores)
        flagged: set[int] | None = None
        for part in parts:
            slow = _slow_in(_scores(part), th)
            flagged = slow if flagged is None else flagged & slow
            if not flagged:
                return Verdict(scores)
        return Verdict(scores, tuple(sorted(flagged or ())), start)


def _count(counts: dict[int, list[float]], states: Mapping[int, Mapping[str, float]]) -> None:
    """Add one round to ``counts``: rank → [rounds, counted weight, waiting, input] (the score's sums). A rank whose
    round holds no counted state adds nothing. Plain loops: this runs for every rank of every round of the window,
    each time it is judged."""
    for rank, weights in states.items():
        total = wait = inp = 0.0
        for state, w in weights.items():
            if w <= 0 or state in UNCOUNTED_STATES:
                continue
            total += w
            if state in WAITING_STATES:
                wait += w
            elif state in INPUT_STATES:
                inp += w
        if total <= 0:
            continue
        c = counts.setdefault(rank, [0, 0.0, 0.0, 0.0])
        c[0] += 1
        c[1] += total
        c[2] += wait
        c[3] += inp


def _scores(counts: Mapping[int, list[float]]) -> dict[int, RankScore]:
    shares = {r: (int(n), w / m, i / m) for r, (n, m, w, i) in counts.items() if m > 0}
    out = {}
    for r, (n, wait, inp) in shares.items():
        peers = _median([s[1] for q, s in shares.items() if q != r])
        out[r] = RankScore(r, n, wait, inp, max(0.0, peers - wait) if len(shares) > 1 else 0.0)
    return out


def _slow_in(part: Mapping[int, RankScore], th: Thresholds) -> set[int]:
    """The ranks that were the straggler in one slice."""
    sure = {r: s for r, s in part.items() if s.samples >= MIN_SLICE_SAMPLES}
    if len(sure) < 2:
        return set()
    out = set()
    for r, s in sure.items():
        peers = _median([p.wait_share for q, p in sure.items() if q != r])
        if peers >= th.min_peer_wait_share and s.wait_share <= th.max_share_ratio * peers:
            out.add(r)
    return out



def as_sampled(state: str, throttled_since_last_s: float, on_gpu: bool) -> str:
    """The state a sample counts: a CPU (gloo) rank in a collective while its cgroup throttled it since the last
    round is starved, doing its collective's work on its own throttled threads — own time, not a wait on its peers.
    (Any runnable thread was tried first: under a loaded host rank 0's store thread made it a false straggler.) On a
    GPU the collective's work is the GPU's, so the main thread's state stands."""
    if state == "collective" and not on_gpu and throttled_since_last_s > 0:
        return COLLECTIVE_OWN_WORK
    return state
