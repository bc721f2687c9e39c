"""``launch`` starts every job with the Flight Recorder on (``[flight_recorder]``): recording, dumps and NCCL's dump
pipe in the run's own directory under the state dir — unless the job's environment already says otherwise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from gpu_watchdog.config.schema import Config, FlightRecorderConfig
from gpu_watchdog.launch.launcher import Launcher

FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")


def run_env(tmp_path: Path, cfg: Config | None = None, attempt: int = 0) -> dict[str, str]:
    """The environment the launched job's process really gets (it writes it to a file)."""
    out = tmp_path / f"env-{attempt}"
    launcher = Launcher(cfg or Config(), ["/bin/sh", "-c", f"env -0 > {out}"], state_dir=tmp_path / "state",
                        job_id="fr-job")
    assert launcher._start(attempt, {}).wait(30) == 0
    pairs = (item.split("=", 1) for item in out.read_text().split("\0") if "=" in item)
    return dict(pairs)


@pytest.fixture(autouse=True)
def _no_fr_in_the_test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FR_VARS:
        monkeypatch.delenv(name, raising=False)


def test_every_run_records_and_exposes_the_dump_pipe_in_its_own_directory(tmp_path: Path) -> None:
    env = run_env(tmp_path)
    d = tmp_path / "state" / "run" / "fr-job" / "flight-recorder"
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{d}/rank-"
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == f"{d}/pipe-"
    assert d.is_dir()
    (d / "rank-0").write_bytes(b"the last run's dump")
    run_env(tmp_path, attempt=1)  # the next run starts with an empty directory
    assert list(d.iterdir()) == []


def test_the_users_own_settings_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "/mine/pipe_")
    env = run_env(tmp_path)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "100" and "TORCH_FR_BUFFER_SIZE" not in env
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == "/mine/pipe_"
    assert env["TORCH_FR_DUMP_TEMP_FILE"].endswith("/flight-recorder/rank-")  # what they left unset is added
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # recording turned off by the user: nothing added
    env = run_env(tmp_path)
    assert {k: env.get(k) for k in FR_VARS} == {
        "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "100", "TORCH_FR_DUMP_TEMP_FILE": None,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None, "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/mine/pipe_"}


def test_switched_off_in_the_config(tmp_path: Path) -> None:
    cfg = dataclasses.replace(Config(), flight_recorder=FlightRecorderConfig(enabled=False))
    env = run_env(tmp_path, cfg)
    assert not set(FR_VARS) & set(env)
    cfg = dataclasses.replace(Config(), flight_recorder=FlightRecorderConfig(buffer_size=50))
    assert run_env(tmp_path, cfg)["TORCH_FR_BUFFER_SIZE"] == "50"
