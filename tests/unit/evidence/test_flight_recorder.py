"""gpu_watchdog.evidence.flight_recorder.dumps: settings, the non-blocking FIFO trigger, safe loading, and the
culprit of REAL gloo Flight Recorder dumps (``_dump_fr_trace()`` inside a hung 2-rank torchrun job)."""

from __future__ import annotations

import collections
import os
import pickle
import time
from pathlib import Path

import pytest
from gloo_jobs import start_job
from gpu_watchdog.evidence.flight_recorder.analysis import analyze_traces, rank_trace
from gpu_watchdog.evidence.flight_recorder.dumps import (
    DEFAULT_DUMP_PREFIX,
    FlightRecorderError,
    FrSettings,
    collect_dumps,
    fr_settings,
    load_dump,
    trigger_dumps,
)


def test_settings_from_env() -> None:
    assert fr_settings({}) is None
    assert fr_settings({"TORCH_FR_BUFFER_SIZE": "0"}) is None
    assert fr_settings({"TORCH_FR_BUFFER_SIZE": "lots"}) is None
    s = fr_settings({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert s == FrSettings(2000, DEFAULT_DUMP_PREFIX, None, False)
    s = fr_settings({"TORCH_FR_BUFFER_SIZE": "100", "TORCH_NCCL_TRACE_BUFFER_SIZE": "5",
                     "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/old/", "TORCH_FR_DUMP_TEMP_FILE": "/d/trace_",
                     "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/p/pipe_", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    assert s == FrSettings(100, "/d/trace_", "/p/pipe_", True)
    assert str(s.dump_path(3)) == "/d/trace_3" and str(s.pipe_path(3)) == "/p/pipe_3.pipe"
    old = fr_settings({"TORCH_FR_BUFFER_SIZE": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/old/t_"})
    assert old is not None and old.dump_prefix == "/old/t_"


def test_trigger_never_blocks_and_never_writes_regular_files(tmp_path: Path) -> None:
    s = FrSettings(10, str(tmp_path / "trace_"), str(tmp_path / "pipe_"))
    os.mkfifo(tmp_path / "pipe_0.pipe")  # a FIFO nobody reads: open would block without O_NONBLOCK
    (tmp_path / "pipe_1.pipe").write_text("keep")  # not a FIFO
    # rank 2: no FIFO at all
    t0 = time.monotonic()
    assert trigger_dumps(s, [0, 1, 2]) == []
    assert time.monotonic() - t0 < 1
    assert (tmp_path / "pipe_1.pipe").read_text() == "keep"

    rfd = os.open(tmp_path / "pipe_0.pipe", os.O_RDONLY | os.O_NONBLOCK)  # a reader, as NCCL keeps one
    try:
        assert trigger_dumps(s, [0]) == [str(tmp_path / "pipe_0.pipe")]
        assert os.read(rfd, 10) == b"1"
    finally:
        os.close(rfd)
    assert trigger_dumps(FrSettings(10, "/x/"), [0]) == []  # no pipe configured


def test_load_dump_rejects_bad_files(tmp_path: Path) -> None:
    with pytest.raises(FlightRecorderError, match="cannot read"):
        load_dump(tmp_path / "nope")
    (tmp_path / "garbage").write_bytes(b"\x00not a pickle")
    with pytest.raises(FlightRecorderError, match=r"garbage: not a Flight Recorder dump"):
        load_dump(tmp_path / "garbage")
    (tmp_path / "class").write_bytes(pickle.dumps(collections.OrderedDict(entries=[])))
    with pytest.raises(FlightRecorderError, match="refusing class collections.OrderedDict"):
        load_dump(tmp_path / "class")
    (tmp_path / "list").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(FlightRecorderError, match="no 'entries' list"):
        load_dump(tmp_path / "list")


@pytest.mark.slow
def test_real_gloo_dumps_name_the_lagging_rank(tmp_path: Path) -> None:
    env = {"TORCH_FR_BUFFER_SIZE": "200", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "trace_"),
           "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "fr" / "pipe_")}
    (tmp_path / "fr").mkdir()
    job = start_job("hang", nproc=2, extra_args=("--rank-at", "1", "--step-at", "3", "--fr-pipe"), env=env,
                    tmp_path=tmp_path)
    try:
        job.wait_event("hang_onset", timeout=90)
        job.wait_ranks(timeout=30)
        time.sleep(0.5)  # rank 0 enters all_reduce #3 after rank 1 logged its onset
        settings = fr_settings(env)
        assert settings is not None
        asked_at = time.time() - 1
        deadline = time.monotonic() + 30
        copies: list[Path] = []
        while time.monotonic() < deadline:
            assert len(trigger_dumps(settings, [0, 1])) == 2
            time.sleep(1.0)
            copies = collect_dumps(settings, tmp_path / "incident", newer_than=asked_at)
            if len(copies) == 2:
                break
        assert [p.name for p in copies] == ["fr-rank-0.pkl", "fr-rank-1.pkl"]
    finally:
        job.stop()
    dumps = {i: load_dump(p) for i, p in enumerate(copies)}
    assert {"version", "pg_config", "pg_status", "entries"} <= set(dumps[0])
    a = analyze_traces([rank_trace(d, r, copies[r].stat().st_mtime) for r, d in dumps.items()], min_wait_s=0.0)
    assert a.culprit_ranks == (1,)
    (g,) = a.groups  # the default group: rank 0 waits in all_reduce #3, rank 1 never enqueued it
    assert (g.name, g.desc, g.kind, g.op, g.seq, g.sizes, g.waiting, g.missing) == (
        "0", "default_pg", "missing", "all_reduce", 3, [[1024]], (0,), (1,))
    assert collect_dumps(settings, tmp_path / "later", newer_than=time.time() + 60) == []
    assert collect_dumps(settings, tmp_path / "only1", ranks=[1])[0].name == "fr-rank-1.pkl"
