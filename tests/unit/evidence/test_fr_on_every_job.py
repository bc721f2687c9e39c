"""Flight Recorder on every job: the settings ``launch`` and the TaskProlog add (what the user set always wins), the
per-run directory they point at, and the suspect-time ask (once per streak, only where a dump FIFO is served)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from gpu_watchdog.evidence.flight_recorder.dumps import (
    RUN_DIR_NAME,
    SuspectDumps,
    fr_settings,
    prepare_run_dir,
    recording_env,
    unserved,
)


def test_a_job_without_settings_gets_recording_dumps_and_the_dump_pipe(tmp_path: Path) -> None:
    env = recording_env({"PATH": "/bin"}, 2000, tmp_path)
    dumps = f"{tmp_path}/rank-"
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                   "TORCH_FR_DUMP_TEMP_FILE": dumps, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dumps,
                   "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/pipe-"}
    s = fr_settings(env)  # what the agent reads back from a rank's environment
    assert s is not None and s.buffer_size == 2000 and s.pipe_prefix == f"{tmp_path}/pipe-"
    assert s.dump_path(3) == tmp_path / "rank-3" and s.pipe_path(3) == tmp_path / "pipe-3.pipe"


@pytest.mark.parametrize("name", ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"])
def test_what_the_user_set_wins(tmp_path: Path, name: str) -> None:
    env = recording_env({name: "500"}, 2000, tmp_path)  # their buffer, our paths
    assert "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == f"{tmp_path}/pipe-"
    for dump in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):  # either name keeps their dumps
        env = recording_env({dump: "/mine/t_"}, 2000, tmp_path)
        assert "TORCH_FR_DUMP_TEMP_FILE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
        assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    env = recording_env({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/mine/p_"}, 2000, tmp_path)
    assert "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" not in env and env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/rank-"
    assert recording_env({"TORCH_FR_BUFFER_SIZE": "", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": " "}, 2000,
                         tmp_path)["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == f"{tmp_path}/pipe-"  # empty = unset


@pytest.mark.parametrize("value", ["0", "-1", "off"])
def test_a_job_that_turned_recording_off_gets_nothing(tmp_path: Path, value: str) -> None:
    assert recording_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": value}, 2000, tmp_path) == {}
    assert recording_env({}, 0, tmp_path) == {}


def test_no_paths_into_a_directory_the_job_cannot_write(tmp_path: Path) -> None:
    """NCCL's heartbeat thread creates the FIFO with a TORCH_CHECK: a path it cannot create would kill the rank."""
    only_buffer = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    assert recording_env({}, 2000, tmp_path / "missing") == only_buffer
    (tmp_path / "file").write_text("")
    assert recording_env({}, 2000, tmp_path / "file") == only_buffer
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert recording_env({}, 2000, ro) == only_buffer
        finally:
            ro.chmod(0o700)


def test_the_run_directory_starts_empty(tmp_path: Path) -> None:
    d = prepare_run_dir(tmp_path)
    assert d == tmp_path / RUN_DIR_NAME and d.is_dir()
    (d / "rank-0").write_bytes(b"old dump")
    os.mkfifo(d / "pipe-0.pipe")
    (d / "keep").mkdir()
    assert prepare_run_dir(tmp_path) == d
    assert [p.name for p in d.iterdir()] == ["keep"]
    (tmp_path / "blocked").write_text("")
    assert prepare_run_dir(tmp_path / "blocked") is None  # cannot be made: the job gets no paths


