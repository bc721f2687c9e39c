"""End to end with a real Prometheus: a real 4-rank gloo job hangs under ``gpu-watchdog launch``; Prometheus
scrapes the launcher's /metrics every second and must see the stall, the incident and the restart, and every
dashboard expression must return data for the run.

The job is the demo's (gpu_watchdog.demo.train): rank 1 waits in a P2P receive at step ``HANG_AT`` while the
others block in all_reduce; the restart with fallback level 1 (NCCL_P2P_DISABLE=1) runs through, so the
launcher exits 0 after exactly one incident and one restart.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import prom
import psutil
import pytest
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.demo.runner import demo_command, read_events

pytestmark = pytest.mark.slow

NPROC = 4
HANG_AT = 8
# Detection window: the detector confirms within confirm_after_s of the onset even without stack proof;
# 15 s more for a loaded 2-core machine and one scrape.
DETECTION_WINDOW_S = DetectConfig().confirm_after_s + 15.0
# Dashboard expressions that may be empty in this run: the proc backend reports no memory total or power,
# the job never waits on a few ranks (every rank blocks), and no GPU fault or sampling error happens.
OPTIONAL_HERE = {"gpu_watchdog_gpu_memory_total_bytes", "gpu_watchdog_gpu_memory_controller_utilization_ratio",
                 "gpu_watchdog_gpu_power_watts",
                 "gpu_watchdog_rank_waited_on", "gpu_watchdog_gpu_faults_total", "gpu_watchdog_nvml_errors_total",
                 "gpu_watchdog_process_errors_total",
                 "gpu_watchdog_rank_straggler",  # the "named now" panel shows only ranks named (== 1): none in a hang
                 # only while the job's own deadline governs a wait (a save, an eval): a hang has none
                 "gpu_watchdog_job_deadline_left_seconds", "gpu_watchdog_job_deadline_seconds"}


_events = read_events


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher and every descendant (the job runs in its own session, so not its group)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    for p in [*kids]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_prometheus_sees_stall_incident_and_restart(tmp_path: Path) -> None:
    prom.require("prometheus")
    port = prom.free_port()
    workdir, state = tmp_path / "job", tmp_path / "state"
    workdir.mkdir()
    config = tmp_path / "config.toml"
    config.write_text('[agent]\ninterval_s = 1.0\nbackend = "proc"\n')
    job = demo_command(workdir, nproc=NPROC, steps=40, hang_at=HANG_AT)
    argv = [sys.executable, "-m", "gpu_watchdog", "launch", "--metrics-addr", f"127.0.0.1:{port}",
            "--config", str(config), "--state-dir", str(state), "--job-id", "e2e", "--", *job]
    if shutil.which("timeout"):  # safety net for the launcher itself; _kill_tree gets the job
        argv = [shutil.which("timeout") or "timeout", "-s", "KILL", "400", *argv]
    log_path = tmp_path / "launcher.log"
    events = workdir / "events.jsonl"

    with prom.Prometheus(tmp_path, [f"127.0.0.1:{port}"], rule_files=[prom.ALERTS]) as p:
        t_start = time.time()
        with open(log_path, "wb") as log:
            launcher = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})

        def tail() -> str:
            return log_path.read_text(errors="replace")[-4000:]

        try:
            p.wait_for("gpu_watchdog_up == 1", timeout=60)
            p.wait_for('gpu_watchdog_job_state{job_id="e2e",state="running"} == 1', timeout=120)
            assert p.values('gpu_watchdog_incidents_total{kind="stall"}') and \
                all(v == 0 for v in p.values('gpu_watchdog_incidents_total{kind="stall"}').values())
            deadline = time.monotonic() + 120
            while not any(e.get("event") == "hang_onset" for e in _events(events)):
                assert launcher.poll() is None, tail()
                assert time.monotonic() < deadline, "the job never reached its hang\n" + tail()
                time.sleep(0.2)
            onset = min(e["t"] for e in _events(events) if e.get("event") == "hang_onset")

            p.wait_for('gpu_watchdog_job_stalled{job_id="e2e"} == 1',
                       timeout=max(1.0, onset + DETECTION_WINDOW_S - time.time()))
            seen_stalled = time.time()
            assert seen_stalled - onset <= DETECTION_WINDOW_S
            p.wait_for('increase(gpu_watchdog_incidents_total{kind="stall"}[10m]) > 0', timeout=30)
            p.wait_for('gpu_watchdog_restarts_total{job_id="e2e"} >= 1', timeout=180)
            # the stop came ~29 min before the job's own (gloo default) timeout: 4 ranks x ~1790 s
            p.wait_for('gpu_watchdog_gpu_seconds_saved_total > 4 * 1700', timeout=30)
            p.wait_for('gpu_watchdog_job_state{job_id="e2e",state="running"} == 1', timeout=120)
            seen_restart = time.time()
            rc = launcher.wait(timeout=240)
            assert rc == 0, tail()
            print(f"\ne2e: job_stalled=1 in Prometheus {seen_stalled - onset:.1f} s after the hang onset; "
                  f"restarts_total=1 seen {seen_restart - onset:.1f} s after it; launcher exit {rc}")
        finally:
            _kill_tree(launcher)
        t_end = time.time()

        # The restart counter went 0 → 1 while Prometheus watched (increase() works from the first scrape).
        restarts = p.query_range('gpu_watchdog_restarts_total{job_id="e2e"}', t_start, t_end)
        values = [float(v) for _, v in restarts[0]["values"]]
        assert values[0] == 0 and values[-1] == 1, values
        assert p.query(f'increase(gpu_watchdog_restarts_total{{job_id="e2e"}}[{int(t_end - t_start) + 60}s])'
                       f' > 0', at=t_end)
        stalled = p.query_range('gpu_watchdog_job_stalled{job_id="e2e"}', t_start, t_end)
        assert {float(v) for _, v in stalled[0]["values"]} == {0.0, 1.0}

        # Every dashboard expression returned data at some point of the run.
        d = prom.load_dashboard()
        variables = {v: ".*" for v in prom.dashboard_variables(d)}
        empty = []
        for where, expr in prom.dashboard_expressions(d):
            q = prom.substitute_grafana_vars(expr, variables)
            if not p.query_range(q, t_start, t_end) and not prom.promql_metric_names(q) <= OPTIONAL_HERE:
                empty.append(f"{where}: {q}")
        assert not empty, "no data in the run:\n" + "\n".join(empty) + "\n" + tail()
        # Every alert rule evaluated cleanly against the real run's series.
        rules = [r for g in p.api("rules")["groups"] for r in g["rules"]]
        assert rules and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

    _incident_trace_replays_and_plots(state, onset, tmp_path)


def _incident_trace_replays_and_plots(state: Path, onset: float, tmp_path: Path) -> None:
    """The launch incident of this real gloo hang carries the samples before its confirmation: ``replay`` of the
    incident directory finds the stall again, and ``--plot`` draws it."""
    (d,) = (state / "incidents").iterdir()
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "replay", str(d)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("stall ") and "job=e2e" in out.stdout, out
    summary = json.loads((d / "summary.json").read_text())
    replayed_onset = float(out.stdout.split("onset=")[1].split()[0])
    assert abs(replayed_onset - summary["onset"]) < 0.01 and summary["onset"] <= onset + 2.0
    if importlib.util.find_spec("matplotlib") is None:
        return  # the [plot] extra: tests/unit/export/test_plot.py covers the figure itself
    png = tmp_path / "incident.png"
    out = subprocess.run([sys.executable, "-m", "gpu_watchdog", "incidents", "show", d.name, "--state-dir",
                          str(state), "--plot", str(png)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"picture: {png}" in out.stdout, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_launcher_metrics_addr_in_use_is_one_line(tmp_path: Path) -> None:
    """``--metrics-addr`` on a taken port: one clear line and exit 69, before any job starts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "gpu_watchdog", "launch", "--metrics-addr", f"127.0.0.1:{port}",
                            "--state-dir", str(tmp_path), "--", sys.executable, "-c", "print('ran')"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 69, r.stderr
    assert "ran" not in r.stdout
    assert r.stderr.strip().count("\n") == 0 and "cannot listen" in r.stderr
