"""torchrun's own report of its workers' ends (launch.output.TorchrunReader, launch.exits.TorchrunReport): the exit
codes a late agent loses when torchrun reaps the ranks first, read off the job's stderr."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path

from gpu_watchdog.launch.exits import TorchrunReport
from gpu_watchdog.launch.output import JobOutput, TorchrunReader

_TRACEBACK = ["Traceback (most recent call last):\n", '  File "/v/bin/torchrun", line 8, in <module>\n',
              "    sys.exit(main())\n", '  File "/v/torch/distributed/launcher/api.py", line 383, in launch_agent\n',
              "    raise ChildFailedError(\n",
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"]
# Captured from torchrun 2.13 (tests/jobs/train.py abort_at_exit, peers_exited_0): ranks 0, 1 and 3 had exited 0,
# then rank 2 died by SIGABRT; nothing was left to tear down.
TEARDOWN_ABORT = [
    "E1128 14:59:58.292000 3440 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) "
    "local_rank: 2 (pid: 3448) of binary: /work/main/.venv/bin/python3\n",
    *_TRACEBACK,
    "=====================================================\n", "/work/main/tests/jobs/train.py FAILED\n",
    "-----------------------------------------------------\n", "Failures:\n", "  <NO_OTHER_FAILURES>\n",
    "-----------------------------------------------------\n", "Root Cause (first observed failure):\n", "[0]:\n",
    "  time      : 2026-11-28_14:59:58\n", "  host      : localhost\n", "  rank      : 2 (local_rank: 2)\n",
    "  exitcode  : -6 (pid: 3448)  (SIGABRT)\n", "  error_file: <N/A>\n",
    "  traceback : Signal 6 (SIGABRT) received by PID 3448\n",
    "=====================================================\n"]


def _entry(i: int, rank: int, code: int, pid: int) -> list[str]:
    sig = f"  ({signal.Signals(-code).name})" if code < 0 else " "
    return [f"[{i}]:\n", "  time      : 2026-11-28_15:00:06\n", "  host      : localhost\n",
            f"  rank      : {rank} (local_rank: {rank})\n", f"  exitcode  : {code} (pid: {pid}){sig}\n",
            "  error_file: <N/A>\n", "  traceback : Signal received\n"]


def _report(root: tuple[int, int, int], others: list[tuple[int, int, int]], closing: list[int]) -> list[str]:
    """torchrun's output as errors/__init__.py formats it: closing signals, then the ChildFailedError report."""
    lines = [f"W1128 15:00:06.517000 3618 torch/distributed/elastic/multiprocessing/api.py:1029] Sending process {pid} "
             "closing signal SIGTERM\n" for pid in closing]
    lines += [*_TRACEBACK, "=" * 40 + "\n", "train.py FAILED\n", "-" * 40 + "\n", "Failures:\n"]
    for i, other in enumerate(others, 1):
        lines += _entry(i, *other)
    lines += [] if others else ["  <NO_OTHER_FAILURES>\n"]
    lines += ["-" * 40 + "\n", "Root Cause (first observed failure):\n", *_entry(0, *root), "=" * 40 + "\n"]
    return lines


def read(lines: list[str]) -> TorchrunReport | None:
    reader = TorchrunReader()
    for line in lines:
        reader.feed(line)
    return reader.report


def test_a_teardown_abort_after_the_peers_exited_0_lists_only_the_dead_rank() -> None:
    report = read(["[job] done\n", *TEARDOWN_ABORT])
    assert report == TorchrunReport({2: (-6, 3448)}, frozenset())
    assert report.status(2) == signal.SIGABRT  # waitpid form: killed by SIGABRT
    assert [report.status(r) for r in (0, 1, 3)] == [0, 0, 0]  # unlisted and not torn down: exit code 0


def test_a_crash_mid_training_lists_the_peers_torchrun_tore_down() -> None:
    """Rank 2 aborted at step 2; torchrun SIGTERMed the others: each is listed with -15, none proven exit 0."""
    lines = _report((2, -6, 12), [(0, -15, 10), (1, -15, 11), (3, -15, 13)], closing=[10, 11, 13])
    report = read(lines)
    assert report is not None and report.torn_down == {10, 11, 13}
    assert {r: report.status(r) for r in range(4)} == {0: signal.SIGTERM, 1: signal.SIGTERM, 2: signal.SIGABRT,
                                                       3: signal.SIGTERM}


def test_an_exception_and_an_exit_code_are_exit_statuses() -> None:
    report = read(_report((2, 3, 12), [(0, 1, 10)], closing=[10]))
    assert report is not None and report.status(2) == 3 << 8 and report.status(0) == 1 << 8


def test_a_worker_torn_down_but_not_listed_leaves_the_unlisted_ranks_unknown() -> None:
    """torchrun signalled pid 11, which then exited 0 (a SIGTERM handler): an unlisted rank may be that one."""
    report = read(_report((2, -6, 12), [], closing=[11]))
    assert report is not None and report.status(2) == signal.SIGABRT
    assert report.status(1) is None and report.status(0) is None


def test_a_report_cut_short_or_without_entries_is_no_report() -> None:
    assert read(TEARDOWN_ABORT[:-1]) is None  # the output ended before its last rule
    assert read(["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n", "=" * 40 + "\n",
                 "something else\n", "=" * 40 + "\n"]) is None
    assert read(["[job] no torchrun here\n", "Traceback (most recent call last):\n", "ValueError: x\n"]) is None


def test_the_report_is_read_off_a_real_childs_stderr_and_still_logged_and_shown(tmp_path: Path) -> None:
    script = f"import sys\nsys.stderr.write({''.join(TEARDOWN_ABORT)!r})\nsys.exit(1)\n"
    console: io.StringIO = io.StringIO()
    out = JobOutput("filtered", tmp_path / "j.log", console=console)
    assert out.torchrun_report is None  # no run yet
    child = subprocess.Popen([sys.executable, "-c", script], **out.popen_kwargs())
    out.attach(child)
    assert child.wait(30) == 1
    out.finish()
    assert out.torchrun_report == TorchrunReport({2: (-6, 3448)}, frozenset())
    assert "ChildFailedError" in (tmp_path / "j.log").read_text() and "SIGABRT" in console.getvalue()


def test_each_run_has_its_own_report_and_console_mode_has_none(tmp_path: Path) -> None:
    out = JobOutput("story", tmp_path / "j.log", console=io.StringIO())
    for script, expected in ((f"import sys\nsys.stderr.write({''.join(TEARDOWN_ABORT)!r})\n", {2: (-6, 3448)}),
                             ("print('[job] healthy')\n", None)):
        child = subprocess.Popen([sys.executable, "-c", script], **out.popen_kwargs())
        out.attach(child)
        child.wait(30)
        out.finish()
        assert (out.torchrun_report.failures if out.torchrun_report else None) == expected
    console = JobOutput("console")
    child = subprocess.Popen([sys.executable, "-c", "pass"], **console.popen_kwargs())
    console.attach(child)
    child.wait(30)
    assert console.torchrun_report is None  # not captured: the agent's own read is all there is
