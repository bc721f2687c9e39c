"""``launch`` and the daemon (``run``) run the same engine: each behaviour here is one test run against both.

- the in-job client's step heartbeats reach the detector (they make ``max_no_progress_restarts`` work);
- a job that stays healthy for ``fallback.healthy_reset_s`` drops back to fallback level 0;
- a sampling failure skips the tick, marks the agent down (``gpu_watchdog_up`` 0, ``/healthz`` unhealthy) and
  the supervisor carries on; the next good sample brings it back.

Real processes and the real proc backend; the backend is wrapped only to fail on chosen ticks and to look at
what the previous tick produced. ``launch`` runs its real loop in this process (``Launcher.run``), the daemon
its real tick (what apscheduler calls), with the job registered as a prolog would.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.config.schema import AgentConfig, Config, DaemonSettings, FallbackConfig
from gpu_watchdog.daemon.registry import validate_pids_live
from gpu_watchdog.daemon.service import Daemon
from gpu_watchdog.export.metrics import AgentMetrics
from gpu_watchdog.export.sdnotify import Notifier
from gpu_watchdog.job.protocol import CONTROL_DIR_ENV
from gpu_watchdog.launch.launcher import Launcher
from gpu_watchdog.model import Registration
from gpu_watchdog.policy.ladder import FallbackDecision
from gpu_watchdog.sample.backends import choose_backend
from gpu_watchdog.sample.processes import JOB_ID_ENV
from gpu_watchdog.store.fallback_levels import FallbackStore
from in_process import ONE_RANK, one_rank_launch

JOB = "agree-job"

# A one-rank job: burns CPU (so it is "running"), writes a step heartbeat as the in-job client does every
# 0.2 s into the control directory its supervisor gave it, and exits 0 after ``seconds``.
JOB_CODE = textwrap.dedent("""
    import os, sys, time
    seconds = float(sys.argv[1])
    ctl = os.environ["GPU_WATCHDOG_CONTROL_DIR"]
    end = time.monotonic() + seconds
    step, next_beat = 0, 0.0
    while time.monotonic() < end:
        if time.monotonic() >= next_beat:
            step += 1
            tmp = os.path.join(ctl, ".step-0.tmp")
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, os.path.join(ctl, "step-0"))
            next_beat = time.monotonic() + 0.2
