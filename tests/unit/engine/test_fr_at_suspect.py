"""When the detector turns a job suspect, the engine asks its ranks for Flight Recorder dumps once per streak, on
the worker pool (never on the tick), and the incident at confirmation takes those dumps instead of asking and
waiting then. A real 2-rank gloo job, hung, whose ranks serve the dump FIFO with the in-job helper
(tests/jobs/train.py ``--fr-pipe``, the stand-in for NCCL's dump pipe), started with the settings ``launch`` gives
every job."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gloo_jobs import start_job
from gpu_watchdog.act.gather import EvidenceGatherer
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.schema import Config, FlightRecorderConfig
from gpu_watchdog.detect.detector import RUNNING, SUSPECT
from gpu_watchdog.engine.loop import Engine
from gpu_watchdog.evidence.flight_recorder.dumps import fr_settings, recording_env
from gpu_watchdog.evidence.flight_recorder.incident import FlightRecorderAtIncident
from gpu_watchdog.evidence.flight_recorder.watch import SuspectDumpWatch
from gpu_watchdog.evidence.source import IncidentJob
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.model import Finding, JobStatus
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore
from waiting import wait_for


def engine(tmp_path: Path, pool: ThreadPoolExecutor, cfg: Config | None = None) -> Engine:
    return Engine(cfg or Config(), backend=None, fallback=FallbackStore(tmp_path), pool=pool,  # type: ignore[arg-type]
                  health=LoopHealth.for_interval(1.0))


def status(state: str, pids: dict[int, int], onset: float | None = None) -> dict[str, JobStatus]:
    return {"j": JobStatus("j", state, onset=onset, rank_pids=pids)}


@pytest.mark.slow
def test_a_suspect_jobs_ranks_dump_once_per_streak_and_the_incident_takes_those_dumps(tmp_path: Path) -> None:
    fr_dir = tmp_path / "fr"
    fr_dir.mkdir()
    env = recording_env({}, 200, fr_dir)  # what launch adds to a job that sets nothing
    job = start_job("hang", nproc=2, extra_args=("--rank-at", "1", "--step-at", "3", "--fr-pipe"), env=env,
                    tmp_path=tmp_path / "job")
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        job.wait_event("hang_onset", timeout=90)
        pids = job.wait_ranks(timeout=30)
        time.sleep(0.5)  # rank 0 enters all_reduce #3 after rank 1 logged its onset
        settings = fr_settings(env)
        assert settings is not None
        e = engine(tmp_path, pool)

        # the tick only hands the ask to the pool: a busy worker never holds it
        busy = threading.Event()
        pool.submit(busy.wait, 30)
        t0 = time.monotonic()
        _fr_watch(e).watch(status(SUSPECT, pids, onset=100.0))
        _fr_watch(e).watch(status(SUSPECT, pids, onset=100.0))  # the same streak: asked once
        assert time.monotonic() - t0 < 0.5
        busy.set()
        asked = wait_for(lambda: e.fr_dumps.asked_at("j"), 30, "the suspect-time ask")
        assert len(asked[1]) == 2
        dumps = [settings.dump_path(r) for r in (0, 1)]
        wait_for(lambda: all(p.is_file() and p.stat().st_mtime >= asked[0] for p in dumps), 60,
                 "both ranks' dumps", log=job.log_tail)
        written = [p.stat().st_mtime_ns for p in dumps]

        # confirmation: the incident takes the dumps written since the ask, without asking or waiting again
        ctx = ActContext(Config(), "n1", IncidentStore(tmp_path / "state"), FallbackStore(tmp_path / "state"))
        ctx.fr_dumps = e.fr_dumps
        inc = ctx.open_incident(Finding("stall", "idle_held", "j", (0, 1), (), 100.0, 130.0, (), "no progress",
                                        "stacks"))
        t0 = time.monotonic()
        at_incident = IncidentJob("j", pids, 2, inc.dir)
        found = EvidenceGatherer(ctx).ask(ctx.transcript(inc), FlightRecorderAtIncident(e.fr_dumps), at_incident)
        assert time.monotonic() - t0 < 5.0  # no FR_WAIT_S wait
        assert found is not None and found.verdict is not None and found.verdict.culprit_ranks == (1,), found
        (action,) = [a for a in inc.summary["actions"] if a["action"] == "flight_recorder"]
        assert action["ok"] and action["detail"].startswith("2 dump(s) collected, 2 triggered (at suspect, "), action
        time.sleep(1.5)
        assert [p.stat().st_mtime_ns for p in dumps] == written  # no second dump was asked for
        assert sorted(p.name for p in (inc.dir / "flight-recorder").iterdir()) == ["fr-rank-0.pkl", "fr-rank-1.pkl"]

        # running again ends the streak; the next suspect streak asks again
        _fr_watch(e).watch(status(RUNNING, pids))
        assert e.fr_dumps.asked_at("j") is None
        _fr_watch(e).watch(status(SUSPECT, pids, onset=200.0))
        wait_for(lambda: e.fr_dumps.asked_at("j"), 30, "the second streak's ask")
        wait_for(lambda: [p.stat().st_mtime_ns for p in dumps] != written, 60, "fresh dumps", log=job.log_tail)

        # switched off: a suspect job is not asked
        off = engine(tmp_path, pool, dataclasses.replace(Config(), flight_recorder=FlightRecorderConfig(
            dump_on_suspect=False)))
        _fr_watch(off).watch(status(SUSPECT, pids, onset=300.0))
        time.sleep(0.5)
        assert off.fr_dumps.asked_at("j") is None and off.fr_dumps.jobs() == set()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        job.stop()


def _fr_watch(e: Engine) -> SuspectDumpWatch:
    return next(w for w in e.watches if isinstance(w, SuspectDumpWatch))
