"""benchmarks/nccl_gpu.py without a GPU: its refusals are one line and exit 69, its judge and its NVML averages are
right. The benchmark itself needs a GPU (or ``--cpu-dry-run``, minutes of real jobs): none of that runs here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

BENCH = REPO / "benchmarks" / "nccl_gpu.py"
REAL_HANG_TRACE = REPO / "tests" / "data" / "real-gpu" / "nccl-hang" / "nvml.trace"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("nccl_gpu_bench", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def test_without_a_gpu_it_exits_69_with_one_line_fast() -> None:
    if _has_gpu():
        pytest.skip("a GPU is here: the benchmark would run")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NVML_STANDIN_STATE")}
    t0 = time.monotonic()
    cp = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120, env=env,
                        stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    assert cp.returncode == 69, cp.stdout + cp.stderr
    assert cp.stdout == ""
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nccl_gpu: needs a CUDA GPU"), cp.stderr
    assert took < 30, took  # NVML is asked first: no torch import, no job


def test_a_missing_prerequisite_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    mod = _bench()
    monkeypatch.setattr(mod, "find_py_spy", lambda: None)
    assert mod.main(["--cpu-dry-run", "--only", "own_code"]) == 69
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nccl_gpu: missing prerequisites: py-spy"), out.err


def test_all_rows_fit_the_device_budget() -> None:
    mod = _bench()
    assert sum(r.limit_s for r in mod.ROWS) <= mod.BUDGET_S <= 8 * 60
    assert {r.name for r in mod.ROWS} >= {"own_code", "sigstop", "desync", "transport", "slow_save", "big_allreduce"}


def _result(**over: Any) -> dict[str, Any]:
    inc = {"kind": "stall", "signature": "spin", "culprit_ranks": [1], "desync": False, "onset_to_confirmed_s": 7.5,
           "fallback": {"level": 0, "env": {}}}
    res = {"timed_out": False, "rc": 0, "limit_s": 85.0, "onset": 1000.0, "acting": 1, "incidents": [inc],
           "runs": 2, "run_env": {0: [], 1: ["NCCL_DEBUG=INFO"]}, "finished": True}
    for k, v in over.items():
        if k in inc:
            inc[k] = v
        else:
            res[k] = v
    return res


def test_judge_a_hang_row() -> None:
    mod = _bench()
    hang = mod.Expect(True, (1,))
    assert mod.judge(hang, _result()) == (True, [])
    assert not mod.judge(hang, _result(culprit_ranks=[0]))[0]
    assert not mod.judge(hang, _result(onset_to_confirmed_s=12.0))[0]  # later than the 10 s goal
    assert not mod.judge(hang, _result(acting=2))[0]
    assert not mod.judge(hang, _result(runs=1, finished=False))[0]
    ok, why = mod.judge(mod.Expect(True, (), level=1), _result(culprit_ranks=[], fallback={"level": 1}))
    assert not ok and why == ["the second run did not get the fallback's NCCL setting"]
    assert mod.judge(mod.Expect(True, (), level=1), _result(
        culprit_ranks=[], fallback={"level": 1}, run_env={0: [], 1: ["NCCL_NVLS_ENABLE=0", "NCCL_P2P_DISABLE=1"]}))[0]
    ok, why = mod.judge(hang, _result(timed_out=True, rc=None))
    assert not ok and why[0].startswith("not finished within its limit")


def test_judge_a_healthy_row() -> None:
    mod = _bench()
    healthy = mod.Expect(False)
    assert mod.judge(healthy, _result(acting=0, incidents=[], runs=1)) == (True, [])
    assert not mod.judge(healthy, _result(acting=1, runs=2))[0]  # a healthy twin that was interrupted
    assert not mod.judge(healthy, _result(acting=0, incidents=[], runs=1, rc=1))[0]


def test_nvml_figures_from_the_h200_hang_capture() -> None:
    """The real trace of shared/real-gpu/nccl-hang (one H200, two NCCL ranks waiting): 100 % busy at 17 % power."""
    mod = _bench()
    f = mod.trace_figures(Path(REAL_HANG_TRACE), None, None)
    assert f is not None and f["ticks"] >= 20 and f["gpu"] == "NVIDIA H200"
    assert f["util_percent"] == pytest.approx(100.0, abs=0.5)
    assert 110 < f["power_w"] < 125 and f["power_limit_w"] == 700.0
    assert f["mem_util_percent"] is None  # a version-1 trace: the memory controller was not sampled yet
    t0 = 1795670259.7738557
    assert mod.trace_figures(Path(REAL_HANG_TRACE), t0 + 5, t0 + 10)["ticks"] < f["ticks"]
