"""The engine's ring of recent samples and the trace every incident carries (``trace.jsonl``): bounded in memory,
replayable, written through the one atomic writer and kept in memory while the state dir cannot take it."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from gpu_watchdog import atomic
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.schema import AgentConfig, Config, StacksConfig
from gpu_watchdog.detect.replay import replay_trace
from gpu_watchdog.engine.loop import Engine
from gpu_watchdog.errors import EXIT_NOINPUT, TraceError
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.model import NodeSample, RankStack, StackEvidence
from gpu_watchdog.sample.recent import TRACE_NAME, RecentSamples, max_records
from gpu_watchdog.sample.trace import read_trace
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore
from repo_paths import REPO

DATA = REPO / "tests" / "data"
CLI = str(Path(sys.executable).with_name("gpu-watchdog"))


def _samples(name: str) -> list[NodeSample]:
    _head, recs = read_trace(DATA / name)
    return [r for r in recs if isinstance(r, NodeSample)]


class TraceBackend:
    """A recorded trace played back tick by tick as if sampled live."""

    name = "proc"

    def __init__(self, samples: list[NodeSample]) -> None:
        self._it = iter(samples)

    def sample(self) -> NodeSample:
        return next(self._it)

    def close(self) -> None:
        pass


def _run_engine(tmp: Path, trace: str, window_s: float) -> tuple[Engine, ActContext, list]:
    """The real engine over a corpus trace; every finding opens an incident the way launch and the daemon do."""
    cfg = Config(agent=AgentConfig(backend="proc", incident_trace_s=window_s), stacks=StacksConfig(enabled=False))
    samples = _samples(trace)
    with ThreadPoolExecutor(1) as pool:
        engine = Engine(cfg, TraceBackend(samples), FallbackStore(tmp), pool, health=LoopHealth(60.0))
        ctx = ActContext(cfg, "corpus-node", IncidentStore(tmp), FallbackStore(tmp), recent=engine.recent)
        incidents = []
        for _ in samples:
            tick = engine.tick()
            assert tick.ok, tick.error
            incidents += [ctx.open_incident(f) for f in tick.findings]
    return engine, ctx, incidents


def test_an_incident_carries_a_replayable_trace_of_the_window_before_confirmation(tmp_path: Path) -> None:
    engine, _ctx, incidents = _run_engine(tmp_path, "proc-hang.trace", window_s=35.0)
    (inc,) = incidents
    trace = inc.dir / TRACE_NAME
    assert inc.summary["trace"] == TRACE_NAME and trace.is_file()
    head, recs = read_trace(trace)
    samples = [r for r in recs if isinstance(r, NodeSample)]
    assert head["backend"] == "proc" and head["hostname"] == "corpus-node"
    # the 35 s before confirmation, not the whole run (the corpus trace is longer), nothing after it
    assert samples[-1].t == inc.summary["detected_at"]
    assert 33.0 <= samples[-1].t - samples[0].t <= 35.0
    assert len(_samples("proc-hang.trace")) > len(samples)
    (again,) = replay_trace(inc.dir, Config().detect)  # replay takes the incident directory
    assert (again.kind, again.signature, again.job_id) == ("stall", inc.summary["signature"], inc.summary["job_id"])
    assert again.onset == inc.summary["onset"] and again.confirmed_at == inc.summary["detected_at"]
    r = subprocess.run([CLI, "replay", str(inc.dir)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("stall idle_held job=corpus-proc-hang"), r


def test_a_healthy_run_writes_no_trace_and_the_ring_stays_bounded(tmp_path: Path) -> None:
    engine, _ctx, incidents = _run_engine(tmp_path, "proc-healthy.trace", window_s=10.0)
    assert incidents == [] and not (tmp_path / "incidents").exists()
    recent = engine.recent
    assert 0 < len(recent) <= max_records(10.0, 1.0)
    text = recent.trace(engine.last_sample.t)
    times = [json.loads(line)["t"] for line in text.splitlines()[1:]]
    assert engine.last_sample.t - times[0] <= 10.0


def _sample(t: float, job: str = "j") -> NodeSample:
    return replace(_samples("proc-hang.trace")[5], t=t)


def test_the_ring_is_bounded_by_time_and_by_count() -> None:
    base = _sample(0.0)
    ring = RecentSamples(window_s=5.0, interval_s=1.0)
    for i in range(1000):
        ring.add(replace(base, t=1000.0 + i))
    assert len(ring) == 6  # t-5 .. t
    burst = RecentSamples(window_s=5.0, interval_s=1.0)
    for i in range(1000):  # ticks far faster than the interval: the count cap holds
        burst.add(replace(base, t=1000.0 + i * 0.001))
    assert len(burst) == max_records(5.0, 1.0)
    off = RecentSamples(window_s=0.0, interval_s=1.0)
    off.add(base)
    assert len(off) == 0 and off.trace(base.t) is None


def test_stack_dumps_come_before_their_sample_and_another_jobs_are_left_out() -> None:
    base = _sample(0.0)
    job = next(p.job.job_id for p in base.processes if p.job)
    ours = StackEvidence(job, 99.5, (RankStack(0, 1, "collective", "a <- b", False, "all_reduce"),))
    theirs = StackEvidence("someone-else", 99.6, ())
    ring = RecentSamples(window_s=60.0, interval_s=1.0)
    ring.add(replace(base, t=99.0))
    ring.add(replace(base, t=100.0), [ours, theirs])
    types = [json.loads(line)["type"] for line in ring.trace(100.0, job).splitlines()]
    assert types == ["header", "sample", "stacks", "sample"]


def test_a_clock_stepped_back_starts_the_ring_again() -> None:
    base = _sample(0.0)
    ring = RecentSamples(window_s=60.0, interval_s=1.0)
    for t in (100.0, 101.0, 102.0, 50.0):
        ring.add(replace(base, t=t))
    assert len(ring) == 1  # a trace's samples never go back in time


def _one_incident(tmp: Path):
    _engine, ctx, incidents = _run_engine(tmp, "proc-hang.trace", window_s=35.0)
    return ctx, incidents[0]


def test_a_full_disk_keeps_the_trace_in_memory_and_a_later_save_writes_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, inc = _one_incident(tmp_path)
    text = (inc.dir / TRACE_NAME).read_text()
    (inc.dir / TRACE_NAME).unlink()
    real = atomic.write_atomic
    errors = atomic.write_errors()

    def full(path: Path, data: str | bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("gpu_watchdog.store.incidents.write_atomic", full)
    inc.keep_file(TRACE_NAME, text)  # the write fails: counted, the incident goes on
    inc.record_action("stop", True, "SIGTERM to 4 job processes")
    assert atomic.write_errors() > errors and not (inc.dir / TRACE_NAME).exists()
    assert not list(inc.dir.glob(".*.tmp"))  # nothing half-written
    monkeypatch.setattr("gpu_watchdog.store.incidents.write_atomic", real)
    inc.record_action("restart", True, "run 1")  # space is back: the next save lands it
    assert (inc.dir / TRACE_NAME).read_text() == text


def test_a_deleted_incident_directory_gets_its_trace_back(tmp_path: Path) -> None:
    ctx, inc = _one_incident(tmp_path)
    text = (inc.dir / TRACE_NAME).read_text()
    shutil.rmtree(inc.dir)
    inc.record_action("stop", True, "SIGTERM to 4 job processes")
    assert (inc.dir / TRACE_NAME).read_text() == text


def test_replay_of_a_directory_without_a_trace_is_missing_input(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=f"no trace in {tmp_path}"):
        replay_trace(tmp_path, Config().detect)
    r = subprocess.run([CLI, "replay", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_NOINPUT and len(r.stderr.strip().splitlines()) == 1, r
