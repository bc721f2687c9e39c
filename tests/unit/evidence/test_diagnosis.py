"""gpu_watchdog.evidence.stacks.diagnosis: rules on RankStacks, then end to end on three real hung 4-rank gloo jobs
(hang, desync, queue) dumped with the real py-spy."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gloo_jobs import RunningJob, start_job
from gpu_watchdog.evidence.analyze import analyze_dirs, write_rank_stacks
from gpu_watchdog.evidence.stacks.classify import classify_threads
from gpu_watchdog.evidence.stacks.diagnosis import RankContext, diagnose, format_ranks, stacks_progressed
from gpu_watchdog.evidence.stacks.dump import DumpResult, dump_stacks
from gpu_watchdog.model import RankStack, StackEvidence, unknown_rank

AR = "all_reduce (torch/distributed/distributed_c10d.py:3252)"
BAR = "barrier (torch/distributed/distributed_c10d.py:5356)"


def coll(rank: int, op: str = "all_reduce", where: str = AR) -> RankStack:
    return RankStack(rank=rank, pid=1000 + rank, state="collective", signature=f"{where} <- main", active=False,
                     op=op, where=where)


def other(rank: int, state: str, where: str, active: bool = False) -> RankStack:
    return RankStack(rank=rank, pid=1000 + rank, state=state, signature=f"{where} <- main", active=active,
                     where=where)


# ---- rules -------------------------------------------------------------------------------------------

def test_format_ranks() -> None:
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([3, 1, 0]) == "ranks 0,1,3"
    assert format_ranks([0, 1, 2, 4, 6, 7, 8, 9]) == "ranks 0-2,4,6-9"
    assert format_ranks([unknown_rank(4321)]) == "rank unknown (pid 4321)"
    assert format_ranks([1, unknown_rank(9), 0, unknown_rank(4321)]) == \
        "ranks 0,1, rank unknown (pid 9), rank unknown (pid 4321)"


def test_straggler_not_in_collective() -> None:
    d = diagnose([coll(0), coll(1), coll(2), other(3, "data_wait", "Queue.get (queue.py:171)")], world_size=4)
    assert d.culprit_ranks == (3,) and d.collective == "all_reduce" and not d.desync
    assert d.reason == "rank 3 is stuck in data_wait at Queue.get (queue.py:171); ranks 0-2 wait in all_reduce"
    assert d.groups[0] == (f"collective:all_reduce@{AR}", (0, 1, 2))
    assert d.groups[1] == ("data_wait@Queue.get (queue.py:171)", (3,))


def test_a_rank_in_recv_is_a_transport_hang_not_a_desync() -> None:
    """A rank blocked in a point-to-point recv waits for its partner's bytes (a broken P2P path): culprit, no
    desync, so the NCCL fallback ladder still applies."""
    d = diagnose([coll(0), coll(1), coll(2, "recv", "recv (torch/distributed/distributed_c10d.py:2799)"), coll(3)])
    assert d.culprit_ranks == (2,) and not d.desync and d.collective == "all_reduce"
    assert d.reason == "rank 2 in recv while ranks 0,1,3 wait in all_reduce"


def test_the_same_collective_through_another_entry_point_is_not_a_desync() -> None:
    """FSDP's all_gather_single and a plain all_gather_into_tensor are one all_gather; a bare wait() takes no side."""
    d = diagnose([coll(0, "all_gather_single"), coll(1, "all_gather_into_tensor"), coll(2, "wait")])
    assert not d.desync and d.culprit_ranks == ()
    fsdp = diagnose([coll(0, "barrier", BAR), coll(1, "all_gather_single"), coll(2, "all_gather_single")])
    assert fsdp.desync and fsdp.culprit_ranks == (0,) and fsdp.collective == "all_gather_single"


def test_desync_names_both_ops() -> None:
    d = diagnose([coll(0), coll(1), coll(2, "barrier", BAR), coll(3)])
    assert d.culprit_ranks == (2,) and d.desync and d.collective == "all_reduce"
    assert d.reason == ("desync: rank 2 in barrier while ranks 0,1,3 wait in all_reduce "
                        "(rank 2 ran ahead or fell behind)")


def test_busy_rank_is_named_busy() -> None:
    d = diagnose([other(0, "io", "save_checkpoint (train.py:51)", active=True), coll(1, "barrier", BAR)])
    assert d.culprit_ranks == (0,) and d.collective == "barrier"
    assert d.reason.startswith("rank 0 is busy in io at save_checkpoint (train.py:51)")


def test_missing_ranks_from_world_size_and_from_failed_dumps() -> None:
    d = diagnose([coll(0), coll(1), coll(2)], world_size=5, missing_ranks=[2, 3])
    assert d.culprit_ranks == (3, 4)  # 2 has a stack after all: not missing
    assert "ranks 3,4 are missing" in d.reason and d.groups[-1] == ("missing", (3, 4))


