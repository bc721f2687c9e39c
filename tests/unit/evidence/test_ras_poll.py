"""The two-poll rule and the agent's RAS poller, against the stand-in RAS server.

Counts that differ between ranks but move between two polls are a job caught mid-step (not hung); counts that
differ and stay unchanged are a hung communicator; equal unchanged counts are an idle, healthy job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from gpu_watchdog.config.schema import RasConfig
from gpu_watchdog.evidence.nccl_ras import DEFAULT_ADDR, parse_report
from gpu_watchdog.evidence.ras_poll import RasPoller, compare_polls, hung_communicators, poll_once, ras_target
from ras_standin import Comm, Missing, Rank, RasStandIn, report_json
from waiting import wait_for


def job(counts: list[int], missing: tuple[int, ...] = ()) -> str:
    """A 4-rank job's world communicator, rank r at AllReduce count counts[r] (r in ``missing``: absent)."""
    ranks = [Rank(r, pid=100 + r, cuda_dev=r, counts={"AllReduce": c}) for r, c in enumerate(counts)
             if r not in missing]
    gone = [Missing(r, host="10.0.0.1", pid=100 + r, dead=True) for r in missing]
    return report_json([Comm(0xA, 4, ranks, gone)])


def test_counts_moving_between_polls_are_not_a_hang() -> None:
    assert hung_communicators(parse_report(job([5, 5, 4, 5])), parse_report(job([6, 6, 6, 5]))) == []


def test_counts_differing_and_unchanged_are_a_hung_communicator() -> None:
    prev, cur = parse_report(job([7, 7, 6, 7])), parse_report(job([7, 7, 6, 7]))
    assert hung_communicators(prev, cur) == ["0xa/0xb:0x99"]


def test_equal_unchanged_counts_are_healthy() -> None:
    assert hung_communicators(parse_report(job([9, 9, 9, 9])), parse_report(job([9, 9, 9, 9]))) == []


def test_missing_ranks_count_only_when_missing_in_both_polls() -> None:
    assert hung_communicators(parse_report(job([3, 3, 3, 3])), parse_report(job([3, 3, 3, 3], (3,)))) == []
    assert hung_communicators(parse_report(job([3, 3, 3, 3], (3,))), parse_report(job([3, 3, 3, 3], (3,)))) != []


def poller(addr: str, **kw: float) -> RasPoller:
    cfg = RasConfig(enabled="on", addr=addr, timeout_s=2.0, poll_interval_s=kw.get("poll_interval_s", 0.05),
                    confirm_gap_s=kw.get("confirm_gap_s", 0.05))
    return RasPoller(lambda: cfg)


ME = {0: os.getpid()}


@pytest.mark.parametrize(("first", "second", "culprits", "hung"), [
    ([7, 7, 6, 7], [7, 7, 6, 7], [2], 1),  # stuck: rank 2 never launched its 7th AllReduce
    ([5, 5, 4, 5], [6, 6, 6, 5], [], 0),  # moving: not hung, even though rank 3 is behind in the second poll
    ([9, 9, 9, 9], [9, 9, 9, 9], [], 0),  # healthy and idle
])
def test_incident_evidence_compares_two_polls(first: list[int], second: list[int], culprits: list[int],
                                              hung: int) -> None:
    with RasStandIn([job(first), job(second)]) as s:
        ev = poller(s.addr).incident_evidence("j", ME, 4)
        assert s.connections == 2
    assert ev.culprit_ranks == culprits and len(ev.hung) == hung
    assert [p.reply.format for p in ev.polls if p.reply] == ["json", "json"]
    assert ev.to_json()["polls"][0]["raw"].startswith("{")


def test_incident_reuses_the_last_background_poll() -> None:
    with RasStandIn([job([7, 7, 6, 7])]) as s:
        p = poller(s.addr, poll_interval_s=30.0)
        p.poll_due("j", ME)
        wait_for(lambda: (ev := p.evidence("j")) is not None and len(ev.polls) == 1, 10, "the background poll")
        p.poll_due("j", ME)  # within poll_interval_s: no second query
        time.sleep(0.2)
        assert s.connections == 1
        ev = p.incident_evidence("j", ME, 4)
        assert s.connections == 2 and ev.culprit_ranks == [2]


def test_a_failing_socket_is_no_evidence() -> None:
    with RasStandIn() as s:
        addr = s.addr
    t0 = time.monotonic()
    ev = poller(addr).incident_evidence("j", ME)
    assert time.monotonic() - t0 < 3.0
    assert len(ev.polls) == 1 and ev.culprit_ranks == [] and ev.hung == ()
    assert ev.summary.startswith(f"no NCCL RAS evidence from {addr}")


def test_a_server_that_never_answers_costs_one_bounded_poll() -> None:
    with RasStandIn(hang=True) as s:
        t0 = time.monotonic()
        ev = RasPoller(lambda: RasConfig(enabled="on", addr=s.addr, timeout_s=0.5)).incident_evidence("j", ME)
        assert time.monotonic() - t0 < 2.5 and ev.polls[0].error and ev.culprit_ranks == []


def test_text_only_server_gives_no_culprits_and_one_poll() -> None:
    with RasStandIn(json=False) as s:
        ev = poller(s.addr).incident_evidence("j", ME)
    assert len(ev.polls) == 1 and "RAS text only" in ev.summary and ev.culprit_ranks == []


def test_compare_polls_needs_two_readable_reports() -> None:
    with RasStandIn([job([1, 1, 0, 1])]) as s:
        one = poll_once(s.addr, 2.0)
    assert compare_polls(s.addr, (one,)).hung == ()
    assert compare_polls(s.addr, (one, one)).culprit_ranks == [2]


@pytest.fixture()
def nccl_env_child() -> Iterator[int]:
    env = dict(os.environ, NCCL_RAS_ADDR="127.0.0.1:28999")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


def test_which_jobs_are_asked_and_where(nccl_env_child: int) -> None:
    me = [os.getpid()]  # this test process: no libnccl loaded, no NCCL_RAS_ADDR (a gloo job's view)
    assert ras_target(RasConfig(enabled="auto"), me) is None
    assert ras_target(RasConfig(enabled="off"), [nccl_env_child]) is None
    assert ras_target(RasConfig(enabled="on"), me) == os.environ.get("NCCL_RAS_ADDR", DEFAULT_ADDR)
    assert ras_target(RasConfig(enabled="auto"), [nccl_env_child]) == "127.0.0.1:28999"
    assert ras_target(RasConfig(enabled="auto", addr="10.1.1.1:1"), [nccl_env_child]) == "10.1.1.1:1"


def test_a_job_not_asked_gets_no_connection() -> None:
    with RasStandIn([job([1, 1, 1, 1])]) as s:
        p = RasPoller(lambda: RasConfig(enabled="auto", addr=s.addr))  # this process loads no libnccl
        p.poll_due("j", ME)
        time.sleep(0.3)
        assert p.address("j", ME) is None and p.evidence("j") is None and s.connections == 0
