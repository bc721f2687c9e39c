"""The engine asks NCCL RAS on the poller's own thread: about every suspect or stalled job, and all the time
(``ras.watch_interval_s``) about the jobs whose rank 0 runs on this node — a running job whose rank 0 is elsewhere
is not asked, so a job's RAS network is watched by one node, not all of them. The tick never waits for a RAS
socket that never answers, and each pair of polls becomes one CommProgress for the detector."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from gpu_watchdog.config.schema import Config, RasConfig
from gpu_watchdog.detect.detector import RUNNING, STALLED, SUSPECT, WAITING
from gpu_watchdog.engine.loop import Engine
from gpu_watchdog.evidence.nccl_ras.watch import RasWatch
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.model import JobStatus
from gpu_watchdog.store.fallback_levels import FallbackStore
from ras_standin import Comm, Rank, RasStandIn, report_json
from waiting import wait_for


def engine(tmp_path: Path, addr: str, watch_interval_s: float = 0.0) -> Engine:
    cfg = replace(Config(), ras=RasConfig(enabled="on", addr=addr, timeout_s=2.0, poll_interval_s=60.0,
                                          watch_interval_s=watch_interval_s))
    return Engine(cfg, backend=None, fallback=FallbackStore(tmp_path), pool=None,  # type: ignore[arg-type]
                  health=LoopHealth.for_interval(1.0))


def jobs(rank: int = 0, **states: str) -> dict[str, JobStatus]:
    return {name: JobStatus(name, state, rank_pids={rank: os.getpid()}) for name, state in states.items()}


def test_without_watching_only_suspect_and_stalled_jobs_are_asked(tmp_path: Path) -> None:
    with RasStandIn() as s:
        e = engine(tmp_path, s.addr)
        _ras_watch(e).watch(jobs(a=RUNNING, b=WAITING))
        time.sleep(0.3)
        assert s.connections == 0 and e.ras.jobs() == set()
        _ras_watch(e).watch(jobs(c=SUSPECT, d=STALLED))
        wait_for(lambda: s.connections == 2, 10, "one query per suspect or stalled job")
        wait_for(lambda: all((ev := e.ras.evidence(j)) is not None and ev.polls for j in "cd"), 10, "both kept")
        _ras_watch(e).watch(jobs(c=SUSPECT, d=STALLED))  # within poll_interval_s: not again
        time.sleep(0.3)
        assert s.connections == 2


def test_a_ras_socket_that_never_answers_does_not_hold_the_tick(tmp_path: Path) -> None:
    with RasStandIn(hang=True) as s:
        e = engine(tmp_path, s.addr)
        t0 = time.monotonic()
        _ras_watch(e).watch(jobs(c=SUSPECT))
        assert time.monotonic() - t0 < 0.5
        wait_for(lambda: s.connections == 1, 10, "the query started")


def test_rank_0s_node_watches_its_jobs_all_the_time_and_hands_the_detector_their_progress(tmp_path: Path) -> None:
    ranks = [Rank(r, host="127.0.0.1", pid=100 + r, counts={"AllReduce": 5}) for r in range(2)]
    moved = [Rank(r, host="127.0.0.1", pid=100 + r, counts={"AllReduce": 6 if r == 0 else 5}) for r in range(2)]
    reports = [report_json([Comm(0xBEEF, 2, ranks)]), report_json([Comm(0xBEEF, 2, moved)]),
               report_json([Comm(0xBEEF, 2, moved)])]
    with RasStandIn(reports) as s:
        e = engine(tmp_path, s.addr, watch_interval_s=0.2)
        _ras_watch(e).watch(jobs(rank=1, elsewhere=RUNNING))  # rank 0 runs on another node: that node watches
        time.sleep(0.3)
        assert s.connections == 0
        seen = []
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            _ras_watch(e).watch(jobs(here=RUNNING))
            seen += e.ras.take_progress()
            time.sleep(0.05)
        assert [(p.job_id, p.state, p.behind) for p in seen[:2]] == [
            ("here", "moving", ()), ("here", "frozen_unequal", (1,))], seen


def test_the_other_nodes_get_the_watchers_observations_through_the_shared_directory(tmp_path: Path) -> None:
    from gpu_watchdog.config.schema import AgentConfig, FallbackConfig
    from gpu_watchdog.model import CommProgress

    def node(name: str) -> Engine:
        cfg = replace(Config(), agent=AgentConfig(hostname=name),
                      fallback=FallbackConfig(shared_dir=str(tmp_path / "shared")),
                      ras=RasConfig(enabled="off", watch_interval_s=0.2))
        return Engine(cfg, backend=None, fallback=FallbackStore(tmp_path / name), pool=None,  # type: ignore[arg-type]
                      health=LoopHealth.for_interval(1.0))

    watcher, other = node("n0"), node("n1")
    seen: list[CommProgress] = []
    try:
        watcher._share_comm([CommProgress("j", time.time(), "frozen_unequal", (3,), "NCCL RAS at x")],
                            jobs(rank=0, j=RUNNING))
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            other._share_comm([], jobs(rank=1, j=RUNNING))
            time.sleep(0.05)
            seen += other._shared_comm()
        assert [(p.job_id, p.state, p.behind) for p in seen] == [("j", "frozen_unequal", (3,))]
        time.sleep(0.3)
        other._share_comm([], jobs(rank=1, j=RUNNING))
        time.sleep(0.2)
        assert other._shared_comm() == []  # handed to the detector once
    finally:
        watcher.close()
        other.close()


def _ras_watch(e: Engine) -> RasWatch:
    return next(w for w in e.watches if isinstance(w, RasWatch))
