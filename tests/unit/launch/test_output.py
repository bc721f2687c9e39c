"""launch's job output routing: torchrun's stop noise leaves the console for the job log, everything else stays."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from gpu_watchdog.launch.output import JobOutput, StopNoiseFilter

# What torchrun 2.13 writes to stderr when it gets SIGTERM (shortened), and its OMP banner.
BANNER = ["\n", "*****************************************\n",
          "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid ...\n",
          "*****************************************\n"]
STOP = ["W1123 16:37:00.804000 27695 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, "
        "shutting down workers\n",
        "W1123 16:37:00.805000 27695 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 28038 "
        "closing signal SIGTERM\n",
        "Traceback (most recent call last):\n",
        '  File "<frozen runpy>", line 198, in _run_module_as_main\n',
        '  File "/v/torch/distributed/run.py", line 1032, in <module>\n',
        "    main()\n",
        "           ^^^^^^^^^^^^^^^^^^\n",
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 27695 got signal: 15\n"]
PREFIXED_BANNER = [f"W1123 16:58:32.174000 19060 torch/distributed/run.py:874] {ln}" for ln in BANNER]  # no tty
CRASH = ["Traceback (most recent call last):\n", '  File "train.py", line 3, in <module>\n',
         "ZeroDivisionError: division by zero\n"]


def run_filter(lines: list[str]) -> tuple[list[str], list[str]]:
    notes: list[str] = []
    f = StopNoiseFilter(notes.append)
    shown = [ln for line in lines for ln in f.feed(line)] + f.flush()
    return shown, notes


def test_stop_noise_and_banner_are_summarised_in_one_line() -> None:
    shown, notes = run_filter(["[job] hello\n", *BANNER, *STOP, *PREFIXED_BANNER, "[job] bye\n"])
    assert shown == ["[job] hello\n", "[job] bye\n"]
    assert notes == ["torchrun stopped on signal 15 (its SignalException traceback is in the job log)"]


def test_any_other_traceback_and_output_reach_the_console_whole() -> None:
    lines = ["warming up\n", "\n", *CRASH, "after\n"]
    shown, notes = run_filter(lines)
    assert shown == lines and notes == []


def test_a_traceback_cut_off_by_the_end_of_output_is_shown() -> None:
    shown, _ = run_filter(CRASH[:2])
    assert shown == CRASH[:2]


def test_filtered_job_output_real_child(tmp_path: Path) -> None:
    """A real child writing torchrun's stop noise to stderr and its own output to stdout: the log holds all of
    stderr, the console none of the noise, and stdout is the job's own (not captured here)."""
    noise = "".join(BANNER + STOP + CRASH)
    script = f"import sys\nprint('out line', flush=True)\nsys.stderr.write({noise!r})\n"
    console, notes = io.StringIO(), []
    out = JobOutput("filtered", tmp_path / "logs" / "j.log", console=console, note=notes.append)
    child = subprocess.Popen([sys.executable, "-c", script], **out.popen_kwargs())
    out.attach(child)
    assert child.wait(30) == 0
    out.finish()
    log = (tmp_path / "logs" / "j.log").read_text()
    assert "SignalException" in log and "OMP_NUM_THREADS" in log and "closing signal" in log
    assert console.getvalue() == "".join(CRASH) and len(notes) == 1


def test_story_mode_shows_job_lines_only(tmp_path: Path) -> None:
    script = "import sys\nprint('[job] one', flush=True)\nsys.stderr.write('noise\\n')\nprint('other')\n"
    console = io.StringIO()
    out = JobOutput("story", tmp_path / "job.log", console=console)
    child = subprocess.Popen([sys.executable, "-c", script], **out.popen_kwargs())
    out.attach(child)
    assert child.wait(30) == 0
    out.finish()
    assert console.getvalue() == "[job] one\n"
    assert set((tmp_path / "job.log").read_text().splitlines()) == {"[job] one", "noise", "other"}


# What torchrun 2.13 writes when a rank exits 86 (the in-job client aborted a hung collective) and it SIGTERMs the
# other rank (shortened traceback; the report as printed).
CHILD_FAILED = [
    "W1124 21:40:14.785000 12384 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 12403 "
    "closing signal SIGTERM\n",
    "E1124 21:40:14.787000 12384 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 86) "
    "local_rank: 1 (pid: 12404) of binary: /v/bin/python3\n",
    "Traceback (most recent call last):\n",
    '  File "/v/bin/torchrun", line 6, in <module>\n',
    "    sys.exit(main())\n",
    '  File "/v/torch/distributed/launcher/api.py", line 383, in launch_agent\n',
    "    raise ChildFailedError(\n",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
    "============================================================\n",
    "train.py FAILED\n",
    "------------------------------------------------------------\n",
    "Failures:\n", "[1]:\n", "  time      : 2026-11-24_21:40:14\n", "  host      : localhost\n",
    "  rank      : 0 (local_rank: 0)\n", "  exitcode  : -15 (pid: 12403)  (SIGTERM)\n",
    "  error_file: <N/A>\n", "  traceback : Signal 15 (SIGTERM) received by PID 12403\n",
    "------------------------------------------------------------\n",
    "Root Cause (first observed failure):\n", "[0]:\n", "  time      : 2026-11-24_21:40:14\n",
    "  host      : localhost\n", "  rank      : 1 (local_rank: 1)\n", "  exitcode  : 86 (pid: 12404) \n",
    "  error_file: <N/A>\n",
    "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n",
    "============================================================\n"]


def test_torchruns_report_of_ranks_the_client_stopped_is_one_line() -> None:
    shown, notes = run_filter(["[job] saved\n", *CHILD_FAILED, "[job] after\n"])
    assert shown == ["[job] saved\n", "[job] after\n"]
    assert notes == ["rank(s) 1 stopped by the in-job client (exit 86); torchrun's ChildFailedError report is in "
                     "the job log"]


def test_a_child_failed_report_of_a_real_crash_is_shown_whole() -> None:
    crashed = [ln.replace("exitcode  : 86", "exitcode  : 3").replace("(exitcode: 86)", "(exitcode: 3)")
               for ln in CHILD_FAILED]
    shown, notes = run_filter(crashed)
    assert shown == crashed[1:] and notes == []  # all but torchrun's "Sending process … SIGTERM" stop noise
