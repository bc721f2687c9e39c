"""The zoo's shared plumbing (zoo_common, data_service): faults fire only in the runs asked for, events are
written where the rows read them, the slow data service trickles and the stalling one never answers."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import pytest
from zoo_runs import ZOO, data_service

sys.path.insert(0, str(ZOO))
import zoo_common as zc  # noqa: E402  (beside the programs, as they import it)


def _args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    base = {"variant": "healthy", "rank": 2, "hang_step": 4, "hang_runs": 1, "pause_s": 1.0, "workdir": str(tmp_path),
            "events": str(tmp_path / "events.jsonl"), "data_addr": ""}
    return argparse.Namespace(**{**base, **kw})


def test_a_fault_fires_only_in_the_runs_asked_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = _args(tmp_path, hang_runs=2)
    for run, armed in (("0", True), ("1", True), ("2", False)):
        monkeypatch.setenv("GPU_WATCHDOG_RESTART_COUNT", run)
        assert zc.fault_armed(args) is armed


def test_events_carry_the_rank_and_the_onset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.delenv("GPU_WATCHDOG_RESTART_COUNT", raising=False)
    args = _args(tmp_path, variant="subprocess_wait", rank=1)  # a fault aimed at another rank: nothing here
    zc.slow_phase(args, 4, 2)
    zc.slow_phase(args, 3, 1)  # not the hang step
    zc.event(args, "hang_onset", step=4)
    (ev,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev["rank"] == 2 and ev["event"] == "hang_onset" and ev["step"] == 4 and ev["t"] <= time.time()


def test_the_slow_service_trickles_and_the_stalling_one_never_answers(tmp_path: Path) -> None:
    with data_service(every_s=0.2, chunks=3) as addr:
        t0 = time.monotonic()
        assert zc.read_shard(_args(tmp_path, data_addr=addr), "slow") == b"x" * 3072
        assert time.monotonic() - t0 >= 0.6
        host, port = addr.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"stall 0\n")
            s.settimeout(1.0)
            with pytest.raises(socket.timeout):
                s.recv(1)
