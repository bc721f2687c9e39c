"""gpu_watchdog.evidence.stacks.dump against real processes and the real py-spy; failure modes are real conditions
(a pid that exited, a py-spy that hangs, a py-spy that prints py-spy's own permission error)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from gpu_watchdog.evidence.stacks.dump import PERMISSION_HINT, dump_stacks, find_py_spy, main_dump_stacks
from waiting import wait_blocked

# py-spy 0.4.3's real messages (captured on this machine, RUST_BACKTRACE=1).
ROOT_DENIED = """Error: Failed to get process executable name. Check that the process is running.

Caused by:
    0: Permission denied (os error 13)
    1: Permission denied (os error 13)

Stack backtrace:
   0: <E as anyhow::context::ext::StdError>::ext_context
   1: py_spy::python_process_info::PythonProcessInfo::new
"""
USER_DENIED = "Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'\n"


def _spawn(code: str) -> subprocess.Popen[str]:
    """A Python child that prints 'ready' once it is about to block (py-spy needs a live interpreter)."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    wait_blocked(p.pid)  # in the blocking call after the print
    return p


def _kill(p: subprocess.Popen[str]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


@pytest.fixture
def sleeper() -> Iterator[int]:
    p = _spawn("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    try:
        yield p.pid
    finally:
        _kill(p)


def _exited_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_py_spy(tmp_path: Path, body: str) -> str:
    path = tmp_path / "py-spy"
    path.write_text(f"#!{sys.executable}\nimport os, sys, time, subprocess\n{textwrap.dedent(body)}")
    path.chmod(0o755)
    return str(path)


def test_find_py_spy() -> None:
    found = find_py_spy()
    assert found is not None and os.access(found, os.X_OK)
    assert find_py_spy("/nonexistent/dir/py-spy") is None  # an explicit choice never falls back
    assert find_py_spy(found) == found


def test_dump_real_process(sleeper: int) -> None:
    (r,) = dump_stacks([sleeper])
    assert r.outcome == "ok", r.raw
    assert r.pid == sleeper and r.ok and 0 < r.elapsed_s < 5
    # Without `import threading` py-spy knows no thread names: the main thread is the one whose
    # os_thread_id is the pid.
    main = [t for t in r.threads if t["os_thread_id"] == sleeper]
    assert main and main[0]["thread_name"] is None
    # time.sleep is C code: py-spy shows only the calling Python frame, idle.
    assert [f["name"] for f in main[0]["frames"]] == ["<module>"]
    assert main[0]["active"] is False
    assert main[0].get("wchan", "").endswith("nanosleep")  # our additions, read from /proc
    assert main[0].get("kstate") == "S"


def test_a_dumps_own_cost_to_the_agent_is_measured_apart_from_py_spys(sleeper: int) -> None:
    """The agent's reads around a dump (every thread's wait channel, state, counters) and its parsing are CPU of the
    agent's own thread, which the straggler budget counts beside py-spy's (a child's, not in this figure)."""
    (r,) = dump_stacks([sleeper])
    assert r.ok and 0 < r.agent_cpu_s < r.elapsed_s, r
    (gone,) = dump_stacks([_exited_pid()])
    assert gone.outcome == "exited" and gone.agent_cpu_s >= 0, gone


def test_native_dump_shows_c_frames(sleeper: int) -> None:
    (r,) = dump_stacks([sleeper], native=True, timeout_s=20)
    assert r.ok, r.raw
    names = [f["name"] for t in r.threads for f in t["frames"]]
    assert "time_sleep" in names or "clock_nanosleep" in names


def test_results_keep_input_order_and_report_exited(sleeper: int) -> None:
    gone = _exited_pid()
    res = dump_stacks([gone, sleeper, gone], concurrency=2)
    assert [r.pid for r in res] == [gone, sleeper, gone]
    assert [r.outcome for r in res] == ["exited", "ok", "exited"]
    assert "not running" in res[0].detail
    assert "Check that the process is running" in res[0].raw  # py-spy's own words are kept


def test_py_spy_missing(sleeper: int) -> None:
    res = dump_stacks([sleeper, 1], py_spy="/nonexistent/dir/py-spy")
    assert [r.outcome for r in res] == ["py_spy_missing", "py_spy_missing"]
    assert "/nonexistent/dir/py-spy" in res[0].detail


def test_invalid_pid() -> None:
    (r,) = dump_stacks([0])
    assert r.outcome == "error" and "invalid pid" in r.detail


def test_not_a_python_process() -> None:
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        wait_blocked(p.pid)  # exec'd into sleep (before, it is still the forked Python)
        (r,) = dump_stacks([p.pid])
        assert r.outcome == "error"
        assert "not a Python process" in r.detail
    finally:
        p.kill()
        p.wait()


def test_timeout_kills_py_spy_and_its_children(tmp_path: Path, sleeper: int) -> None:
    marker = tmp_path / "pids"
    fake = _fake_py_spy(tmp_path, f"""
        child = subprocess.Popen(["sleep", "60"])
        open({str(marker)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(60)
    """)
    t0 = time.monotonic()
    (r,) = dump_stacks([sleeper], timeout_s=3.0, py_spy=fake)  # time for the fake to start its child
    assert r.outcome == "timeout", r
    assert time.monotonic() - t0 < 10
    assert "3 s" in r.detail and "killed" in r.detail
    fake_pid, grandchild = (int(x) for x in marker.read_text().split())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (_alive(fake_pid) or _alive(grandchild)):
        time.sleep(0.02)
    assert not _alive(fake_pid) and not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_timeout_against_real_process_leaves_it_running(sleeper: int) -> None:
    (r,) = dump_stacks([sleeper], timeout_s=0.001)
    assert r.outcome == "timeout"
    time.sleep(0.2)
    # py-spy was killed mid-attach; the target must not stay stopped or traced.
    assert psutil.Process(sleeper).status() == psutil.STATUS_SLEEPING
    assert dump_stacks([sleeper])[0].ok


def test_py_spy_killed_from_outside_is_an_error_outcome(tmp_path: Path, sleeper: int) -> None:
    """The OOM killer or an admin kills py-spy mid-dump: one failed outcome naming the signal; the target runs on
    and the next dump works."""
    fake = _fake_py_spy(tmp_path, "import signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    (r,) = dump_stacks([sleeper], py_spy=fake)
    assert (r.outcome, r.detail) == ("error", "py-spy was killed by SIGKILL during the dump"), r
    assert psutil.Process(sleeper).status() == psutil.STATUS_SLEEPING
    assert dump_stacks([sleeper])[0].ok


@pytest.mark.parametrize("text", [ROOT_DENIED, USER_DENIED], ids=["as-root", "as-user"])
def test_permission_denied(tmp_path: Path, sleeper: int, text: str) -> None:
    fake = _fake_py_spy(tmp_path, f"sys.stderr.write({text!r})\nsys.exit(1)\n")
    (r,) = dump_stacks([sleeper], py_spy=fake)
    assert r.outcome == "permission_denied", r
    assert "CAP_SYS_PTRACE" in r.detail and "ptrace_scope=0" in r.detail and "root" in r.detail
    assert PERMISSION_HINT in r.detail and "\n" not in r.detail
    assert text.splitlines()[0] in r.raw


def test_permission_denied_real_when_pid1_is_protected() -> None:
    # In some sandboxes (Firecracker here) even root may not read pid 1: a real denial.
    try:
        os.readlink("/proc/1/exe")
    except PermissionError:
        pass
    else:
        pytest.skip("pid 1 is readable here")
    (r,) = dump_stacks([1])
    assert r.outcome == "permission_denied", r.raw
    assert "CAP_SYS_PTRACE" in r.detail


def test_main_dump_stacks_text_json_and_exit_codes(sleeper: int) -> None:
    out = io.StringIO()
    assert main_dump_stacks([sleeper], native=False, as_json=False, timeout_s=5, out=out) == 0
    text = out.getvalue()
    assert text.startswith(f"pid {sleeper}: ok (")
    assert ": sleep idle" in text
    assert "    <module> (<string>:3)" in text

    gone = _exited_pid()
    out = io.StringIO()
    assert main_dump_stacks([sleeper, gone], native=False, as_json=True, timeout_s=5, out=out) == 1
    doc = json.loads(out.getvalue())
    assert [d["pid"] for d in doc] == [sleeper, gone]
    assert set(doc[0]) == {"pid", "outcome", "detail", "elapsed_s", "threads"}
    assert doc[0]["outcome"] == "ok" and doc[0]["threads"]
    assert doc[1]["outcome"] == "exited" and doc[1]["threads"] == []

    out = io.StringIO()
    assert main_dump_stacks([sleeper], native=False, as_json=False, timeout_s=5, out=out,
                            py_spy="/nonexistent/py-spy") == 69
    assert "py_spy_missing" in out.getvalue()
