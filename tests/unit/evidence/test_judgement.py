"""The rules behind "act only on proof" (pure): timed waits from /proc syscall lines, DDP's backward as a
collective, slow ranks as alive, the fallback ladder only on communication evidence, the restart backoff, and
a held (waiting) job that becomes a stall only at the waiting timeout."""

from __future__ import annotations

import pytest
from gpu_watchdog.config.schema import DetectConfig, FallbackConfig, RecoveryConfig
from gpu_watchdog.detect.detector import STALLED, WAITING, DetectorState, hold_waiting, step
from gpu_watchdog.evidence.stacks.classify import DDP_OP, classify_threads
from gpu_watchdog.evidence.stacks.diagnosis import communication_evidence, diagnose, rank_moved
from gpu_watchdog.evidence.stacks.syscalls import timed_wait
from gpu_watchdog.model import JobIdentity, JobStatus, NodeSample, ProcessSample, RankStack
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.policy.ladder import decide

# Lines read from real Python processes on x86_64 (see evidence/stacks/syscalls.py).
SLEEP = "230 0x1 0x1 0x7fff36a602d0 0x0 0x0 0x0 0x7fff36a602b8 0x7fcda3aed503"
EVENT_WAIT_FOREVER = "202 0x55b3779b5cd0 0x189 0x0 0x0 0x0 0xffffffff 0x7fff9076ffa0 0x7f3247ca3e96"
EVENT_WAIT_30 = "202 0x55843493ecd0 0x89 0x0 0x7fff0ac429e0 0x0 0xffffffff 0x7fff0ac42930 0x7f59d9ea3e96"
SELECT_30 = "270 0x4 0x7ffefcca6400 0x0 0x0 0x7ffefcca6330 0x0 0x7ffefcca6320 0x7f78e811c954"
SELECT_FOREVER = "270 0x4 0x7fff5ff06b50 0x0 0x0 0x0 0x0 0x7fff5ff06a70 0x7f77b411c954"
RECVFROM = "45 0x3 0x7f9d65cb9b80 0xa 0x0 0x0 0x0 0x7fffd8e08038 0x7f9d65f28929"


@pytest.mark.parametrize(("line", "want"), [(SLEEP, True), (EVENT_WAIT_FOREVER, False), (EVENT_WAIT_30, True),
                                            (SELECT_30, True), (SELECT_FOREVER, False), (RECVFROM, None),
                                            ("running", None), ("", None), ("7 0x3 0x1 0xffffffff 0 0 0 0 0", False),
                                            ("7 0x3 0x1 0x7d0 0 0 0 0 0", True)])
def test_timed_wait_from_syscall_lines(line: str, want: bool | None) -> None:
    assert timed_wait(line, "x86_64") is want


def test_aarch64_numbers_and_unknown_machines() -> None:
    assert timed_wait("115 0x1 0x1 0xffff 0 0 0 0 0", "aarch64") is True  # clock_nanosleep
    assert timed_wait(SLEEP, "riscv64") is None


def _thread(frames: list[tuple[str, str]], *, active: bool = False, name: str = "MainThread", tid: int = 1,
            syscall: str = "") -> dict[str, object]:
    return {"thread_name": name, "os_thread_id": tid, "active": active, "syscall": syscall,
            "frames": [{"name": n, "filename": f, "short_filename": f.rsplit("/", 1)[-1], "line": 3}
                       for n, f in frames]}


BACKWARD = [("_engine_run_backward", "torch/autograd/graph.py"), ("backward", "torch/autograd/__init__.py"),
            ("Tensor.backward", "torch/_tensor.py"), ("main", "train.py")]


def test_ddp_backward_blocked_is_its_all_reduce_but_computing_backward_is_compute() -> None:
    idle = classify_threads([_thread(BACKWARD)], 0, 10)
    assert idle is not None and idle.state == "collective" and idle.op == DDP_OP
    busy = classify_threads([_thread(BACKWARD, active=True)], 0, 10)
    assert busy is not None and busy.state == "compute"
    native = [{"name": "c10d::Reducer::finalize_backward", "filename": "libtorch_cpu.so"}]
    th = _thread(BACKWARD)
    th["frames"] = native + th["frames"]  # type: ignore[operator]
    assert classify_threads([th], 0, 10).op == DDP_OP  # type: ignore[union-attr]


def test_a_user_hook_blocked_inside_backward_is_not_ddp() -> None:
    frames = [("wait", "threading.py"), ("my_hook", "train.py"), *BACKWARD]
    rs = classify_threads([_thread(frames)], 0, 10)
    assert rs is not None and rs.state == "unknown"