def test_the_suspect_ask_is_once_per_streak_and_only_where_a_fifo_is_served(tmp_path: Path) -> None:
    env = recording_env({}, 2000, tmp_path)
    s = fr_settings(env)
    assert s is not None
    pipes = [Path(f"{s.pipe_prefix}{r}.pipe") for r in (0, 1)]
    for p in pipes:
        os.mkfifo(p)
    readers = [os.open(p, os.O_RDONLY | os.O_NONBLOCK) for p in pipes]  # as NCCL's heartbeat thread keeps one open
    try:
        dumps = SuspectDumps()
        pids = {0: 100, 1: 101}
        assert dumps.claim("j", 10.0) and not dumps.claim("j", 10.0)  # once per streak (its onset)
        assert dumps.ask("j", 10.0, pids, lambda _pids: env) == tuple(str(p) for p in pipes)
        assert [os.read(fd, 8) for fd in readers] == [b"1", b"1"]
        asked = dumps.asked_at("j")
        assert asked is not None and asked[1] == tuple(str(p) for p in pipes)
        assert dumps.asked_at("j", onset=11.0) is None  # another streak's
        assert dumps.claim("j", 11.0) and dumps.asked_at("j") is None  # a new streak asks again
        dumps.end("j")
        assert dumps.jobs() == set() and dumps.claim("j", 11.0)
        # a job whose FIFOs nobody reads, a job without a pipe, a job without FR: nothing asked, nothing kept
        assert dumps.ask("j", 11.0, {5: 105}, lambda _pids: env) == ()
        assert dumps.ask("j", 11.0, pids, lambda _pids: {"TORCH_FR_BUFFER_SIZE": "2000"}) == ()
        assert dumps.ask("j", 11.0, pids, lambda _pids: {}) == ()
        assert dumps.asked_at("j") is None
        dumps.end("j")  # the streak ended while a worker was asking: its answer is not kept
        assert dumps.ask("j", 11.0, pids, lambda _pids: env) and dumps.asked_at("j") is None
    finally:
        for fd in readers:
            os.close(fd)
    assert all(stat.S_ISFIFO(os.stat(p).st_mode) for p in pipes)


def test_a_job_whose_ranks_serve_no_fifo_has_nothing_to_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch gives every job a dump pipe; a gloo job's ranks never create it (no in-job helper): the incident gets
    no flight_recorder action at all rather than one for every CPU job. A FIFO, or a dump of this run, and it does."""
    import psutil
    from gpu_watchdog.act.gather import EvidenceGatherer
    from gpu_watchdog.act.target import ActContext
    from gpu_watchdog.config.schema import Config
    from gpu_watchdog.evidence.flight_recorder.incident import FlightRecorderAtIncident
    from gpu_watchdog.evidence.source import IncidentJob
    from gpu_watchdog.model import Finding
    from gpu_watchdog.store.fallback_levels import FallbackStore
    from gpu_watchdog.store.incidents import IncidentStore

    env = recording_env({}, 2000, tmp_path)
    s = fr_settings(env)
    assert s is not None
    assert unserved(s, [0, 1], 0.0)
    monkeypatch.setattr(psutil.Process, "environ", lambda self: env)
    ctx = ActContext(Config(), "n1", IncidentStore(tmp_path / "st"), FallbackStore(tmp_path / "st"))
    inc = ctx.open_incident(Finding("stall", "idle_held", "j", (0, 1), (1,), 1.0, 6.0, (), "no progress", "stacks"))
    pids = {0: os.getpid(), 1: os.getpid()}
    job = IncidentJob("j", pids, 2, inc.dir)
    assert EvidenceGatherer(ctx).ask(ctx.transcript(inc), FlightRecorderAtIncident(), job) is None
    assert not [a for a in inc.summary.get("actions", []) if a["action"] == "flight_recorder"]
    pipe1 = tmp_path / "pipe-1.pipe"
    os.mkfifo(pipe1)  # rank 1 serves the FIFO (nobody reads it here): asked, and the incident says so
    assert not unserved(s, [0, 1], 0.0)
    found = EvidenceGatherer(ctx).ask(ctx.transcript(inc), FlightRecorderAtIncident(), job)
    assert found is not None and found.verdict is None
    (action,) = [a for a in inc.summary["actions"] if a["action"] == "flight_recorder"]
    assert not action["ok"] and action["detail"] == "no dump collected, 0 triggered", action
    os.unlink(pipe1)
    s.dump_path(0).write_bytes(b"x")  # a dump of this run (dump on timeout, an earlier ask)
    assert not unserved(s, [0, 1], 0.0) and unserved(s, [0, 1], time.time() + 60)
    no_pipe = fr_settings({"TORCH_FR_BUFFER_SIZE": "1"})
    assert no_pipe is not None and not unserved(no_pipe, [0], None)  # no pipe set: "not available" as before
