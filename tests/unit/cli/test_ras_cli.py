"""``gpu-watchdog ras`` against the stand-in RAS server: text and ``--json``, exit 69 when nothing answers, one
line and exit 64 on a bad address."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gpu_watchdog.cli.main import main
from gpu_watchdog.errors import EXIT_UNAVAILABLE, EXIT_USAGE
from ras_standin import Comm, Missing, Rank, RasStandIn, report_json


def two_comms() -> str:
    """World (4 ranks): rank 3 missing and dead. DP group {0, 2}: its comm rank 1 (global 2) behind."""
    world = [Rank(r, pid=100 + r, cuda_dev=r, counts={"AllReduce": 40}) for r in range(3)]
    dp = [Rank(0, pid=100, counts={"AllGather": 8}), Rank(1, pid=102, cuda_dev=2, counts={"AllGather": 7})]
    return report_json([Comm(0x10, 4, world, [Missing(3, host="10.0.0.1", pid=103, dead=True)]),
                        Comm(0x20, 2, dp)], nccl_2289=True)


def test_text_names_communicators_missing_ranks_and_culprits(capsys: pytest.CaptureFixture[str]) -> None:
    with RasStandIn([two_comms()]) as s:
        assert main(["ras", "--addr", s.addr, "--timeout", "5"]) == 0
    out = capsys.readouterr().out
    assert "2 communicator(s)" in out
    assert "rank 3 (global 3) missing (unresponsive, dead) (pid 103 on 10.0.0.1)" in out
    assert "rank 1 (global 2) behind: AllGather -1 (pid 102 on 10.0.0.1)" in out
    assert out.rstrip().endswith("culprit_ranks: 2,3")


def test_json_keeps_culprit_ranks_and_the_communicators(capsys: pytest.CaptureFixture[str]) -> None:
    with RasStandIn([two_comms()]) as s:
        assert main(["ras", "--addr", s.addr, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["culprit_ranks"] == [2, 3] and data["healthy"] is False and data["nccl_version"] == "2.28.9"
    assert [c["hash"] for c in data["communicators"]] == ["0x10", "0x20"]
    assert data["communicators"][0]["missing_ranks"][0]["considered_dead"] is True
    assert data["communicators"][1]["behind"][0]["global_rank"] == 2


def test_healthy_job_says_nothing_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    ranks = [Rank(0, counts={"AllReduce": 3}), Rank(1, pid=101, counts={"AllReduce": 3})]
    healthy = report_json([Comm(0x10, 2, ranks)])
    with RasStandIn([healthy]) as s:
        assert main(["ras", "--addr", s.addr]) == 0
        assert main(["ras", "--addr", s.addr, "--json"]) == 0
    text, js = capsys.readouterr().out.split("{", 1)
    assert "nothing wrong" in text
    data = json.loads("{" + js)
    assert data["healthy"] is True and data["culprit_ranks"] == []


def test_text_only_server(capsys: pytest.CaptureFixture[str]) -> None:
    with RasStandIn(json=False) as s:
        assert main(["ras", "--addr", s.addr]) == 0
    out = capsys.readouterr().out
    assert "RAS text only" in out and "NCCL 2.26.2" in out and "DEAD: 1 job process" in out


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpu_watchdog", *args], capture_output=True, text=True, timeout=60)


def test_no_ras_socket_exits_69_with_one_line() -> None:
    with RasStandIn() as s:
        addr = s.addr
    r = _cli("ras", "--addr", addr, "--timeout", "2")
    assert r.returncode == EXIT_UNAVAILABLE and r.stdout == ""
    assert r.stderr.strip() == f"gpu-watchdog: no NCCL RAS socket answers at {addr}: Connection refused"


@pytest.mark.parametrize("bad", ["localhost", "host:99999", ":28028"])
def test_bad_addr_is_one_usage_line(bad: str) -> None:
    r = _cli("ras", "--addr", bad)
    assert r.returncode == EXIT_USAGE and len(r.stderr.strip().splitlines()) == 1
    assert "bad RAS address" in r.stderr and "Traceback" not in r.stderr


def test_bad_nccl_ras_addr_env_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("NCCL_RAS_ADDR", "nonsense")
    assert main(["ras"]) == EXIT_USAGE
    assert "bad RAS address 'nonsense'" in capsys.readouterr().err


def test_unreadable_report_exits_65_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with RasStandIn(['{"communicators": [}']) as s:
        assert main(["ras", "--addr", s.addr]) == 65
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu-watchdog: RAS report is not valid JSON") and "\n" not in err


def test_a_large_loss_stays_readable_in_text_and_complete_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    # An 80-rank job whose last 24 ranks are dead: 24 missing in the job-wide communicator, 16 shown.
    ranks = [Rank(r, host=f"10.0.0.{r // 8}", pid=100 + r, counts={"AllReduce": 5}) for r in range(56)]
    lost = [Missing(r, host=f"10.0.0.{r // 8}", pid=100 + r, dead=True) for r in range(56, 80)]
    with RasStandIn([report_json([Comm(0x1, 80, ranks, lost)])]) as s:
        assert main(["ras", "--addr", s.addr]) == 0
        assert main(["ras", "--addr", s.addr, "--json"]) == 0
    text, js = capsys.readouterr().out.split("{", 1)
    assert "... and 8 more (--json lists them all)" in text and text.count(" missing (") == 16
    assert json.loads("{" + js)["culprit_ranks"] == list(range(56, 80))
