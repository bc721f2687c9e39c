"""The engine asks NCCL RAS only about suspect and stalled jobs, on the poller's own thread: a running or waiting
job is never asked, and the tick does not wait for a RAS socket that never answers."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from gpu_watchdog.config.schema import Config, RasConfig
from gpu_watchdog.detect.detector import RUNNING, STALLED, SUSPECT, WAITING, JobStatus
from gpu_watchdog.engine.loop import Engine
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.store.fallback import FallbackStore
from ras_standin import RasStandIn
from waiting import wait_for


def engine(tmp_path: Path, addr: str) -> Engine:
    cfg = replace(Config(), ras=RasConfig(enabled="on", addr=addr, timeout_s=2.0, poll_interval_s=60.0))
    return Engine(cfg, backend=None, fallback=FallbackStore(tmp_path), pool=None,  # type: ignore[arg-type]
                  health=LoopHealth.for_interval(1.0))


def jobs(**states: str) -> dict[str, JobStatus]:
    return {name: JobStatus(name, state, rank_pids={0: os.getpid()}) for name, state in states.items()}


def test_only_suspect_and_stalled_jobs_are_asked(tmp_path: Path) -> None:
    with RasStandIn() as s:
        e = engine(tmp_path, s.addr)
        e._poll_ras(jobs(a=RUNNING, b=WAITING))
        time.sleep(0.3)
        assert s.connections == 0 and e.ras.jobs() == set()
        e._poll_ras(jobs(c=SUSPECT, d=STALLED))
        wait_for(lambda: s.connections == 2, 10, "one query per suspect or stalled job")
        wait_for(lambda: all((ev := e.ras.evidence(j)) is not None and ev.polls for j in "cd"), 10, "both kept")
        e._poll_ras(jobs(c=SUSPECT, d=STALLED))  # within poll_interval_s: not again
        time.sleep(0.3)
        assert s.connections == 2


def test_a_ras_socket_that_never_answers_does_not_hold_the_tick(tmp_path: Path) -> None:
    with RasStandIn(hang=True) as s:
        e = engine(tmp_path, s.addr)
        t0 = time.monotonic()
        e._poll_ras(jobs(c=SUSPECT))
        assert time.monotonic() - t0 < 0.5
        wait_for(lambda: s.connections == 1, 10, "the query started")