def test_two_rank_tie_rank_outside_collective_is_culprit() -> None:
    d = diagnose([coll(0), other(1, "sleep", "main (train.py:129)")])
    assert d.culprit_ranks == (1,) and d.collective == "all_reduce"
    assert d.reason == "rank 1 is stuck in sleep at main (train.py:129); rank 0 waits in all_reduce"


def test_two_rank_tie_between_collectives_names_nobody() -> None:
    d = diagnose([coll(0), coll(1, "barrier", BAR)])
    assert d.culprit_ranks == () and d.desync and d.collective is None
    assert d.reason.startswith("desync: rank 0 in all_reduce, rank 1 in barrier")


def test_a_desync_whose_other_side_was_passed_names_the_rank_in_the_collective_nobody_else_reached() -> None:
    """The zoo's 3-rank desync with rank 1 the odd one (seen live: no culprit named before): rank 1 calls all_gather
    where 0 and 2 broadcast; gloo's broadcast root hands rank 2 its bytes, so rank 2 goes on into DDP's backward and
    only root 0 still sits in broadcast. Rank 2 cannot have passed an all_gather (it needs rank 0's part): it passed
    the broadcast, which makes broadcast the common path and rank 1 the rank in the collective the others never
    reach."""
    ddp = coll(2, "ddp_all_reduce", "DistributedDataParallel._engine_run_backward")
    d = diagnose([coll(0, "broadcast", "broadcast (c10d.py:1)"), coll(1, "all_gather", "all_gather (c10d.py:2)"), ddp])
    assert d.culprit_ranks == (1,) and d.desync and d.collective == "broadcast"
    assert "past the broadcast, which lets some members go before all arrive" in d.reason
    # Without a rank past the point, or with two sides that either could have been passed, nothing tells them
    # apart: no culprit, as before.
    d = diagnose([coll(0, "broadcast", "broadcast (c10d.py:1)"), coll(1, "all_gather", "all_gather (c10d.py:2)")])
    assert d.culprit_ranks == () and d.desync
    d = diagnose([coll(0, "broadcast", "broadcast (c10d.py:1)"), coll(1, "gather", "gather (c10d.py:2)"), ddp])
    assert d.culprit_ranks == () and d.desync
    # The healthy side of the rule: ranks past a barrier while one rank sits in a broadcast do not make the
    # broadcast anybody's common path — the ranks in DDP's backward are the majority and the odd rank is named.
    d = diagnose([coll(0, "ddp_all_reduce", "x"), ddp, coll(1, "broadcast", "broadcast (c10d.py:1)")])
    assert d.culprit_ranks == (1,) and d.collective == "ddp_all_reduce"


def test_a_rank_in_recv_beside_a_local_peer_in_a_collective_is_named_from_its_own_node() -> None:
    """A 4-rank job on two nodes whose other agent published nothing: this node sees rank 2 in recv, rank 3 in
    all_reduce. The collective is the common path, the rank in recv waits for its partner's bytes: rank 2 is named
    (was: an "equal groups" tie), and ranks 0 and 1 are said to be unseen, never culprits for it."""
    recv = coll(2, "recv", "recv (torch/distributed/distributed_c10d.py:2600)")
    d = diagnose([recv, coll(3)], unseen=[0, 1])
    assert d.culprit_ranks == (2,) and not d.desync and d.collective == "all_reduce"
    assert d.reason == ("rank 2 in recv while rank 3 waits in all_reduce; ranks 0,1 are not seen (on other nodes "
                        "whose stacks are not here)")
    # Every local rank in the collective: nobody named here, the unseen ranks said so.
    d = diagnose([coll(2), coll(3)], unseen=[0, 1])
    assert d.culprit_ranks == () and d.reason.endswith("ranks 0,1 are not seen (on other nodes whose stacks are "
                                                       "not here)")
    # Two collectives against each other stay a tie (a desync with nobody to break it); p2p on both sides too.
    assert diagnose([coll(2, "barrier", BAR), coll(3)], unseen=[0, 1]).culprit_ranks == ()
    assert diagnose([recv, coll(3, "send", "send (c10d.py:1)")]).culprit_ranks == ()


def test_everyone_waits_culprit_elsewhere() -> None:
    d = diagnose([coll(r) for r in range(4)], world_size=4)
    assert d.culprit_ranks == () and d.collective == "all_reduce" and not d.desync
    assert "all 4 ranks wait in all_reduce" in d.reason and "another node" in d.reason


