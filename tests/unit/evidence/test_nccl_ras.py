"""The NCCL RAS client against a stand-in that speaks NCCL's protocol, and the culprits of reports written to
NVIDIA's schema (tests/support/ras_standin.py: NCCL's own layout, the 2.28.9 defect, an old text-only server)."""

from __future__ import annotations

import json
import time

import pytest
from gpu_watchdog.errors import EXIT_UNAVAILABLE, UsageError
from gpu_watchdog.evidence.nccl_ras.client import (
    RasReply,
    RasReportError,
    RasUnavailable,
    analyze_report,
    parse_addr,
    parse_report,
    query,
    read_reply,
    server_timeout_s,
)
from ras_standin import Comm, Missing, Rank, RasStandIn, report_json


def world(n: int, counts: dict[int, dict[str, int]] | None = None, host: str = "10.0.0.1") -> list[Rank]:
    """A job-wide communicator's ranks: global rank r is pid 100+r, on GPU r % 4, all at the same counts
    unless ``counts`` says otherwise."""
    counts = counts or {}
    return [Rank(r, host=host, pid=100 + r, cuda_dev=r % 4, counts=counts.get(r, {"AllReduce": 20, "Broadcast": 1}))
            for r in range(n)]


def ask(report: str, as_json: bool = True) -> tuple[RasReply, list[str]]:
    with RasStandIn([report], json=as_json) as s:
        reply = query(s.addr, 5.0)
        return reply, s.commands


def test_protocol_exchange_is_ncclras_own() -> None:
    reply, commands = ask(report_json([Comm(0x1, 4, world(4))]))
    assert commands == ["CLIENT PROTOCOL 2", "TIMEOUT 2", "SET FORMAT json", "STATUS"]
    assert reply.format == "json" and reply.server_protocol == 2 and reply.note == ""


def test_healthy_job_has_nothing_wrong() -> None:
    reply, _ = ask(report_json([Comm(0x1, 4, world(4)), Comm(0x2, 2, world(2))]))
    a = analyze_report(read_reply(reply))
    assert a.healthy and a.culprit_ranks == [] and a.suspects == ()
    assert [c.size for c in a.report.communicators] == [4, 2]


def test_single_communicator_names_the_rank_behind() -> None:
    ranks = world(4, {2: {"AllReduce": 19, "Broadcast": 1}})
    a = analyze_report(parse_report(report_json([Comm(0x1, 4, ranks)])))
    assert a.culprit_ranks == [2]
    (s,) = a.suspects
    assert (s.rank, s.why, dict(s.behind), s.pid) == (2, "behind", {"AllReduce": 1}, 102)


def test_sub_communicator_ranks_map_to_global_ranks_through_host_and_pid() -> None:
    # 2x2 TP x DP: the world communicator is healthy; TP group {2,3} (comm ranks 0,1) hangs in an AllGather
    # where global rank 3 (comm rank 1) is behind.
    tp = [Rank(0, pid=102, cuda_dev=2, counts={"AllGather": 7}), Rank(1, pid=103, cuda_dev=3, counts={"AllGather": 6})]
    tp0 = [Rank(0, pid=100, counts={"AllGather": 7}), Rank(1, pid=101, cuda_dev=1, counts={"AllGather": 7})]
    a = analyze_report(parse_report(report_json([Comm(0x1, 4, world(4)), Comm(0x2, 2, tp0), Comm(0x3, 2, tp)])))
    assert a.culprit_ranks == [3]
    assert [(s.comm.split("/")[0], s.rank, s.global_rank) for s in a.suspects] == [("0x3", 1, 3)]


