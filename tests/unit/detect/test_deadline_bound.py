"""The job's own deadline in the detector: a wait in communication on a rank that progresses is given until the
deadline plus the margin (never less than waiting_timeout_s); a wait the deadline does not govern keeps
waiting_timeout_s. Pure: hand-built samples and stacks, the detector's ``deadlines`` input."""

from __future__ import annotations

import dataclasses

from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.deadline import deadline_applies, wait_limit_s
from gpu_watchdog.detect.detector import STALLED, WAITING, DetectorState, step
from gpu_watchdog.model import Deadline, NodeSample, RankStack, StackEvidence

from tests.unit.detect.test_detector import JOB, Node, _waiting

CFG = dataclasses.replace(DetectConfig(), waiting_timeout_s=60.0, deadline_margin_s=10.0)
CLIENT_300 = Deadline(300.0, "client", "every process group's timeout (5 min)")


def _dump(t: float, waiter_state: str = "collective") -> StackEvidence:
    """Rank 0 writes (io), ranks 1-3 in all_gather (or elsewhere: ``waiter_state``)."""
    return StackEvidence(JOB, t, (RankStack(0, 1000, "io", "save", True, where="write (save.py:3)"),
                                  *(RankStack(r, 1000 + r, waiter_state, "wait", False,
                                              op="all_gather" if waiter_state == "collective" else None)
                                    for r in (1, 2, 3))))


def _run(samples: list[NodeSample], deadline: Deadline | None, waiter_state: str = "collective",
         cfg: DetectConfig = CFG) -> tuple[list[DetectorState], list]:
    """Step through ``samples`` with a dump at every 15th one and ``deadline`` learnt from the 3rd on."""
    state, states, findings = DetectorState(), [], []
    for i, s in enumerate(samples):
        stacks = [_dump(s.t, waiter_state)] if i % 15 == 7 else []
        deadlines = {JOB: deadline} if deadline is not None and i >= 3 else {}
        state, new = step(state, s, cfg, stacks, (), deadlines)
        states.append(state)
        findings.extend(new)
    return states, findings


def test_a_wait_in_a_collective_on_a_writing_rank_is_given_its_deadline() -> None:
    node = Node()
    samples = node.healthy(5) + _waiting(node, 330)
    states, findings = _run(samples, CLIENT_300)
    since = samples[4].t
    (f,) = [f for f in findings if f.kind == "stall"]
    assert f.signature == "waiting_timeout" and f.confirmed_at == since + 300.0 + 10.0  # deadline + margin
    before = states[-30]  # 300 s into the wait: past waiting_timeout_s (60 s), before the deadline
    assert before.jobs[JOB].state == WAITING and before.jobs[JOB].deadline == CLIENT_300
    assert states[-1].jobs[JOB].state == STALLED


def test_without_a_deadline_the_same_wait_keeps_waiting_timeout() -> None:
    node = Node()
    samples = node.healthy(5) + _waiting(node, 90)
    _, findings = _run(samples, None)
    (f,) = findings
    assert f.confirmed_at == samples[4].t + 60.0


def test_waiters_outside_communication_are_not_given_the_deadline() -> None:
    """Ranks 1-3 blocked in their own code (Event.wait) while rank 0 writes: no collective timeout ends that wait,
    so the deadline does not govern it."""
    node = Node()
    samples = node.healthy(5) + _waiting(node, 90)
    states, findings = _run(samples, CLIENT_300, waiter_state="unknown")
    (f,) = findings
    assert f.confirmed_at == samples[4].t + 60.0
    assert all(s.jobs[JOB].deadline is None for s in states)


def test_a_deadline_shorter_than_waiting_timeout_never_shortens_it() -> None:
    node = Node()
    samples = node.healthy(5) + _waiting(node, 90)
    _, findings = _run(samples, Deadline(20.0, "flight_recorder", "timeout_ms 20000"))
    (f,) = findings
    assert f.confirmed_at == samples[4].t + 60.0


