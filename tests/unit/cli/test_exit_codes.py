"""One source of truth for exit codes: README's table, ``errors.EXIT_CODES`` (what ``--help`` prints) and the
commands' real exits for the cases a new user hit; plus the CLI's other promises to people (``--json`` changes the
output, a closed pipe ends quietly, ``--help`` is for users)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_watchdog import errors
from gpu_watchdog.job.protocol import CLIENT_EXIT_CODES, EXIT_ABORTED, EXIT_CHECKPOINTED
from repo_paths import REPO

CLI = str(Path(sys.executable).with_name("gpu-watchdog"))


def gw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def readme_codes() -> set[int]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Exit codes"):]
    table = section[:section.index("\n## ")]
    codes: set[int] = set()
    for cell in re.findall(r"^\| ([^|]+?) \|", table, re.M):
        codes |= {int(c) for c in re.findall(r"\b\d+\b", cell) if "+" not in cell}
    return codes


def test_readme_table_help_and_errors_py_list_the_same_codes() -> None:
    constants = {v for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert constants == set(errors.EXIT_CODES), "every EXIT_* constant has a meaning in EXIT_CODES"
    assert readme_codes() == set(errors.EXIT_CODES) | {EXIT_CHECKPOINTED, EXIT_ABORTED}
    help_text = gw("--help").stdout
    for code, meaning in {**errors.EXIT_CODES, **CLIENT_EXIT_CODES}.items():  # 85/86 too
        assert re.search(rf"^\s+{code}\s+{re.escape(meaning)}$", help_text, re.M), (code, help_text)


def test_top_level_help_is_for_users() -> None:
    r = gw("--help")
    assert r.returncode == 0 and "Parsing and dispatch" not in r.stdout and "``" not in r.stdout
    assert "gpu-watchdog demo" in r.stdout


def write_incident(state: Path, iid: str, report: bool) -> None:
    d = state / "incidents" / iid
    (d / "stacks").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({
        "id": iid, "job_id": "j", "kind": "stall", "signature": "idle_held", "onset": 1.0, "detected_at": 6.0,
        "host": "h", "ranks": [0, 1], "culprit_ranks": [1], "collective": "all_reduce", "reason": "rank 1 in recv",
        "evidence": "stacks", "stacks_dir": str(d / "stacks"), "fallback": None, "advice": None,
        "actions": [{"action": "observe", "at": 6.0, "ok": True, "detail": "not registered", "outcome": "ok"},
                    {"action": "checkpoint", "at": 6.0, "ok": False, "detail": "skipped: no opt-in",
                     "outcome": "skipped"}]}))
    if report:
        (d / "report.txt").write_text("the report\n")


@pytest.mark.parametrize(("case", "argv", "code", "words"), [
    ("bad --metrics-addr on the command line", ["launch", "--metrics-addr", "bogus", "--", "true"],
     errors.EXIT_USAGE, "--metrics-addr: agent.metrics_addr must be HOST:PORT"),
    ("the daemon, the same", ["run", "--metrics-addr", "bogus"], errors.EXIT_USAGE, "--metrics-addr"),
    ("an unknown option", ["replay", "--nope", "x"], errors.EXIT_USAGE, "unrecognized arguments"),
    ("a missing incident", ["incidents", "show", "nope", "--state-dir", "{tmp}"], errors.EXIT_NOINPUT,
     "no incident 'nope'"),
    ("replay of a directory without a trace", ["replay", "{tmp}"], errors.EXIT_NOINPUT, "no trace in"),
    ("replay of a missing trace", ["replay", "{tmp}/none.jsonl"], errors.EXIT_NOINPUT, "trace not found"),
    ("a trace that is not one", ["replay", "{tmp}/bad.jsonl"], errors.EXIT_DATAERR, "not a gpu-watchdog trace"),
    ("bad config file content", ["config", "show", "--config", "{tmp}/bad.toml"], errors.EXIT_CONFIG,
     "agent.backend"),
    ("analyze of a directory without stacks", ["analyze", "{tmp}"], errors.EXIT_NOINPUT, ""),
    ("hook status with no daemon", ["hook", "status", "--socket", "{tmp}/none.sock"], errors.EXIT_UNAVAILABLE,
     "cannot reach the daemon"),
    ("a missing --config file", ["config", "show", "--config", "{tmp}/missing.toml"], errors.EXIT_NOINPUT,
     "file not found"),
    ("incidents of a mistyped state dir", ["incidents", "list", "--state-dir", "{tmp}/typo"], errors.EXIT_NOINPUT,
     "cannot read the state dir"),
    ("launch of a command that does not exist", ["launch", "--state-dir", "{tmp}/state", "--", "no-such-cmd-23"],
     errors.EXIT_USAGE, "cannot start 'no-such-cmd-23': not found"),
])
def test_real_exits(tmp_path: Path, case: str, argv: list[str], code: int, words: str) -> None:
    (tmp_path / "bad.jsonl").write_text("not json\n")
    (tmp_path / "bad.toml").write_text('[agent]\nbackend = "gpu"\n')
    r = gw(*[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert r.returncode == code, (case, r.returncode, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def test_launch_of_a_missing_command_prints_one_line_and_creates_nothing(tmp_path: Path) -> None:
    r = gw("launch", "--state-dir", str(tmp_path / "state"), "--", str(tmp_path / "no-such-cmd"))
    assert r.returncode == errors.EXIT_USAGE and r.stdout == "", r
    line = f"gpu-watchdog: error: cannot start '{tmp_path}/no-such-cmd': no such file"
    assert r.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "state").exists()  # no state dir, no job log


def test_a_taken_port_from_the_config_is_reported_under_its_key(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'[agent]\nmetrics_addr = "{addr}"\n')
        r = gw("launch", "--config", str(cfg), "--state-dir", str(tmp_path / "s"), "--", "true")
        assert r.returncode == errors.EXIT_UNAVAILABLE, r
        assert f"agent.metrics_addr in {cfg} {addr}: cannot listen" in r.stderr and "--metrics-addr" not in r.stderr
        r = gw("launch", "--metrics-addr", addr, "--state-dir", str(tmp_path / "s"), "--", "true")
        assert r.returncode == errors.EXIT_UNAVAILABLE and f"--metrics-addr {addr}: cannot listen" in r.stderr, r


def test_incidents_show_json_and_readable_report_without_report_txt(tmp_path: Path) -> None:
    write_incident(tmp_path, "i-observed", report=False)
    write_incident(tmp_path, "i-full", report=True)
    assert gw("incidents", "show", "i-full", "--state-dir", str(tmp_path)).stdout == "the report\n"
    assert json.loads(gw("incidents", "show", "i-full", "--state-dir", str(tmp_path), "--json").stdout)["id"] == \
        "i-full"
    text = gw("incidents", "show", "i-observed", "--state-dir", str(tmp_path)).stdout
    assert text.startswith("incident i-observed — stall (idle_held) in job j") and "culprit: rank 1" in text
    assert "checkpoint: skipped — skipped: no opt-in" in text and not text.lstrip().startswith("{")


def closed_pipe_run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run with a stdout whose reader is already gone (``… | head`` that exited)."""
    p = subprocess.Popen([CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read()
    return subprocess.CompletedProcess(argv, p.wait(60), "", err)


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    for i in range(300):  # more than a pipe buffer of JSON
        write_incident(tmp_path, f"i-{i:04d}", report=False)
    r = closed_pipe_run(["incidents", "--json", "--state-dir", str(tmp_path)])
    assert r.returncode == errors.EXIT_PIPE_CLOSED and r.stderr == "", r.stderr
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        r = closed_pipe_run(["dump-stacks", str(sleeper.pid), "--json"])
        assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
        assert r.returncode in (errors.EXIT_PIPE_CLOSED, errors.EXIT_FAILURE), r.returncode  # 1: py-spy refused here
    finally:
        sleeper.kill()
        sleeper.wait()