def test_explicit_rank_map_wins_and_unknown_processes_stay_unmapped() -> None:
    sub = [Rank(0, host="10.0.0.9", pid=555, counts={"AllReduce": 3}),
           Rank(1, host="10.0.0.9", pid=556, counts={"AllReduce": 2})]
    report = parse_report(report_json([Comm(0x7, 2, sub)]))
    # The only communicator spans "the job" (size 2): comm rank = global rank without a map.
    assert analyze_report(report).culprit_ranks == [1]
    assert analyze_report(report, {("10.0.0.9", 556): 13}).culprit_ranks == [13]
    # With the job's real size known, a 2-rank communicator is a sub-group: nothing maps its ranks.
    a = analyze_report(report, world_size=8)
    assert a.culprit_ranks == [] and [s.pid for s in a.suspects] == [556]
    assert a.to_json()["unmapped_suspects"][0]["global_rank"] is None


def test_missing_and_dead_ranks() -> None:
    ranks = world(4)[:2]
    missing = [Missing(2, host="10.0.0.1", pid=102, unresponsive=True),
               Missing(3, host="10.0.0.2", pid=103, unresponsive=True, dead=True)]
    a = analyze_report(parse_report(report_json([Comm(0x1, 4, ranks, missing)])))
    assert a.culprit_ranks == [2, 3]
    assert [(s.rank, s.why, s.unresponsive, s.considered_dead) for s in a.suspects] == [
        (2, "missing", True, False), (3, "missing", True, True)]


def test_missing_rank_whose_process_ras_cannot_name_maps_by_comm_rank_in_the_world_communicator() -> None:
    a = analyze_report(parse_report(report_json([Comm(0x1, 3, world(3)[:2], [Missing(2, host="unknown", pid=-1)])])))
    assert a.culprit_ranks == [2] and a.suspects[0].pid == -1


def test_nccl_2_28_9_missing_comma_is_repaired_and_nothing_else_is() -> None:
    text = report_json([Comm(0x1, 4, world(4)[:3], [Missing(3, host="10.0.0.1", pid=103, dead=True)])],
                       nccl_2289=True)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # the defect is real in the stand-in's output
    assert analyze_report(parse_report(text)).culprit_ranks == [3]
    broken = report_json([Comm(0x1, 4, world(4))]).replace('"size": 4,', '"size": 4')
    with pytest.raises(RasReportError, match="not valid JSON"):
        parse_report(broken)
    with pytest.raises(RasReportError, match="no communicators"):
        parse_report('{"nccl_version": "2.28.9"}')
    with pytest.raises(RasReportError, match=r"communicators\[0\].ranks\[0\] has no rank"):
        parse_report('{"communicators": [{"ranks": [{"host": "x"}]}]}')


def test_old_text_only_server_reports_what_it_can_and_never_crashes() -> None:
    reply, commands = ask("", as_json=False)
    assert commands[2] == "SET FORMAT json" and commands[-1] == "STATUS"
    assert reply.format == "text" and "RAS text only" in reply.note
    a = analyze_report(read_reply(reply))
    assert a.report.text_only and a.report.nccl_version == "2.26.2"
    assert not a.healthy and a.culprit_ranks == []
    assert any(f.startswith("DEAD: 1 job process") for f in a.report.text_findings)
    assert any("INCOMPLETE" in f and "Missing communicator data from 1 rank" in f for f in a.report.text_findings)


def test_server_that_never_answers_is_bounded_by_the_timeout() -> None:
    with RasStandIn(hang=True) as s:
        t0 = time.monotonic()
        with pytest.raises(RasUnavailable, match="did not answer in time|timed out"):
            query(s.addr, 0.5)
        assert time.monotonic() - t0 < 3.0


def test_nothing_listening_is_unavailable() -> None:
    with RasStandIn() as s:
        addr = s.addr
    with pytest.raises(RasUnavailable, match="no NCCL RAS socket answers") as e:
        query(addr, 2.0)
    assert e.value.exit_code == EXIT_UNAVAILABLE


def test_addresses_and_server_timeout() -> None:
    assert parse_addr("localhost:28028") == ("localhost", 28028)
    assert parse_addr("[::1]:28028") == ("::1", 28028)
    for bad in ("nope", "host:", ":28028", "host:0", "host:70000", "host:12x"):
        with pytest.raises(UsageError, match="bad RAS address"):
            parse_addr(bad)
    assert server_timeout_s(10.0) == 4 and server_timeout_s(0.5) == 1