def test_the_flight_recorder_deadline_counts_from_the_collective_enqueue() -> None:
    d = Deadline(300.0, "flight_recorder", "x", started_at=1000.0)
    assert d.due_at(1050.0) == 1300.0
    assert wait_limit_s(1050.0, d, CFG) == 1300.0 + 10.0 - 1050.0
    assert wait_limit_s(1050.0, None, CFG) == 60.0
    assert wait_limit_s(1050.0, Deadline(None, "unknown", "unknown: x"), CFG) == 60.0


def test_deadline_applies_only_to_known_deadlines_of_a_wait_in_communication() -> None:
    ev = (_dump(1.0),)
    assert deadline_applies(CLIENT_300, (0,), ev, 1.0, CFG) == CLIENT_300
    assert deadline_applies(CLIENT_300, (0,), (), 1.0, CFG) is None  # no dump yet: nothing says the wait is in one
    assert deadline_applies(Deadline(None, "unknown", "unknown"), (0,), ev, 1.0, CFG) is None
    assert deadline_applies(CLIENT_300, (0,), (_dump(1.0, "sleep"),), 1.0, CFG) is None
    fr_deadline = Deadline(30.0, "flight_recorder", "x", started_at=0.0)
    assert deadline_applies(fr_deadline, (0,), (), 1.0, CFG) == fr_deadline  # FR's pending collective says so


def test_a_waited_on_rank_that_stopped_moving_is_not_given_the_deadline() -> None:
    """Its CPU, I/O and heartbeat still for longer than deadline_still_max_s (a read that never returns, D state on
    a dead mount): nothing visibly moves, so waiting_timeout_s stands; never seen moving at all, likewise."""
    ev = (_dump(1.0),)
    assert deadline_applies(CLIENT_300, (0,), ev, CFG.deadline_still_max_s, CFG) == CLIENT_300
    assert deadline_applies(CLIENT_300, (0,), ev, CFG.deadline_still_max_s + 0.5, CFG) is None
    assert deadline_applies(CLIENT_300, (0,), ev, None, CFG) is None


def test_a_rank_stuck_in_a_kernel_wait_gets_waiting_timeout_not_the_deadline() -> None:
    """Rank 0 writes for 10 s, then sits in uninterruptible sleep (no CPU, no bytes) while ranks 1-3 wait in
    all_gather: the wait is given the deadline while rank 0 moves, and waiting_timeout_s once it has been still
    for deadline_still_max_s."""
    node = Node()
    cfg = dataclasses.replace(CFG, deadline_still_max_s=20.0)
    healthy = node.healthy(5)
    writing = _waiting(node, 10)
    stuck = [dataclasses.replace(s, processes=tuple(
        dataclasses.replace(p, wchan="nfs_wait_bit_killable", status="disk-sleep") if p.job and p.job.rank == 0
        else p for p in s.processes)) for s in node.idle_held(120)]
    samples = healthy + writing + stuck
    states, findings = _run(samples, CLIENT_300, cfg=cfg)
    (f,) = [f for f in findings if f.kind == "stall"]
    assert f.signature == "waiting_timeout" and f.culprit_ranks == (0,)
    # 60 s after the wait began (waiting_timeout_s), not at the 300 s deadline: rank 0 had been still for 20 s
    assert f.confirmed_at - samples[4].t == 60.0
    assert states[10].jobs[JOB].deadline == CLIENT_300  # while it wrote, the deadline governed


def test_a_governed_wait_keeps_its_deadline_when_the_tick_sees_everyone_move() -> None:
    """As a save ends, every rank moves again at once: the tick's waiting ranks and its latest dump no longer show
    anyone in a collective. The wait the deadline governs keeps it (it never becomes a stall on that tick, past
    waiting_timeout_s); only a waited-on rank that went still loses it."""
    everyone = (0, 1, 2, 3)
    assert deadline_applies(None, everyone, (), 1.0, CFG) is None
    assert deadline_applies(None, everyone, (), 1.0, CFG, governed=CLIENT_300) == CLIENT_300
    newer = Deadline(900.0, "flight_recorder", "timeout_ms 900000", started_at=0.0)
    assert deadline_applies(newer, everyone, (), 1.0, CFG, governed=CLIENT_300) == newer
    assert deadline_applies(None, (0,), (), CFG.deadline_still_max_s + 1.0, CFG, governed=CLIENT_300) is None
