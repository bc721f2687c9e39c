"""A job that died of its own collective timeout names the rank its peers waited on, never the waiters that exited
first: what the ranks printed (gloo's and NCCL's own timeout lines, as torchrun prefixes them) and who the detector
last saw waiting on whom."""

from __future__ import annotations

from pathlib import Path

from gpu_watchdog.evidence.deadline.timeout_exit import timeout_exit, timeouts_in
from gpu_watchdog.model import Deadline, JobState, JobStatus

DATA = Path(__file__).resolve().parents[2] / "data" / "timeouts"
# What a 4-rank gloo job printed when its all_gather timed out (tests/e2e/test_deadline.py, torch 2.13)
GLOO = (DATA / "gloo-all_gather.txt").read_text()
# NCCL's watchdog, as published in LlamaFactory#7396 and Megatron-LM#1207 (torch 2.5-2.6 and older formats)
NCCL = (DATA / "nccl-watchdog.txt").read_text()


def _waiting(on: tuple[int, ...], ranks: tuple[int, ...] = (0, 1, 2, 3)) -> JobStatus:
    return JobStatus("j", state=JobState.WAITING, ranks=ranks, waiting_since=1.0, waiting_on=on,
                     waiting_doing="rank 0: io at write (save.py:3)",
                     deadline=Deadline(30.0, "client", "x", collective=None))


def test_the_timeout_lines_are_read_per_rank() -> None:
    assert timeouts_in(GLOO) == {1: (30.0, None), 2: (30.0, None), 3: (30.0, None)}
    assert timeouts_in(NCCL) == {0: (600.0, "allreduce"), 4: (600.0, "allreduce"), 7: (1800.0, "allgather_base")}
    assert timeouts_in("[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:1234") == {}


def test_the_waited_on_rank_is_named_not_the_waiters_that_exited_first() -> None:
    v = timeout_exit(GLOO, _waiting((0,)), first=(2,))
    assert v is not None and v.waited_on == (0,) and v.timed_out == (1, 2, 3) and v.timeout_s == 30.0
    assert v.detail() == ("rank(s) 1,2,3 hit the job's own 30 s collective timeout waiting on rank 0 "
                          "(rank 0: io at write (save.py:3))")


def test_no_verdict_without_the_evidence() -> None:
    assert timeout_exit(GLOO, None, first=(2,)) is None  # the detector saw no wait
    assert timeout_exit(GLOO, _waiting(()), first=(2,)) is None
    assert timeout_exit("", _waiting((0,)), first=(2,)) is None  # nothing printed a timeout: a plain crash
    assert timeout_exit(GLOO, _waiting((0,)), first=(0,)) is None  # the first to exit did not time out
    # the rank the detector saw waited on printed a timeout itself: it was waiting too, so nobody is named
    assert timeout_exit(GLOO, _waiting((1,)), first=(2,)) is None
    assert timeout_exit(GLOO, _waiting((1, 2, 3)), first=(2,)) is None


def test_an_older_wait_is_not_the_one_that_timed_out() -> None:
    """The waiters sat in the collective for the whole timeout before they exited: a wait the detector last saw
    before that window is another one (it ended), so it names nobody."""
    assert timeout_exit(GLOO, _waiting((0,)), (2,), seen_at=100.0, exited_at=129.0) is not None
    assert timeout_exit(GLOO, _waiting((0,)), (2,), seen_at=100.0, exited_at=131.0) is None
