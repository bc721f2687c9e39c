"""The deadline watch: it learns a wait's deadline off the tick (the in-job client's report here; the backend's
default without one), hands it to the detector, and warns once at the configured share of it — with what the
waited-on rank is doing read from /proc (a real process writing a real file)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_watchdog.config.schema import Config, DetectConfig
from gpu_watchdog.evidence.deadline import activity
from gpu_watchdog.evidence.deadline.watch import DeadlineWatch, remedies_for
from gpu_watchdog.job.protocol import CONTROL_DIR_ENV, write_json_atomic
from gpu_watchdog.model import (
    Deadline,
    JobIdentity,
    JobState,
    JobStatus,
    NodeSample,
    ProcessSample,
    RankStack,
    StackEvidence,
)

T0 = 1_800_000_000.0
CFG = Config(detect=dataclasses.replace(DetectConfig(), deadline_warn_ratio=0.5))

WRITER = r"""
import os, sys, time
with open(sys.argv[1], "wb") as f:
    while True:
        f.write(b"x" * 65536); f.flush(); time.sleep(0.05)
"""


def _sample(t: float, pids: dict[int, int]) -> NodeSample:
    procs = tuple(ProcessSample(pid=pid, create_time=0.0, ppid=1, status="sleeping", cpu_time_s=0.0, io_bytes=0,
                                rss_bytes=1, job=JobIdentity("j", r, r, len(pids)), is_rank=True)
                  for r, pid in pids.items())
    return NodeSample(t=t, hostname="n", backend="proc", devices=(), processes=procs)


def _waiting(t: float, pids: dict[int, int], deadline: Deadline | None) -> dict[str, JobStatus]:
    ev = StackEvidence("j", t, (RankStack(0, pids[0], "io", "s", True, where="write (save.py:3)"),
                                RankStack(1, pids[1], "collective", "c", False, op="all_gather")))
    return {"j": JobStatus("j", state=JobState.WAITING, waiting_since=T0, waiting_on=(0,), ranks=(0, 1),
                           rank_pids=pids, evidence=(ev,), waiting_doing="rank 0: io at write (save.py:3)",
                           deadline=deadline)}


def _learnt(watch: DeadlineWatch, timeout_s: float = 10.0) -> Deadline:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        known = watch.known()
        if "j" in known:
            return known["j"]
        time.sleep(0.02)
    raise AssertionError("the deadline was never learnt")


def test_the_client_report_is_learnt_and_the_warning_comes_once_at_half(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    for rank in (0, 1):
        write_json_atomic(control / f"groups-{rank}.json", {"rank": rank, "pid": 1, "t": T0, "groups": [
            {"name": "0", "desc": "default_pg", "ranks": [0, 1], "timeout_s": 900.0}]})
    out = tmp_path / "model.safetensors"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out)])
    try:
        pids = {0: writer.pid, 1: os.getpid()}
        watch = DeadlineWatch(lambda: CFG, environ=lambda _pids: {CONTROL_DIR_ENV: str(control)})
        now = time.time()
        assert watch.watch(_waiting(now, pids, None), _sample(T0 + 15, pids)) == []
        learnt = _learnt(watch)
        assert learnt.source == "client" and learnt.timeout_s == 900.0
        time.sleep(0.6)  # the writer writes meanwhile
        # the detector applied it: not yet half-way (449 s of 900)
        assert watch.watch(_waiting(now, pids, learnt), _sample(T0 + 449, pids)) == []
        (f,) = watch.watch(_waiting(now, pids, learnt), _sample(T0 + 450, pids))
        assert (f.kind, f.signature, f.culprit_ranks) == ("deadline", "collective_timeout_near", (0,))
        facts = f.facts
        assert facts["timeout_s"] == 900.0 and facts["left_s"] == 450.0 and facts["waiting_in"] == "all_gather"
        assert facts["waiting_ranks"] == [1] and facts["due_at"] == T0 + 900.0
        assert "writing" in facts["activity"]["0"] and str(out) in facts["activity"]["0"], facts["activity"]
        assert "async_save" in f.detail and "in 450 s" in f.detail
        assert watch.watch(_waiting(now, pids, learnt), _sample(T0 + 500, pids)) == []  # once per wait
        watch.watch({"j": JobStatus("j", rank_pids=pids)}, _sample(T0 + 501, pids))  # running again
        assert "j" not in watch.known()
    finally:
        writer.kill()
        writer.wait()
        watch.close()


def test_without_any_source_a_cpu_job_gets_pytorchs_gloo_default(tmp_path: Path) -> None:
    pids = {0: os.getpid(), 1: os.getpid()}
    watch = DeadlineWatch(lambda: CFG, environ=lambda _pids: {})
    try:
        watch.watch(_waiting(time.time(), pids, None), _sample(T0 + 15, pids))
        learnt = _learnt(watch)
        assert learnt.source == "default" and learnt.timeout_s == 1800.0 and "gloo" in learnt.detail
    finally:
        watch.close()


def test_a_deadline_the_detector_did_not_apply_is_never_warned_about() -> None:
    pids = {0: os.getpid(), 1: os.getpid()}
    watch = DeadlineWatch(lambda: CFG, environ=lambda _pids: {})
    try:
        watch.watch(_waiting(time.time(), pids, None), _sample(T0 + 15, pids))
        _learnt(watch)
        assert watch.watch(_waiting(time.time(), pids, None), _sample(T0 + 1700, pids)) == []
    finally:
        watch.close()


def test_activity_reads_bytes_and_the_file_being_written(tmp_path: Path) -> None:
    out = tmp_path / "ckpt.pt"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out)])
    try:
        time.sleep(0.3)
        before = activity.snapshot(writer.pid, time.time())
        time.sleep(1.0)
        after = activity.snapshot(writer.pid, time.time())
        assert before is not None and after is not None and after.writing == str(out)
        text = activity.describe(before, after)
        assert text.startswith("writing ") and "MiB/s" in text and text.endswith(f"to {out}")
        assert activity.describe(before, before) == "" and activity.describe(None, after) == ""
        assert activity.snapshot(2 ** 22 + 12345, time.time()) is None  # no such process
    finally:
        writer.kill()
        writer.wait()


def test_remedies_fit_what_the_waited_on_rank_does() -> None:
    assert any("async_save" in r for r in remedies_for("rank 0: io at write (save.py:3)", False, False))
    assert any("DataLoader" in r for r in remedies_for("rank 0: data_wait at get (q.py:1)", False, True))
    compute = remedies_for("rank 0: compute at generate (gen.py:9)", False, False)
    assert any("same work" in r for r in compute) and all("async_save" not in r for r in compute)
    assert all(any("ddp_timeout" in r for r in rs) for rs in (compute, remedies_for("", True, False)))


def test_a_short_wait_asks_nothing() -> None:
    """A rank a step behind makes its peers wait a moment: no environment read, no dump asked for, no deadline."""
    asked = []
    pids = {0: os.getpid(), 1: os.getpid()}
    watch = DeadlineWatch(lambda: CFG, environ=lambda p: asked.append(p) or {})
    try:
        assert watch.watch(_waiting(time.time(), pids, None), _sample(T0 + 14.9, pids)) == []
        time.sleep(0.2)
        assert asked == [] and watch.known() == {} and watch.jobs() == set()
    finally:
        watch.close()
