"""The daemon's TaskProlog turns the Flight Recorder on for every task it registers (``[flight_recorder]``): the
job-start reply names the run's directory (made by the daemon, owned by the job's user), and ``hook job-start
--export`` — which runs with the job's own environment — exports only what that environment leaves unset."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_helpers import GW
from gpu_watchdog.cli.daemon import _task_prolog_exports
from gpu_watchdog.config.schema import Config, DaemonSettings, FlightRecorderConfig
from gpu_watchdog.daemon.control import PeerCred, handle_request
from gpu_watchdog.daemon.service import Daemon
from gpu_watchdog.export.sdnotify import Notifier
from repo_paths import REPO
from waiting import wait_for

ROOT = PeerCred(1, 0, 0)
FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")


@pytest.fixture(autouse=True)
def _no_fr_in_the_test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FR_VARS:
        monkeypatch.delenv(name, raising=False)


def daemon(base: Path, fr: FlightRecorderConfig | None = None) -> Daemon:
    cfg = Config(daemon=DaemonSettings(control_socket=str(base / "c.sock"), socket_group=""),
                 flight_recorder=fr or FlightRecorderConfig())
    return Daemon(cfg, cfg.daemon, base / "state", notifier=Notifier(None))


def exports(reply: dict) -> dict[str, str]:
    return dict(line[len("export "):].split("=", 1) for line in _task_prolog_exports(reply).splitlines()
                if line.startswith("export "))


def test_the_job_start_reply_names_the_runs_flight_recorder_directory(base: Path) -> None:
    d = daemon(base)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r0 = handle_request(d, {"op": "job-start", "job_id": "77", "pids": [sleeper.pid], "run": 0}, ROOT)
        fr_dir = Path(r0["control_dir"]) / "flight-recorder"
        assert r0["flight_recorder"] == {"buffer_size": 2000, "dir": str(fr_dir)} and fr_dir.is_dir()
        (fr_dir / "rank-0").write_bytes(b"run 0's dump")
        r1 = handle_request(d, {"op": "job-start", "job_id": "77", "pids": [sleeper.pid], "run": 1}, ROOT)
        assert r1["flight_recorder"]["dir"].endswith("/run/77/run-1/flight-recorder")  # per run
        off = daemon(base / "off", FlightRecorderConfig(enabled=False))
        assert "flight_recorder" not in handle_request(off, {"op": "job-start", "job_id": "78",
                                                             "pids": [sleeper.pid]}, ROOT)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_export_adds_only_what_the_jobs_environment_leaves_unset(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    reply = {"ok": True, "control_dir": str(tmp_path), "level": 0, "env": {},
             "flight_recorder": {"buffer_size": 2000, "dir": str(tmp_path)}}
    got = exports(reply)
    assert {k: got[k] for k in FR_VARS} == {
        "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/rank-", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{tmp_path}/rank-",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/pipe-"}
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # the job's own (sbatch --export, its shell)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/home/me/fr_")
    got = exports(reply)
    assert set(got) & set(FR_VARS) == {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE"}  # a TaskProlog export would override
    restarted = {**reply, "env": {"TORCH_FR_DUMP_TEMP_FILE": "/inc/flight-recorder/rank-"}}  # diagnostics_env
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    got = exports(restarted)
    assert got["TORCH_FR_DUMP_TEMP_FILE"] == "/inc/flight-recorder/rank-"
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in got
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")  # the job turned recording off
    assert not set(exports(reply)) & set(FR_VARS)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE")
    assert not set(exports({**reply, "flight_recorder": None})) & set(FR_VARS)  # an older daemon, or switched off
    gone = exports({**reply, "flight_recorder": {"buffer_size": 2000, "dir": str(tmp_path / "gone")}})
    assert "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" not in gone and gone["TORCH_FR_BUFFER_SIZE"] == "2000"


def test_the_shipped_task_prolog_exports_the_flight_recorder_settings(base: Path) -> None:
    (base / "c.toml").write_text(f'[agent]\nbackend = "proc"\nstate_dir = "{base / "state"}"\n'
                                 f'[daemon]\ncontrol_socket = "{base / "c.sock"}"\nsocket_group = ""\n'
                                 '[hooks.slurm-requeue]\ntype = "slurm-requeue"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    env.update({"SLURM_JOB_ID": "4712", "SLURM_RESTART_COUNT": "0", "GPU_WATCHDOG": GW,
                "GPU_WATCHDOG_SOCKET": str(base / "c.sock"), "TORCH_NCCL_TRACE_BUFFER_SIZE": "300"})
    task = [sys.executable, "-c", "import subprocess, sys; r = subprocess.run([sys.argv[1]], capture_output=True, "
            "text=True); print(r.stdout, end='', flush=True); import time; time.sleep(30)",
            str(REPO / "scheduler/slurm/task_prolog.sh")]
    d = subprocess.Popen([GW, "run", "--config", str(base / "c.toml")], stderr=subprocess.DEVNULL)
    try:
        wait_for((base / "c.sock").exists, 20, "the daemon's control socket")
        t = subprocess.Popen(task, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert t.stdout is not None
            lines = [t.stdout.readline().strip() for _ in range(5)]  # sorted: 2 GPU_WATCHDOG_*, then 3 TORCH_*
        finally:
            t.kill()
            t.wait()
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(15)
    fr_dir = base / "state" / "run" / "4712" / "run-0" / "flight-recorder"
    assert lines[2:] == [f"export TORCH_FR_DUMP_TEMP_FILE={fr_dir}/rank-",
                         f"export TORCH_NCCL_DEBUG_INFO_PIPE_FILE={fr_dir}/pipe-",
                         f"export TORCH_NCCL_DEBUG_INFO_TEMP_FILE={fr_dir}/rank-"], lines  # the job's buffer kept
    assert fr_dir.is_dir()


def test_config_switch_round_trips() -> None:
    cfg = dataclasses.replace(Config(), flight_recorder=FlightRecorderConfig(enabled=False))
    assert not cfg.flight_recorder.enabled and Config().flight_recorder.buffer_size == 2000
