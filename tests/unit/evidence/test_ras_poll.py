"""The two-poll rule and the agent's RAS poller, against the stand-in RAS server.

Counts that differ between ranks but move between two polls are a job caught mid-step (not hung); counts that
differ and stay unchanged are a hung communicator; equal unchanged counts are an idle, healthy job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ras_standin
from gpu_watchdog.config.schema import RasConfig
from gpu_watchdog.evidence.nccl_ras.client import DEFAULT_ADDR, parse_report
from gpu_watchdog.evidence.nccl_ras.poll import RasPoller, compare_polls, hung_communicators, poll_once, ras_target
from ras_standin import Comm, Missing, Rank, RasStandIn, free_port, report_json
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
def rank_procs(tmp_path: Path) -> Iterator[Callable[..., int]]:
    """Start stand-in rank processes: ``serve=True`` serves RAS at its NCCL_RAS_ADDR as an NCCL process does;
    ``serve=False`` is a plain process with the same environment (a gloo rank)."""
    children: list[subprocess.Popen[str]] = []

    def start(addr: str, report: str = "", serve: bool = True) -> int:
        env = dict(os.environ, NCCL_RAS_ADDR=addr)
        if serve:
            (tmp_path / "report.json").write_text(report)
            argv = [sys.executable, str(Path(ras_standin.__file__)), str(tmp_path / "report.json")]
        else:
            argv = [sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(120)"]
        child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        return child.pid

    yield start
    for child in children:
        child.kill()
        child.wait()


def test_auto_asks_only_jobs_whose_ranks_serve_ras(rank_procs: Callable[..., int]) -> None:
    addr = f"127.0.0.1:{free_port()}"
    nccl_rank = rank_procs(addr, job([4, 4, 3, 4]))
    auto = RasPoller(lambda: RasConfig(enabled="auto", timeout_s=2.0, confirm_gap_s=0.05))
    assert auto.address("nccl", {0: nccl_rank}) == addr
    assert auto.incident_evidence("nccl", {0: nccl_rank}, 4).culprit_ranks == [2]
    gloo_rank = rank_procs(f"127.0.0.1:{free_port()}", serve=False)
    assert auto.address("gloo", {0: gloo_rank}) is None


def test_which_jobs_are_asked_and_where(rank_procs: Callable[..., int]) -> None:
    addr = f"127.0.0.1:{free_port()}"
    serving = rank_procs(addr, job([1, 1, 1, 1]))
    quiet = rank_procs(addr, serve=False)
    assert ras_target(RasConfig(enabled="off"), [serving]) is None
    assert ras_target(RasConfig(enabled="auto"), [quiet]) is None
    assert ras_target(RasConfig(enabled="auto"), [quiet, serving]) == addr  # any rank of the node serving it
    assert ras_target(RasConfig(enabled="on"), [quiet]) == addr
    assert ras_target(RasConfig(enabled="on", addr="10.1.1.1:1"), [quiet]) == "10.1.1.1:1"
    assert ras_target(RasConfig(enabled="on"), [os.getpid()]) == os.environ.get("NCCL_RAS_ADDR", DEFAULT_ADDR)


def test_a_job_not_asked_gets_no_connection(rank_procs: Callable[..., int]) -> None:
    with RasStandIn([job([1, 1, 1, 1])]) as s:
        gloo_rank = rank_procs(s.addr, serve=False)  # its NCCL_RAS_ADDR points at a RAS server it does not run
        p = RasPoller(lambda: RasConfig(enabled="auto", poll_interval_s=0.05))
        p.poll_due("j", {0: gloo_rank})
        time.sleep(0.3)
        p.poll_due("j", {0: gloo_rank})
        time.sleep(0.3)
        assert p.address("j", {0: gloo_rank}) is None and p.evidence("j") is None and s.connections == 0


# -- NCCL's counts as the detector's observation (comm_progress) ------------------------------------------------
def _progress(before: str, after: str) -> tuple[str, tuple[int, ...]] | None:
    from gpu_watchdog.evidence.nccl_ras.poll import comm_progress

    p = comm_progress("j", parse_report(before), parse_report(after), 1.0, source="RAS")
    return None if p is None else (p.state, p.behind)


@pytest.mark.parametrize(("before", "after", "expected"), [
    (job([5, 5, 5, 5]), job([6, 6, 5, 6]), ("moving", ())),  # rank 2 is a launch behind, but counts rose
    (job([6, 6, 5, 6]), job([6, 6, 5, 6]), ("frozen_unequal", (2,))),  # the hang: rank 2 never launched it
    (job([9, 9, 9, 9]), job([9, 9, 9, 9]), ("frozen_equal", ())),  # between collectives, or all inside one
    (job([6, 6, 6, 6], missing=(3,)), job([6, 6, 6, 6], missing=(3,)), ("frozen_unequal", (3,))),  # rank 3 gone
])
def test_two_reports_become_one_observation(before: str, after: str, expected: tuple[str, tuple[int, ...]]) -> None:
    assert _progress(before, after) == expected


def test_a_new_communicator_is_progress() -> None:
    ranks = [Rank(r, pid=100 + r, counts={"AllReduce": 4}) for r in range(4)]
    two = report_json([Comm(0xA, 4, ranks), Comm(0xB, 4, ranks)])
    assert _progress(report_json([Comm(0xA, 4, ranks)]), two) == ("moving", ())


def test_a_text_report_carries_no_counts() -> None:
    from gpu_watchdog.evidence.nccl_ras.client import parse_text_report
    from gpu_watchdog.evidence.nccl_ras.poll import comm_progress

    text = parse_text_report(ras_standin.OLD_TEXT_REPORT)
    assert comm_progress("j", text, parse_report(job([1, 1, 1, 1])), 1.0) is None


def test_a_job_whose_reports_cost_more_is_watched_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Watching stays under WATCH_CPU_SHARE of a core: a job whose last query cost 10 ms is next asked after
    10 ms / share, not at the watch interval (a suspect job is still asked at poll_interval_s)."""
    from gpu_watchdog.evidence.nccl_ras import poll as ras_poll

    with RasStandIn([job([1, 1, 1, 1])]) as s:
        p = RasPoller(lambda: RasConfig(enabled="on", addr=s.addr, timeout_s=2.0, poll_interval_s=0.1))
        p.poll_due("j", {0: os.getpid()}, watch_s=0.1)
        wait_for(lambda: s.connections == 1 and "j" not in p._inflight, 10, "the first query")
        monkeypatch.setattr(ras_poll, "WATCH_CPU_SHARE", 0.01)
        p._jobs["j"].cost_s = 0.01  # 1 s at a 1 % share
        time.sleep(0.3)
        p.poll_due("j", {0: os.getpid()}, watch_s=0.1)
        time.sleep(0.3)
        assert s.connections == 1
        p.poll_due("j", {0: os.getpid()})  # suspect: poll_interval_s
        wait_for(lambda: s.connections == 2, 10, "the suspect job's query")