def test_no_collective_at_all() -> None:
    d = diagnose([other(0, "compute", "f (a.py:1)", True), other(1, "compute", "f (a.py:1)", True)])
    assert d.culprit_ranks == () and d.collective is None
    assert d.reason == "no rank is in a collective (ranks 0,1 compute); culprit unknown"
    assert diagnose([]).reason.startswith("no rank is in a collective")


def test_device_sync_ranks_wait_like_nccl_peers() -> None:
    item = "main (train.py:80)"
    # NCCL: healthy ranks block in .item() behind the collective kernel, the culprit is elsewhere.
    d = diagnose([other(0, "device_sync", item), other(1, "device_sync", item),
                  other(2, "data_wait", "Queue.get (queue.py:171)"), other(3, "device_sync", item)])
    assert d.culprit_ranks == (2,) and d.collective is None
    assert d.reason == "rank 2 is stuck in data_wait at Queue.get (queue.py:171); ranks 0,1,3 wait in device_sync"
    d = diagnose([coll(0), other(1, "device_sync", item), other(2, "sleep", "m (a.py:1)")])
    assert d.culprit_ranks == (2,)
    assert d.reason == ("rank 2 is stuck in sleep at m (a.py:1); rank 0 waits in all_reduce; "
                        "rank 1 waits in device_sync")
    d = diagnose([coll(0), other(1, "device_sync", item)])
    assert d.culprit_ranks == () and "all 2 ranks wait in all_reduce or device_sync" in d.reason


def _ev(*ranks: RankStack) -> StackEvidence:
    return StackEvidence(job_id="j", t=0.0, ranks=ranks)


def test_stacks_progressed() -> None:
    a = _ev(coll(0), other(1, "compute", "f (a.py:1)", True), other(2, "io", "w (a.py:2)", False),
            other(3, "sleep", "m (a.py:3)"), coll(4))
    moved = RankStack(rank=3, pid=1003, state="sleep", signature="m (a.py:9) <- main", active=False, where="m")
    restarted = RankStack(rank=4, pid=77, state="collective", signature=coll(4).signature, active=False,
                          op="all_reduce", where=AR)
    b = _ev(coll(0), other(1, "compute", "f (a.py:1)", True), other(2, "io", "w (a.py:2)", False), moved,
            restarted, coll(5))
    # io counts as moving even when idle in both dumps: slow is not stuck (an NFS write can sit in one call)
    assert stacks_progressed(a, b) == {0: False, 1: True, 2: True, 3: True, 4: True}


def _woke(rs: RankStack, before: int, after: int) -> RankStack:
    return dataclasses.replace(rs, wakeups_before=before, wakeups_after=after)


def test_equal_stacks_are_not_proof_when_the_thread_keeps_waking() -> None:
    """A loop that sleeps at one line shows the same frame in every dump, but its main thread blocks and wakes
    between the dumps; a thread blocked for good only shows py-spy's own wakeups (inside each dump)."""
    sleeper = other(0, "sleep", "main (loop.py:9)")
    a, b = _ev(_woke(sleeper, 10, 12)), _ev(_woke(sleeper, 27, 29))
    assert stacks_progressed(a, b) == {0: True}
    blocked_a, blocked_b = _ev(_woke(sleeper, 10, 12)), _ev(_woke(sleeper, 12, 14))
    assert stacks_progressed(blocked_a, blocked_b) == {0: False}
    # A rank whose GPU spins waits on the device whatever its host does: no wakeup or CPU counts.
    busy = other(1, "compute", "step (train.py:55)", True)
    spin = {0: RankContext(device="spin"), 1: RankContext(device="spin")}
    assert stacks_progressed(_ev(_woke(sleeper, 10, 12), busy), _ev(_woke(sleeper, 27, 29), busy), spin) == \
        {0: False, 1: False}
    # ... unless its stack moves or its in-job client reports a step.
    assert stacks_progressed(_ev(busy), _ev(busy), {1: RankContext(device="spin", stepped=True)}) == {1: True}


def test_a_data_wait_moves_while_its_producer_works() -> None:
    waiting = other(0, "data_wait", "Queue.get (queue.py:171)")
    assert stacks_progressed(_ev(waiting), _ev(waiting)) == {0: False}
    assert stacks_progressed(_ev(waiting), _ev(waiting), {0: RankContext(host_busy=True)}) == {0: True}
    # host CPU of a sleeping or collective rank proves nothing (an NCCL host busy-waits), nor does it for a
    # rank whose GPU spins (NCCL's proxy thread polls while the collective waits on a peer)
    assert stacks_progressed(_ev(coll(0)), _ev(coll(0)), {0: RankContext(host_busy=True)}) == {0: False}
    assert stacks_progressed(_ev(waiting), _ev(waiting), {0: RankContext(device="spin", host_busy=True)}) == \
        {0: False}