def test_a_main_thread_waiting_on_a_thread_in_a_collective_takes_that_threads_state() -> None:
    main = _thread([("join", "threading.py"), ("main", "train.py")])
    worker = _thread([("all_reduce", "torch/distributed/distributed_c10d.py"), ("loop", "train.py")],
                     name="trainer", tid=2)
    rs = classify_threads([main, worker], 0, 10)
    assert rs is not None and rs.state == "collective" and rs.op == "all_reduce" and "[thread trainer]" in rs.where


def test_timed_waits_are_alive_untimed_ones_are_not() -> None:
    poll = classify_threads([_thread([("main", "train.py")], syscall=EVENT_WAIT_30)], 0, 10)
    stuck = classify_threads([_thread([("main", "train.py")], syscall=EVENT_WAIT_FOREVER)], 0, 10)
    assert poll is not None and stuck is not None and poll.timed and not stuck.timed
    assert rank_moved(poll, poll) and not rank_moved(stuck, stuck)


@pytest.mark.parametrize(("left", "alive"), [(4.0, True), (60.0, True), (1799.0, False), (3599.0, False)])
def test_only_a_short_timeout_is_a_poll(left: float, alive: bool) -> None:
    """A poll every few seconds is alive; a sleep(3600) or a gloo/NCCL wait with its 30-minute timeout is a wait."""
    th = _thread([("main", "train.py")], syscall=EVENT_WAIT_30)
    th["wait_left_s"] = left
    rs = classify_threads([th], 0, 10)
    assert rs is not None and rs.timed is alive and rank_moved(rs, rs) is alive


def test_the_time_left_is_read_from_a_live_process() -> None:
    import os
    import subprocess
    import sys
    import time as _time

    from gpu_watchdog.evidence.stacks.syscalls import read_syscall, wait_left_s

    for code, low, high in (("import time; time.sleep(30)", 20.0, 30.0), ("import time; time.sleep(3600)", 3500, 3600),
                            ("import threading; threading.Event().wait(7)", 1.0, 7.0)):
        p = subprocess.Popen([sys.executable, "-c", code])
        try:
            deadline = _time.monotonic() + 10
            left = None
            while _time.monotonic() < deadline and left is None:
                _time.sleep(0.2)
                left = wait_left_s(p.pid, p.pid, read_syscall(p.pid, p.pid))
            assert left is not None and low <= left <= high, (code, left)
        finally:
            p.kill()
            p.wait()
    assert wait_left_s(os.getpid(), os.getpid(), "running") is None


def _rs(rank: int, state: str, op: str | None = None, *, before: int | None = None,
        after: int | None = None) -> RankStack:
    return RankStack(rank, 100 + rank, state, f"s{rank}", False, op, "x", before, after)


def test_one_wakeup_between_dumps_is_moving() -> None:
    a, b = _rs(0, "unknown", after=10), _rs(0, "unknown", before=11)
    assert rank_moved(a, b) and not rank_moved(a, _rs(0, "unknown", before=10))


def test_ddp_ranks_are_never_desync_culprits_unless_they_are_the_majority() -> None:
    d = diagnose([_rs(0, "collective", "broadcast"), _rs(1, "collective", DDP_OP), _rs(2, "collective", "all_gather")])
    assert d.desync and 1 not in d.culprit_ranks
    d = diagnose([_rs(0, "collective", DDP_OP), _rs(1, "collective", DDP_OP), _rs(2, "unknown")])
    assert d.culprit_ranks == (2,) and d.collective == DDP_OP
    assert communication_evidence(d, [_rs(0, "collective", DDP_OP), _rs(1, "collective", DDP_OP), _rs(2, "unknown")])
    lone = [_rs(0, "sleep"), _rs(1, "unknown")]
    assert communication_evidence(diagnose(lone), lone) == ""


def test_the_evidence_line_names_each_op_the_ranks_wait_in() -> None:
    """Half a job seen from one node: rank 2 in all_reduce, rank 3 in recv — rank 3 is named from this node's own
    evidence (issue 29; it was no culprit before), and the line says where each waits, not a device sync nobody
    is in."""
    half = [_rs(2, "collective", "all_reduce"), _rs(3, "collective", "recv")]
    d = diagnose(half)
    assert d.culprit_ranks == (3,)
    assert communication_evidence(d, half) == "stacks: rank 2 waits in all_reduce, rank 3 in recv"
    synced = [_rs(0, "device_sync"), _rs(1, "device_sync")]
    assert communication_evidence(diagnose(synced), synced) == "stacks: ranks 0,1 wait in device_sync"


def test_the_ladder_climbs_only_on_communication_evidence() -> None:
    cfg = FallbackConfig()
    comm = "stacks: ranks 0,2 wait in all_reduce"
    assert decide(cfg, 0, "stall", "collective", communication=comm).level == 1
    assert decide(cfg, 0, "stall", None, communication=comm).level == 1  # a transport hang
    for state in ("unknown", "sleep", "data_wait", "compute", "io", "stopped"):
        d = decide(cfg, 0, "stall", state, communication=comm)
        assert d.level == 0 and not d.changed and "own code" in d.reason
    assert decide(cfg, 0, "stall", None).level == 0  # "no culprit named" alone never climbs
    assert decide(cfg, 0, "stall", "collective", communication=comm, signature="waiting_timeout").level == 0
    assert decide(cfg, 0, "restart", None).level == 0


