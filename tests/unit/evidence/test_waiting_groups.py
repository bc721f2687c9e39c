"""The group each waiting rank waits in (evidence.waiting_groups, evidence.stacks.frame_groups), from real py-spy
``--locals`` dumps and client reports of one run (tests/data/frame_groups) and real Flight Recorder dumps of the 2x2
TP x DP gloo job (tests/data/fr)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_watchdog.evidence.flight_recorder.analysis import analyze_traces, rank_trace
from gpu_watchdog.evidence.flight_recorder.dumps import load_dump
from gpu_watchdog.evidence.report import render_report
from gpu_watchdog.evidence.stacks.classify import classify_threads
from gpu_watchdog.evidence.stacks.diagnosis import diagnose
from gpu_watchdog.evidence.stacks.frame_groups import FrameGroup, group_in_frames
from gpu_watchdog.evidence.waiting_groups import (
    FLIGHT_RECORDER,
    WaitingGroup,
    describe,
    desyncs,
    from_flight_recorder,
    from_frames,
)
from gpu_watchdog.model import RankStack

DATA = Path(__file__).resolve().parents[2] / "data"
FRAMES = DATA / "frame_groups"


def _thread(name: str) -> dict[str, Any]:
    (thread,) = json.loads((FRAMES / f"{name}.json").read_text())
    return thread


def _stack(name: str, rank: int) -> RankStack:
    th = _thread(name)
    rs = classify_threads([th], rank, th["pid"])
    assert rs is not None
    return rs


def _frames(case: str, ranks: range) -> dict[int, FrameGroup]:
    return {r: group_in_frames(_thread(f"{case}-rank{r}"), r, _stack(f"{case}-rank{r}", r).op) for r in ranks}


def _mesh_clients() -> dict[int, list[dict[str, Any]]]:
    return {r: json.loads((FRAMES / f"mesh-groups-{r}.json").read_text())["groups"] for r in range(4)}


def test_a_desync_inside_one_tp_group_of_a_2d_mesh_names_each_ranks_group() -> None:
    """Rank 0 in a TP all_gather its TP peer skips; rank 1 in the TP all_reduce; ranks 2 and 3 in their DP
    all_reduce: each rank's group is named by its frame's group address and its client's report."""
    stacks = [_stack(f"mesh-rank{r}", r) for r in range(4)]
    groups = from_frames(_frames("mesh", range(4)), _mesh_clients())
    got = {w.waiting: (w.collective, w.desc, w.ranks, w.waits_on) for w in groups}
    assert got == {(0,): ("all_gather_single", "mesh_tp", (0, 1), (1,)),
                   (1,): ("all_reduce", "mesh_tp", (0, 1), (0,)),
                   (2,): ("all_reduce", "mesh_dp", (0, 2), (0,)),
                   (3,): ("all_reduce", "mesh_dp", (1, 3), (1,))}
    text = describe(groups)
    assert "rank 2 waits in all_reduce of group 1 mesh_dp (ranks 0,2) for rank 0" in text, text
    assert "desync inside group 3 mesh_tp (ranks 0,1): rank 0 in all_gather_single, rank 1 in all_reduce" in text
    assert diagnose(stacks).culprit_ranks == (0,)  # the verdict is the stacks' own: the groups name nobody


def test_ranks_in_the_same_collective_of_one_group_are_one_entry_and_no_desync() -> None:
    """The healthy counterpart: both TP ranks in the TP all_reduce (each rank's own group address) wait together,
    on nobody outside it."""
    clients = _mesh_clients()
    tp = {r: next(g["address"] for g in clients[r] if g["desc"] == "mesh_tp") for r in (0, 1)}
    frames = {r: FrameGroup(r, "all_reduce", address=tp[r]) for r in (0, 1)}
    (w,) = from_frames(frames, clients)
    assert (w.waiting, w.ranks, w.waits_on, w.name, w.desc) == ((0, 1), (0, 1), (), "3", "mesh_tp")
    assert desyncs([w]) == [] and "desync" not in describe([w])


def test_a_member_seen_nowhere_is_never_said_to_be_waited_for() -> None:
    """Rank 2 waits in DP group {0,2}: rank 0 is named as waited for only where it is known to be elsewhere (its
    frames show another call, or its stack no communication) — another node's rank may be waiting too."""
    frames = {2: _frames("mesh", range(4))[2]}
    (alone,) = from_frames(frames, _mesh_clients())
    (known,) = from_frames(frames, _mesh_clients(), elsewhere={0})
    assert (alone.waiting, alone.waits_on) == ((2,), ()) and known.waits_on == (0,)


def test_without_the_clients_report_a_group_address_names_nothing() -> None:
    assert from_frames(_frames("mesh", range(4)), {}) == []
    assert describe([]) == ""


def test_a_send_names_its_partner_from_its_frame() -> None:
    frames = _frames("p2p", range(2))
    assert frames[0].peer == 1 and frames[1].peer is None
    (w,) = from_frames(frames, {})  # rank 1's default-group all_reduce: only an address without the client
    assert (w.waiting, w.collective, w.waits_on) == ((0,), "send", (1,))
    assert w.line() == "rank 0 waits in send for rank 1"


def test_a_pipeline_stage_waits_on_the_partner_its_schedule_holds_the_work_under() -> None:
    """GPipe, stage 1 hung: stage 2's forward receive is the Work its caller holds under rank 1; stage 0 waits on
    its forward sends in bulk, whose partner its frames do not hold (never guessed)."""
    frames = _frames("pipeline", range(3))
    assert frames[2].peer == 1 and frames[0].peer is None and not frames[0].known
    (w,) = from_frames({r: f for r, f in frames.items() if f.op}, {})
    assert (w.waiting, w.waits_on) == ((2,), (1,))


def test_the_flight_recorder_names_the_group_of_each_waiter_of_a_real_tp_mismatch() -> None:
    """tests/data/fr/mismatch: rank 1 runs all_gather where its TP peer runs all_reduce; the DP ranks wait."""
    traces = [rank_trace(load_dump(DATA / "fr" / "mismatch" / f"trace_{r}"), r) for r in range(4)]
    groups = from_flight_recorder(analyze_traces(traces, min_wait_s=0.0))
    got = {w.waiting: (w.name, w.desc, w.ranks, w.waits_on, w.source) for w in groups}
    assert got == {(0,): ("1", "tp", (0, 1), (1,), FLIGHT_RECORDER), (2,): ("3", "dp", (0, 2), (0,), FLIGHT_RECORDER),
                   (3,): ("4", "dp", (1, 3), (1,), FLIGHT_RECORDER)}


def test_the_flight_recorder_of_a_healthy_job_names_no_waiting_group() -> None:
    traces = [rank_trace(load_dump(DATA / "fr" / "healthy" / f"trace_{r}"), r) for r in range(4)]
    assert from_flight_recorder(analyze_traces(traces, min_wait_s=0.0)) == []


def test_the_report_shows_each_waiting_group_and_the_desync_inside_one() -> None:
    groups = from_frames(_frames("mesh", range(4)), _mesh_clients())
    summary = {"id": "x", "kind": "stall", "culprit_ranks": [0], "waiting_groups": [w.as_json() for w in groups]}
    text = render_report(summary, [])
    assert "process groups the ranks wait in (from the ranks' frames):" in text
    assert "  rank 3 waits in all_reduce of group 2 mesh_dp (ranks 1,3) for rank 1" in text
    assert "  desync inside group 3 mesh_tp (ranks 0,1)" in text
    assert [WaitingGroup.from_json(w.as_json()) for w in groups] == groups
