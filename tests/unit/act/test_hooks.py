"""Restart hooks: placeholder values, no argv injection, timeouts, failures, output capture (the templates' own
checks are config validation: tests/unit/config/test_config.py)."""

from __future__ import annotations

import sys
import time

import pytest
from gpu_watchdog.act.hooks import run_hook
from gpu_watchdog.config.schema import HookSpec
from gpu_watchdog.errors import UsageError
from gpu_watchdog.policy.hook_values import placeholder_values, render_argv


@pytest.mark.parametrize("job_id", ["a b", "a;rm -rf /", "../x", "a/b", "-rf", "x\n--all", "", "a\x00b",
                                    "$(id)", "`id`"])
def test_placeholder_values_refuse_injection(job_id: str) -> None:
    with pytest.raises(UsageError):
        placeholder_values(job_id, "node1", 1, "inc-1")


def test_one_element_per_template_element() -> None:
    vals = placeholder_values("job.1", "node-1", 2, "20250101T000000-job.1-stall")
    argv = render_argv(("scontrol", "requeue", "{job_id}", "--comment=lvl{level}@{node}", "{incident}"), vals)
    assert argv == ("scontrol", "requeue", "job.1", "--comment=lvl2@node-1", "20250101T000000-job.1-stall")
    with pytest.raises(UsageError):
        placeholder_values("job", "node 1", 1, "")
    with pytest.raises(UsageError):
        placeholder_values("job", "node", -1, "")


def test_run_hook_records_exit_code_and_output() -> None:
    spec = HookSpec("h", "command", (sys.executable, "-c", "import sys; print('hi', sys.argv[1:]); sys.exit(3)",
                                     "{job_id}"), 10.0)
    res = run_hook(spec, placeholder_values("j1", "n", 0, "i"))
    assert res.exit_code == 3 and not res.ok and not res.timed_out
    assert "hi ['j1']" in res.output and "exit 3" in res.detail()


def test_run_hook_timeout_kills_the_group() -> None:
    spec = HookSpec("h", "command", (sys.executable, "-c", "import subprocess,time; "
                                     "subprocess.Popen(['sleep','30']); time.sleep(30)"), 0.5)
    t0 = time.monotonic()
    res = run_hook(spec, placeholder_values("j1", "n", 0, "i"))
    assert res.timed_out and res.exit_code is None and time.monotonic() - t0 < 10
    assert "timed out" in res.detail()


def test_run_hook_missing_program() -> None:
    res = run_hook(HookSpec("h", "command", ("/nonexistent/prog",), 1.0), placeholder_values("j", "n", 0, ""))
    assert not res.ok and "cannot start" in res.detail()


def test_hook_environment_is_minimal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "x")
    spec = HookSpec("h", "command", (sys.executable, "-c", "import os; print(sorted(os.environ))"), 10.0)
    res = run_hook(spec, placeholder_values("j", "n", 0, ""))
    assert "SECRET_TOKEN" not in res.output and "GPU_WATCHDOG_JOB_ID" in res.output
