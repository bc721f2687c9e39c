"""Where a launched job's output goes: the console, a job log, or both.

Three modes:

* ``console``: the job inherits launch's stdout and stderr, untouched (``launch -v``, and ``Launcher``'s default).
* ``filtered`` (``launch``'s default): stdout is the job's own output and stays on the console, untouched.
  stderr goes to the job log whole, and to the console without what a deliberate stop makes torchrun print
  (its ``SignalException`` traceback, "Received 15 death signal", "Sending process N closing signal") and
  without torchrun's ``OMP_NUM_THREADS`` banner: a stop by the watchdog is expected, not a crash, so the console
  gets one line saying so and where the traceback is. The same for the ``ChildFailedError`` traceback and report
  torchrun prints when the in-job client stopped its ranks (exit 85/86; the peers torchrun then SIGTERMed are
  listed with -15). Any other traceback reaches the console whole.
* ``story`` (the demo): stdout and stderr go to the job log; the console gets the job's ``[job]`` lines only.

A reader thread per run drains the job's pipe whatever happens to the console (a closed console must not block
the job on a full pipe), and reads torchrun's own report of its workers' ends off it (``TorchrunReader``: the exit
codes a crash's incident needs when torchrun reaped the ranks before the agent read them; not in ``console`` mode,
where the job's output is not captured).
"""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TextIO

from gpu_watchdog.atomic import note_write_error
from gpu_watchdog.launch.exits import TorchrunReport

MODES = ("console", "filtered", "story")
STORY_PREFIX = "[job]"

# torch's log lines carry a glog-style prefix when stderr is not a terminal: "W1123 16:58:32.174000 19060
# torch/distributed/run.py:874] "; what follows it is what is classified.
_TORCH_LOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] ?")
_BANNER = re.compile(r"^\*{10,}\s*$|^Setting OMP_NUM_THREADS environment variable for each process")
_STOP_NOISE = re.compile(r"Received \d+ death signal, shutting down workers"
                         r"|Sending process \d+ closing signal SIG[A-Z]+")
_SIGNAL_EXCEPTION = re.compile(r"SignalException: Process \d+ got signal: (\d+)")
_TRACEBACK = "Traceback (most recent call last):"
# What torchrun prints when ranks exit: a log line per failed rank, then a ChildFailedError traceback whose
# report (between two rules of '=') lists each failure's rank and exit code.
_CLIENT_EXITS = {85, 86}  # gpu_watchdog.job.protocol: the in-job client stopped the rank on purpose
_CHILD_FAILED_LOG = re.compile(r"failed \(exitcode: (8[56])\) local_rank: \d+ \(pid: \d+\) of binary")
_RULE = re.compile(r"^={20,}\s*$")
_FAILURE = re.compile(r"^\s*rank\s*: (\d+) .*?\n\s*exitcode\s*: (-?\d+)", re.M)
_REPORT_MAX_LINES = 400  # a report that never ends is shown as it is
# torch/distributed/elastic: multiprocessing/api.py ``_close`` (a worker still running when torchrun tears the group
# down), and errors/__init__.py ``ChildFailedError`` (its exception line, then one entry per failed worker).
_CLOSING = re.compile(r"Sending process (\d+) closing signal SIG[A-Z]+")
_CHILD_FAILED = re.compile(r"^(?:[\w.]+\.)?ChildFailedError:")
_ENTRY = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)", re.M)


