"""A bug inside the agent never leaves its job unsupervised (issue: the supervisor never abandons a job).

- a malformed sample (a backend bug) makes the tick raise: the tick is skipped, counted in
  ``gpu_watchdog_internal_errors_total{stage="tick"}``, and the supervisor carries on;
- a recovery that raises: ``launch`` stops the job with the stop ladder and exits 70; the daemon logs it, counts
  it (``stage="act"``), closes the incident as failed and keeps ticking.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
from gpu_watchdog.act.gather import EvidenceGatherer
from gpu_watchdog.config.schema import AgentConfig, Config, DaemonSettings, DetectConfig, StacksConfig
from gpu_watchdog.daemon.registry import validate_pids_live
from gpu_watchdog.daemon.service import Daemon
from gpu_watchdog.errors import EXIT_SOFTWARE
from gpu_watchdog.export.metrics import AgentMetrics
from gpu_watchdog.export.sdnotify import Notifier
from gpu_watchdog.launch.launcher import Launcher
from gpu_watchdog.model import Registration
from gpu_watchdog.sample.backends import choose_backend
from gpu_watchdog.sample.processes import JOB_ID_ENV
from in_process import ONE_RANK, one_rank_launch
from waiting import wait_for

JOB = "bug-job"
# A one-rank job that sleeps with memory held: idle, so it stalls at once (no heartbeats, no CPU).
SLEEPER = "import time; x = bytearray(32 << 20); time.sleep(120)"


def _cfg(state: Path) -> Config:
    return Config(agent=AgentConfig(interval_s=0.25, backend="proc", state_dir=str(state), hostname="n1"),
                  detect=replace(DetectConfig(), suspect_after_s=0.5, confirm_after_s=1.5, clear_after_s=1.0),
                  stacks=StacksConfig(enabled=False))


class Malformed:
    """The real proc backend, except that call ``bad`` returns a sample with a process that is not one."""

    def __init__(self, inner: Any, bad: int) -> None:
        self.inner, self.bad, self.calls = inner, bad, 0
        self.name, self.scanner = inner.name, inner.scanner

    def sample(self) -> Any:
        self.calls += 1
        s = self.inner.sample()
        return replace(s, processes=(*s.processes, None)) if self.calls == self.bad else s

    def close(self) -> None:
        self.inner.close()


def _internal(metrics: AgentMetrics, stage: str) -> float | None:
    return metrics.registry.get_sample_value("gpu_watchdog_internal_errors_total", {"stage": stage})


@pytest.fixture
def rank_env() -> Iterator[None]:
    with one_rank_launch():
        yield


def test_launch_skips_a_tick_that_raises_and_carries_on(tmp_path: Path, rank_env: None) -> None:
    metrics = AgentMetrics(process_metrics=False)
    inner, _ = choose_backend("proc", root_pid=os.getpid(), hostname="n1")
    lc = Launcher(_cfg(tmp_path / "state"), [sys.executable, "-c", "import time; time.sleep(2)"], job_id=JOB,
                  out=io.StringIO(), metrics=metrics, backend=Malformed(inner, bad=3))
    assert lc.run() == 0  # the job ran to its end
    assert _internal(metrics, "tick") == 1.0


def test_launch_stops_its_job_and_exits_70_when_recovery_raises(tmp_path: Path, rank_env: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("injected bug in evidence gathering")

    monkeypatch.setattr(EvidenceGatherer, "gather", broken)
    metrics = AgentMetrics(process_metrics=False)
    out = io.StringIO()
    inner, _ = choose_backend("proc", root_pid=os.getpid(), hostname="n1")
    lc = Launcher(_cfg(tmp_path / "state"), [sys.executable, "-c", SLEEPER], job_id=JOB, out=out, metrics=metrics,
                  backend=inner)
    t0 = time.monotonic()
    assert lc.run() == EXIT_SOFTWARE == 70, out.getvalue()
    assert time.monotonic() - t0 < 60
    text = out.getvalue()
    assert "internal error (RuntimeError: injected bug in evidence gathering)" in text
    assert "Traceback" not in text and "stopped the job" in text
    assert _internal(metrics, "act") == 1.0
    [inc] = lc.incidents.list()  # the incident says what happened
    assert inc["outcome"].startswith("failed: injected bug") and inc["actions"][-1]["action"] == "recovery"
    left = [p for p in psutil.process_iter(["cmdline"]) if SLEEPER in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_the_daemon_counts_a_recovery_that_raises_and_keeps_ticking(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("injected bug in evidence gathering")

    monkeypatch.setattr(EvidenceGatherer, "gather", broken)
    metrics = AgentMetrics(process_metrics=False)
    box: list[Daemon] = []
    inner, _ = choose_backend("proc", root_pid=None, hostname="n1",
                              extra_pids=lambda: tuple(box[0].registry.owned_pids()) if box else ())
    cfg = _cfg(tmp_path / "state")
    d = Daemon(cfg, DaemonSettings(socket_group="", control_socket=""), tmp_path / "state",
               backend=Malformed(inner, bad=2), metrics=metrics, notifier=Notifier(None))
    box.append(d)
    env = {**os.environ, JOB_ID_ENV: JOB, **ONE_RANK}
    job = subprocess.Popen([sys.executable, "-c", SLEEPER], env=env)
    try:
        d.register(Registration(JOB, validate_pids_live([job.pid]), registered_by_uid=os.getuid()))

        def failed_incident() -> bool:
            d.tick()
            time.sleep(cfg.agent.interval_s)
            d.wait_idle()
            return any(str(i.get("outcome", "")).startswith("failed:") for i in d.incidents.list())

        wait_for(failed_incident, 60, "the failed recovery's incident")
        assert _internal(metrics, "tick") == 1.0 and (_internal(metrics, "act") or 0) >= 1.0
        ok_before = d.ticks_ok
        d.tick()
        assert d.ticks_ok == ok_before + 1  # ticking on
    finally:
        job.kill()
        job.wait()