def test_a_watched_job_without_a_ras_socket_is_looked_up_ever_less_often_a_suspect_one_at_once() -> None:
    """A gloo job (no RAS socket) under watching: each lookup reads the kernel's socket tables, so they back off
    (0.05 s, 0.1 s, 0.2 s, ...); once the job is suspect it is looked at again after poll_interval_s."""
    from gpu_watchdog.evidence.nccl_ras.poll import port_listening

    lookups: list[float] = []

    def target(cfg: RasConfig, pids: list[int]) -> str | None:
        lookups.append(time.monotonic())
        return None

    p = RasPoller(lambda: RasConfig(enabled="auto", poll_interval_s=0.05), target=target)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        p.poll_due("j", {0: os.getpid()}, watch_s=0.01)
        time.sleep(0.005)
    gaps = [b - a for a, b in zip(lookups, lookups[1:], strict=False)]
    assert 3 <= len(lookups) <= 6 and all(b > 1.5 * a for a, b in zip(gaps, gaps[1:], strict=False)), gaps
    n = len(lookups)
    time.sleep(0.06)
    p.poll_due("j", {0: os.getpid()})  # suspect now
    wait_for(lambda: len(lookups) == n + 1, 5, "the suspect job's lookup")
    assert port_listening(free_port()) is False