# ---- real jobs ----------------------------------------------------------------------------------------

SCENARIOS = {"hang": 1, "desync": 2, "queue": 3}


@pytest.fixture(scope="module")
def hung_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[RunningJob, dict[int, int]]]]:
    """Three 4-rank jobs started together (they hang within seconds and then burn no CPU)."""
    base = tmp_path_factory.mktemp("jobs")
    jobs = {s: start_job(s, nproc=4, extra_args=("--rank-at", str(r)), tmp_path=base / s)
            for s, r in SCENARIOS.items()}
    try:
        ready = {}
        for s, job in jobs.items():
            job.wait_event("hang_onset", timeout=120)
            ready[s] = (job, job.wait_ranks(timeout=30))
        time.sleep(1.0)  # the peers reach their collective after the onset event
        yield ready
    finally:
        for job in jobs.values():
            job.stop()


def _dump(pids: dict[int, int]) -> tuple[list[RankStack], dict[int, DumpResult]]:
    ranks = sorted(pids)
    results = dict(zip(ranks, dump_stacks([pids[r] for r in ranks], timeout_s=10), strict=True))
    stacks = []
    for r, res in results.items():
        assert res.ok, res
        rs = classify_threads(res.threads, r, res.pid)
        assert rs is not None
        stacks.append(rs)
    return stacks, results


@pytest.mark.slow
def test_real_hang(hung_jobs: dict, tmp_path: Path) -> None:
    _job, pids = hung_jobs["hang"]
    stacks, results = _dump(pids)
    d = diagnose(stacks, world_size=4)
    assert d.culprit_ranks == (1,) and d.collective == "all_reduce" and not d.desync
    r1 = stacks[1]
    assert r1.state == "collective" and r1.op == "recv" and not r1.timed  # a receive that never completes
    assert d.reason == "rank 1 in recv while ranks 0,2,3 wait in all_reduce"

    # A second dump: nobody moved.
    again, _ = _dump(pids)
    assert stacks_progressed(_ev(*stacks), _ev(*again)) == {0: False, 1: False, 2: False, 3: False}

    # Two "nodes" holding ranks 0-1 and 2-3: analyze merges them to the same answer.
    for r, res in results.items():
        write_rank_stacks(tmp_path / ("node-a" if r < 2 else "node-b"), r, "a" if r < 2 else "b", res,
                          world_size=4)
    assert diagnose([s for s in stacks if s.rank >= 2]).culprit_ranks == ()  # node b alone: unknown
    merged = analyze_dirs([tmp_path / "node-a", tmp_path / "node-b"])
    assert merged.culprit_ranks == (1,) and merged.collective == "all_reduce"


@pytest.mark.slow
def test_real_desync(hung_jobs: dict) -> None:
    _job, pids = hung_jobs["desync"]
    stacks, _ = _dump(pids)
    d = diagnose(stacks, world_size=4)
    assert d.culprit_ranks == (2,) and d.desync and d.collective == "all_reduce"
    assert d.reason == ("desync: rank 2 in barrier while ranks 0,1,3 wait in all_reduce "
                        "(rank 2 ran ahead or fell behind)")


@pytest.mark.slow
def test_real_queue(hung_jobs: dict) -> None:
    _job, pids = hung_jobs["queue"]
    stacks, _ = _dump(pids)
    d = diagnose(stacks, world_size=4)
    assert d.culprit_ranks == (3,) and d.collective == "all_reduce"
    assert stacks[3].state == "data_wait" and stacks[3].where.startswith("Queue.get (queue.py:")
    assert d.reason.startswith("rank 3 is stuck in data_wait at Queue.get (queue.py:")


@pytest.mark.slow
def test_real_save_pause_progresses(tmp_path: Path) -> None:
    """A legit pause (rank 0 writing a checkpoint while rank 1 waits in barrier): the diagnosis names
    rank 0 as busy in io, and stacks_progressed tells it apart from a hang."""
    job = start_job("save", nproc=2, extra_args=("--pause-s", "30"), tmp_path=tmp_path)
    try:
        job.wait_event("hang_onset", timeout=90)
        pids = job.wait_ranks(timeout=30)
        time.sleep(0.5)
        first, _ = _dump(pids)
        time.sleep(0.5)
        second, _ = _dump(pids)
    finally:
        job.stop()
    assert first[0].state == "io" and first[0].where.startswith("save_checkpoint (train.py:")
    assert (first[1].state, first[1].op) == ("collective", "barrier")
    d = diagnose(second, world_size=2)
    assert d.culprit_ranks == (0,) and d.reason.startswith("rank 0 is busy in io at save_checkpoint")
    assert stacks_progressed(_ev(*first), _ev(*second)) == {0: True, 1: False}