""")


@dataclass
class Seen:
    """What the supervisor showed between ticks, read by the backend wrapper at each call."""

    heartbeats: list[int] = field(default_factory=list)  # heartbeat steps of the job's rank, tick by tick
    up: list[tuple[int, float | None, tuple[bool, str]]] = field(default_factory=list)  # (call, up, health)


class WatchedBackend:
    """The real proc backend; fails on the calls in ``fail_at``; before each call, records what the supervisor
    made of the previous tick (its engine's last sample, gpu_watchdog_up, the loop's health)."""

    def __init__(self, inner: Any, fail_at: set[int], supervisor: Callable[[], Any], metrics: AgentMetrics,
                 seen: Seen) -> None:
        self.inner, self.fail_at, self.supervisor, self.metrics, self.seen = inner, fail_at, supervisor, metrics, seen
        self.name = inner.name
        self.scanner = inner.scanner  # launch points it at the job it started
        self.calls = 0

    def sample(self) -> Any:
        sup = self.supervisor()
        engine = sup.engine if sup is not None else None
        last = engine.last_sample if engine is not None else None
        if last is not None:
            steps = [p.heartbeat_step for p in last.processes if p.is_rank and p.job and p.job.job_id == JOB]
            self.seen.heartbeats.extend(s for s in steps if s is not None)
        if sup is not None and self.calls:
            self.seen.up.append((self.calls, self.metrics.registry.get_sample_value("gpu_watchdog_up"),
                                 sup.health.status()))
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError("NVML_ERROR_UNKNOWN (injected)")
        return self.inner.sample()

    def close(self) -> None:
        self.inner.close()


def _cfg(state: Path, **fallback: Any) -> Config:
    cfg = Config(agent=AgentConfig(interval_s=0.25, backend="proc", state_dir=str(state), hostname="n1"))
    return replace(cfg, fallback=replace(FallbackConfig(), **fallback)) if fallback else cfg


def _run_launch(cfg: Config, seconds: float, fail_at: set[int], seen: Seen) -> int:
    metrics = AgentMetrics(process_metrics=False)
    box: list[Launcher] = []
    inner, _ = choose_backend("proc", root_pid=os.getpid(), hostname="n1")
    backend = WatchedBackend(inner, fail_at, lambda: box[0] if box else None, metrics, seen)
    lc = Launcher(cfg, [sys.executable, "-c", JOB_CODE, str(seconds)], job_id=JOB, out=io.StringIO(),
                  metrics=metrics, backend=backend)
    box.append(lc)
    with one_rank_launch():
        return lc.run()


def _run_daemon(cfg: Config, seconds: float, fail_at: set[int], seen: Seen) -> int:
    metrics = AgentMetrics(process_metrics=False)
    box: list[Daemon] = []
    inner, _ = choose_backend("proc", root_pid=None, hostname="n1",
                              extra_pids=lambda: tuple(box[0].registry.owned_pids()) if box else ())
    backend = WatchedBackend(inner, fail_at, lambda: box[0] if box else None, metrics, seen)
    d = Daemon(cfg, DaemonSettings(socket_group="", control_socket=""), Path(cfg.agent.state_dir), backend=backend,
               metrics=metrics, notifier=Notifier(None))
    box.append(d)
    control = d.control_dir(JOB)  # what the job-start reply hands the job
    control.create()
    env = {**os.environ, JOB_ID_ENV: JOB, CONTROL_DIR_ENV: str(control.path), **ONE_RANK}
    job = subprocess.Popen([sys.executable, "-c", JOB_CODE, str(seconds)], env=env)
    try:
        d.register(Registration(JOB, validate_pids_live([job.pid]), registered_by_uid=os.getuid()))
        while job.poll() is None:
            d.tick()  # what apscheduler calls every agent.interval_s
            time.sleep(cfg.agent.interval_s)
        d.wait_idle()
        return job.returncode
    finally:
        job.kill()
        job.wait()


@pytest.fixture(params=["launch", "run"])
def supervise(request: pytest.FixtureRequest) -> Iterator[Callable[..., int]]:
    yield _run_launch if request.param == "launch" else _run_daemon


def test_step_heartbeats_reach_the_detector(supervise: Callable[..., int], tmp_path: Path) -> None:
    seen = Seen()
    rc = supervise(_cfg(tmp_path / "state"), 3.0, set(), seen)
    assert rc == 0
    assert len(set(seen.heartbeats)) >= 3 and seen.heartbeats == sorted(seen.heartbeats), seen.heartbeats


def test_a_healthy_job_drops_back_to_fallback_level_zero(supervise: Callable[..., int], tmp_path: Path) -> None:
    state = tmp_path / "state"
    FallbackStore(state).save(JOB, FallbackDecision(2, "no-ll128", {"NCCL_PROTO": "^LL128"}), {"NCCL_PROTO": "^LL128"})
    rc = supervise(_cfg(state, healthy_reset_s=1.0), 3.0, set(), Seen())
    assert rc == 0
    assert FallbackStore(state).load(JOB)["level"] == 0  # read back from disk by a new reader


def test_a_job_healthy_for_less_than_the_reset_time_keeps_its_level(supervise: Callable[..., int],
                                                                     tmp_path: Path) -> None:
    """The healthy counterpart: a job seen for less than healthy_reset_s keeps its level."""
    state = tmp_path / "state"
    FallbackStore(state).save(JOB, FallbackDecision(2, "no-ll128", {"NCCL_PROTO": "^LL128"}), {"NCCL_PROTO": "^LL128"})
    rc = supervise(_cfg(state, healthy_reset_s=600.0), 2.0, set(), Seen())
    assert rc == 0
    assert FallbackStore(state).load(JOB)["level"] == 2


def test_a_sampling_failure_marks_the_agent_down_and_the_supervisor_carries_on(supervise: Callable[..., int],
                                                                               tmp_path: Path) -> None:
    seen = Seen()
    rc = supervise(_cfg(tmp_path / "state"), 3.0, {3, 4, 5}, seen)
    assert rc == 0  # the job ran to its end under a supervisor that survived three failed samples
    by_call = {call: (up, health) for call, up, health in seen.up}
    for failed in (3, 4, 5):  # recorded at the next call: what the failed tick left behind
        up, (healthy, reason) = by_call[failed]
        assert up == 0.0 and not healthy and reason == "sampling failed: NVML_ERROR_UNKNOWN (injected)"
    up, (healthy, reason) = by_call[6]  # the next good sample
    assert up == 1.0 and healthy and reason == "ok"
    assert by_call[2][0] == 1.0  # and before the failures