def test_port_listening_reads_the_kernels_tables(tmp_path: Path) -> None:
    import socket

    from gpu_watchdog.evidence.nccl_ras.poll import port_listening

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert port_listening(s.getsockname()[1]) is True
    assert port_listening(28028, (str(tmp_path / "missing"),)) is None
    table = tmp_path / "tcp"
    table.write_text("  sl  local_address rem_address   st\n   0: 0100007F:1F90 00000000:0000 0A 0\n")
    assert port_listening(8080, (str(table),)) is True and port_listening(28028, (str(table),)) is False


def _typed(counts: list[dict[str, int]]) -> str:
    return report_json([Comm(0xA, len(counts), [Rank(r, pid=100 + r, cuda_dev=r, counts=c)
                                                  for r, c in enumerate(counts)])])


def test_a_desync_names_the_odd_rank_not_everyone() -> None:
    """Rank 1 launched an all_gather where ranks 0 and 2 launched a broadcast (helper-measured on the NCCL-like
    stand-in job): each side is behind on one type. Only rank 1 is named, and the verdict says desync."""
    from gpu_watchdog.evidence.nccl_ras.client import analyze_report, format_analysis
    from gpu_watchdog.evidence.nccl_ras.poll import comm_progress

    counts = [{"Broadcast": 2, "AllGather": 0, "AllReduce": 19}, {"Broadcast": 1, "AllGather": 1, "AllReduce": 19},
              {"Broadcast": 2, "AllGather": 0, "AllReduce": 19}]
    a = analyze_report(parse_report(_typed(counts)))
    assert a.culprit_ranks == [1] and a.desync and not a.healthy
    assert "desync" in format_analysis(a, "x")
    p = comm_progress("j", parse_report(_typed(counts)), parse_report(_typed(counts)), 1.0)
    assert p is not None and (p.state, p.behind, p.desync) == ("frozen_unequal", (1,), True)
    ev = compare_polls("x", (poll_of(_typed(counts)), poll_of(_typed(counts))))
    assert ev.desync and ev.culprit_ranks == [1] and "desync" in ev.summary


def test_ranks_merely_behind_are_no_desync_and_a_tied_desync_names_nobody() -> None:
    from gpu_watchdog.evidence.nccl_ras.client import analyze_report
    from gpu_watchdog.evidence.nccl_ras.poll import comm_progress

    behind = [{"AllReduce": 5, "Broadcast": 2}, {"AllReduce": 4, "Broadcast": 1}]
    a = analyze_report(parse_report(_typed(behind)))
    assert a.culprit_ranks == [1] and not a.desync
    tied = [{"Broadcast": 1, "AllGather": 0}, {"Broadcast": 0, "AllGather": 1}]
    a = analyze_report(parse_report(_typed(tied)))
    assert a.culprit_ranks == [] and a.desync and not a.healthy
    p = comm_progress("j", parse_report(_typed(tied)), parse_report(_typed(tied)), 1.0)
    assert p is not None and (p.state, p.behind, p.desync) == ("frozen_unequal", (), True)


def poll_of(report: str) -> Any:
    from gpu_watchdog.evidence.nccl_ras.client import RasReply
    from gpu_watchdog.evidence.nccl_ras.poll import RasPoll

    reply = RasReply("x", 2, "json", report, 0.01)
    return RasPoll(time.time(), time.monotonic(), reply, parse_report(report))


def test_equal_counts_that_do_not_move_say_every_rank_is_inside_a_collective() -> None:
    still = compare_polls("x", (poll_of(job([7, 7, 7, 7])), poll_of(job([7, 7, 7, 7]))))
    assert still.frozen_equal and not still.hung and "no count moved" in still.summary
    moved = compare_polls("x", (poll_of(job([7, 7, 7, 7])), poll_of(job([8, 8, 8, 8]))))
    assert not moved.frozen_equal and "no communicator hung" in moved.summary
    behind = compare_polls("x", (poll_of(job([8, 8, 7, 8])), poll_of(job([8, 8, 7, 8]))))
    assert not behind.frozen_equal and behind.hung