def test_restart_backoff_doubles_and_resets_after_health() -> None:
    b = RestartBudget(RecoveryConfig(max_restarts=10, restart_backoff_s=10.0, restart_backoff_max_s=25.0))
    assert b.allow(0.0, None)[0] and b.backoff_s(0.0, 1800.0) == 0.0
    assert b.allow(5.0, None)[0] and b.backoff_s(5.0, 1800.0) == pytest.approx(5.0)  # 10 s after the 1st
    assert b.allow(40.0, None)[0] and b.backoff_s(40.0, 1800.0) == 0.0  # 20 s after the 2nd: passed already
    assert b.allow(41.0, None)[0] and b.backoff_s(41.0, 1800.0) == pytest.approx(24.0)  # capped at 25 s
    assert b.allow(5000.0, None)[0] and b.backoff_s(5000.0, 1800.0) == 0.0  # healthy for long: a new row


def _sample(t: float) -> NodeSample:
    procs = tuple(ProcessSample(100 + r, 1.0, 1, "sleeping", 1.0, 0, 50 << 20, job=JobIdentity("j", r, r, 2),
                                is_rank=True, wakeups=5) for r in (0, 1))
    return NodeSample(t=t, hostname="h", backend="proc", devices=(), processes=procs, errors=())


def test_a_held_job_waits_until_the_waiting_timeout() -> None:
    cfg = DetectConfig(waiting_timeout_s=30.0)
    state = DetectorState()
    for t in (0.0, 1.0):
        state, _ = step(state, _sample(t), cfg)
    js = state.jobs["j"]
    stalled = JobStatus("j", state=STALLED, since=6.0, onset=1.0, ranks=js.ranks, rank_pids=js.rank_pids,
                        ranks_seen=js.ranks_seen)
    state = DetectorState(state.t, state.ranks, state.traffic, {"j": stalled})
    assert hold_waiting(state, "j", 2.0, "x") is state  # another streak: left alone
    state = hold_waiting(state, "j", 1.0, "no communication evidence")
    findings = []
    for t in range(2, 40):
        state, found = step(state, _sample(float(t)), cfg)
        findings += found
        if t < 30:
            assert state.jobs["j"].state == WAITING and not found
    assert [f.signature for f in findings] == ["waiting_timeout"] and findings[0].onset == 1.0
    assert "not hung in communication" in findings[0].detail


def test_ddps_own_collectives_in_its_forward_are_collectives_too() -> None:
    """Ranks blocked in DDP's forward pre-hook (buffer broadcast, bucket rebuild: C++ calls, no Python frame below)
    wait in the regular flow like ranks in its backward; the rank stuck in its data is the culprit."""
    frames = [("DistributedDataParallel._pre_forward", "torch/nn/parallel/distributed.py"),
              ("DistributedDataParallel.forward", "torch/nn/parallel/distributed.py"), ("main", "train.py")]
    rs = classify_threads([_thread(frames)], 0, 10)
    assert rs is not None and rs.state == "collective" and rs.op == "ddp_pre_forward"
    d = diagnose([rs, RankStack(1, 11, "collective", "x", False, "ddp_pre_forward", "y"), _rs(2, "data_wait")])
    assert d.culprit_ranks == (2,) and d.collective == "ddp_pre_forward"


def test_a_pipeline_stage_waiting_for_its_neighbours_activations_is_in_communication() -> None:
    frames = [("_wait_batch_p2p", "torch/distributed/pipelining/schedules.py"),
              ("ScheduleGPipe._step_microbatches", "torch/distributed/pipelining/schedules.py"), ("main", "pp.py")]
    rs = classify_threads([_thread(frames, syscall=EVENT_WAIT_30)], 0, 10)
    assert rs is not None and rs.state == "collective" and rs.op == "_wait_batch_p2p"


def test_a_reader_woken_by_its_bytes_moves_a_consumer_polling_a_dead_producer_does_not() -> None:
    """A socket/pipe read without a timeout wakes only when bytes come (recv counts in no byte counter of the
    thread); a queue poll with a timeout wakes on its timeouts: those wakeups are not data."""
    reader_a, reader_b = _rs(0, "data_wait", after=5), _rs(0, "data_wait", before=6)
    assert rank_moved(reader_a, reader_b)
    poller_a = RankStack(0, 100, "data_wait", "s0", False, None, "x", None, 5, timed=True)
    poller_b = RankStack(0, 100, "data_wait", "s0", False, None, "x", 6, None, timed=True)
    assert not rank_moved(poller_a, poller_b)