class StopNoiseFilter:
    """Decides, line by line, which of a job's stderr lines reach the console (``filtered`` mode).

    ``feed`` returns the lines to show now; a traceback is held until its last line tells whether it is
    torchrun's SignalException (summarised through ``note``) or anything else (shown whole)."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.note = note
        self._traceback: list[str] = []
        self._report: int | None = None  # in a ChildFailedError report: how many '=' rules were seen
        self._blank: list[str] = []  # blank lines held back: the one before the OMP banner goes with it

    def feed(self, line: str) -> list[str]:
        text = _TORCH_LOG_PREFIX.sub("", line.rstrip("\n"))
        if self._traceback:
            self._traceback.append(line)
            if self._report is not None:
                self._report += bool(_RULE.match(text))
                if self._report >= 2 or len(self._traceback) > _REPORT_MAX_LINES:
                    return self._child_failed()
                return []
            if text[:1] in (" ", "\t") or not text:
                return []
            if "ChildFailedError" in text:  # its report follows, between two rules
                self._report = 0
                return []
            block, self._traceback = self._traceback, []
            m = _SIGNAL_EXCEPTION.search(text)
            if m is None:
                return block
            self.note(f"torchrun stopped on signal {m.group(1)} (its SignalException traceback is in the job log)")
            return []
        if text.startswith(_TRACEBACK):
            self._traceback = [line]
            return self._release_blank()
        if not text.strip():
            self._blank.append(line)
            return []
        if _BANNER.search(text):
            self._blank = []
            return []
        if _STOP_NOISE.search(text) or _CHILD_FAILED_LOG.search(text):
            return self._release_blank()
        return self._release_blank() + [line]

    def _child_failed(self) -> list[str]:
        """The end of a ChildFailedError report: one note when the in-job client stopped the ranks (the others
        were SIGTERMed by torchrun after), else the whole block."""
        block, self._traceback, self._report = self._traceback, [], None
        failures = [(int(r), int(c)) for r, c in _FAILURE.findall("".join(block))]
        client = sorted({r for r, c in failures if c in _CLIENT_EXITS})
        codes = sorted({c for _, c in failures if c in _CLIENT_EXITS})
        if not client or not all(c in _CLIENT_EXITS or c == -15 for _, c in failures):
            return block
        self.note(f"rank(s) {','.join(map(str, client))} stopped by the in-job client (exit "
                  f"{'/'.join(map(str, codes))}); torchrun's ChildFailedError report is in the job log")
        return []

    def flush(self) -> list[str]:
        out, self._traceback = self._blank + self._traceback, []
        self._blank, self._report = [], None
        return out

    def _release_blank(self) -> list[str]:
        out, self._blank = self._blank, []
        return out


class TorchrunReader:
    """Reads torchrun's report of its workers' ends off a run's output, line by line: ``report`` is set once a whole
    ChildFailedError report was read (launch.exits.TorchrunReport), with every closing signal torchrun sent before."""

    def __init__(self) -> None:
        self.report: TorchrunReport | None = None
        self._torn_down: set[int] = set()
        self._block: list[str] | None = None  # in a ChildFailedError report: its lines so far
        self._rules = 0

    def feed(self, line: str) -> None:
        text = _TORCH_LOG_PREFIX.sub("", line.rstrip("\n"))
        if self._block is not None:
            self._block.append(text)
            self._rules += bool(_RULE.match(text))
            if self._rules >= 2:
                self._finish()
            elif len(self._block) > _REPORT_MAX_LINES:  # not torchrun's report after all
                self._block = None
        elif m := _CLOSING.search(text):
            self._torn_down.add(int(m.group(1)))
        elif _CHILD_FAILED.match(text):
            self._block, self._rules = [], 0

    def _finish(self) -> None:
        assert self._block is not None
        entries = _ENTRY.findall("\n".join(self._block))
        self._block = None
        if entries:
            self.report = TorchrunReport({int(r): (int(code), int(pid)) for r, code, pid in entries},
                                         frozenset(self._torn_down))


class JobOutput:
    """One launched job's output routing across its runs (see the module docstring)."""

    def __init__(self, mode: str = "console", log_path: Path | None = None, console: TextIO | None = None,
                 note: Callable[[str], None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"job output mode must be one of {MODES}, got {mode!r}")
        if mode != "console" and log_path is None:
            raise ValueError(f"job output mode {mode!r} needs a log path")
        self.mode = mode
        self.log_path = log_path
        self.console = console
        self.note = note or (lambda msg: None)
        self._threads: list[threading.Thread] = []
        self._reader: TorchrunReader | None = None  # the current run's
        self._run_start = 0  # where the current run's output starts in the log (appended to across runs)

    @property
    def torchrun_report(self) -> TorchrunReport | None:
        """torchrun's report of the current run's failed workers, once ``finish`` drained its output; None when there
        was none, or the output is not captured (``console``)."""
        return self._reader.report if self._reader is not None else None

    def popen_kwargs(self) -> dict[str, Any]:
        if self.mode == "story":
            return {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        if self.mode == "filtered":
            return {"stderr": subprocess.PIPE}
        return {}

    def attach(self, child: subprocess.Popen[bytes]) -> None:
        """Start draining the run's pipe (a no-op in ``console`` mode)."""
        stream = child.stdout if self.mode == "story" else child.stderr if self.mode == "filtered" else None
        self._reader = None
        self._run_start = _size(self.log_path)
        if stream is None:
            return
        reader = self._reader = TorchrunReader()
        t = threading.Thread(target=self._pump, args=(stream, reader), name="job-output", daemon=True)
        t.start()
        self._threads.append(t)

    def run_text(self, limit: int = 1 << 20) -> str:
        """What the current run wrote to the log (its last ``limit`` bytes); "" without a log (``console``)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self._run_start, _size(self.log_path) - limit))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def finish(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until the runs' output is drained: their last lines come before what launch says next."""
        for t in self._threads:
            t.join(timeout_s)
        self._threads = [t for t in self._threads if t.is_alive()]

    def _pump(self, stream: IO[bytes], reader: TorchrunReader) -> None:
        log = self._open_log()
        filt = StopNoiseFilter(self.note) if self.mode == "filtered" else None
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", "replace")
                reader.feed(line)
                if log is not None:
                    try:
                        log.write(line)
                        log.flush()
                    except OSError as e:  # a full disk loses the log, never the job
                        note_write_error(f"job log {self.log_path}", e)
                        log = None
                if filt is not None:
                    self._show(filt.feed(line))
                elif line.startswith(STORY_PREFIX):
                    self._show([line])
            if filt is not None:
                self._show(filt.flush())
        finally:
            stream.close()
            if log is not None:
                log.close()

    def _open_log(self) -> IO[str] | None:
        assert self.log_path is not None
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            return open(self.log_path, "a", encoding="utf-8")
        except OSError as e:
            note_write_error(f"job log {self.log_path}", e)
            return None

    def _show(self, lines: list[str]) -> None:
        if not lines or self.console is None:
            return
        try:
            self.console.write("".join(lines))
            self.console.flush()
        except (OSError, ValueError):  # the console is gone (``launch … | head``): keep draining into the log
            self.console = None


__all__ = ["MODES", "JobOutput", "StopNoiseFilter", "TorchrunReader"]


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0
