"""Run ``gpu-watchdog launch -- torchrun …`` as a subprocess for end-to-end tests, and always clean up.

    run = start_launch(["--backend", "nvml"], job_argv, env=env, tmp_path=tmp_path)
    try:
        rc = run.wait(timeout=120)
        incidents = run.incidents()
    finally:
        run.kill()        # SIGKILL to the agent, torchrun and every rank it ever saw

Both the agent and the job run under ``timeout -s KILL`` as a safety net. The job runs in its own session
(the launcher starts it that way), so killing the agent alone would leave the ranks behind: ``kill()``
kills every descendant seen while the test polled (``track()``, called by ``wait``/``wait_for``) plus
the pids the caller hands in (e.g. rank pids from the job's events).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil
from gpu_watchdog.demo import runner as demo
from repo_paths import REPO

VENV_BIN = Path(sys.executable).parent
CLI = str(VENV_BIN / "gpu-watchdog") if (VENV_BIN / "gpu-watchdog").exists() else "gpu-watchdog"
TRAIN = REPO / "tests" / "jobs" / "train.py"
T = TypeVar("T")


def torchrun() -> str:
    beside = VENV_BIN / "torchrun"
    return str(beside) if beside.exists() else (shutil.which("torchrun") or "torchrun")


def _safety(argv: Sequence[str], seconds: int) -> list[str]:
    timeout_bin = shutil.which("timeout")
    return [timeout_bin, "-s", "KILL", str(seconds), *argv] if timeout_bin else list(argv)


def train_argv(events: Path, workdir: Path, *, nproc: int = 4, scenario: str = "hang", rank_at: int = 1,
               step_at: int = 4, step_s: float = 0.3, steps: int = 200, extra: Sequence[str] = (),
               max_lifetime_s: int = 240) -> list[str]:
    """torchrun … tests/jobs/train.py (a gloo job whose rank ``rank_at`` hangs at ``step_at``)."""
    return _safety([torchrun(), "--standalone", "--nproc-per-node", str(nproc), str(TRAIN),
                    "--scenario", scenario, "--rank-at", str(rank_at), "--step-at", str(step_at),
                    "--step-s", str(step_s), "--steps", str(steps), "--events", str(events),
                    "--workdir", str(workdir), *extra], max_lifetime_s)


def demo_argv(events: Path, workdir: Path, *, nproc: int = 4, steps: int = 24, hang_at: int = 8,
              step_s: float = 0.15, client: bool = True, extra: Sequence[str] = (),
              max_lifetime_s: int = 240) -> list[str]:
    """torchrun … gpu_watchdog/demo/train.py (hangs in a P2P recv at ``hang_at`` until NCCL_P2P_DISABLE=1)."""
    from gpu_watchdog.demo import train as demo_job
    argv = [torchrun(), "--standalone", "--nproc-per-node", str(nproc), demo_job.__file__,
            "--ckpt-dir", str(workdir), "--events", str(events), "--steps", str(steps),
            "--hang-at", str(hang_at), "--step-s", str(step_s), *(["--client"] if client else []), *extra]
    return _safety(argv, max_lifetime_s)


read_events = demo.read_events  # one reader of the jobs' events files, shared with the demo


def write_config(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """A TOML config from {section: {key: value}} (numbers, bools, strings, arrays of those)."""
    lines = []
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        for k, v in keys.items():
            if isinstance(v, bool):
                lines.append(f"{k} = {'true' if v else 'false'}")
            elif isinstance(v, (str, list, tuple)):  # JSON strings and arrays of strings/ints are TOML too
                lines.append(f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}")
            else:
                lines.append(f"{k} = {v!r}")
        lines.append("")
    path.write_text("\n".join(lines))
    return path


class LaunchRun:
    """A running ``gpu-watchdog launch``: its output, its incidents, and a hard cleanup."""

    def __init__(self, proc: subprocess.Popen[bytes], out_path: Path, state_dir: Path, job_id: str) -> None:
        self.proc = proc
        self.out_path = out_path
        self.state_dir = state_dir
        self.job_id = job_id
        self._seen: dict[int, float] = {}  # pid → create_time of every descendant seen

    def output(self) -> str:
        try:
            return self.out_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def incidents(self) -> list[dict[str, Any]]:
        from gpu_watchdog.store.incidents import IncidentStore

        return IncidentStore(self.state_dir).list()

    def track(self, extra: Iterable[int] = ()) -> None:
        """Remember every current descendant of the agent (and ``extra`` pids) for ``kill()``."""
        procs: list[psutil.Process] = []
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            pass
        for pid in extra:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                continue
        for p in procs:
            try:
                self._seen.setdefault(p.pid, p.create_time())
            except psutil.Error:
                continue

    def poll(self) -> int | None:
        self.track()
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"gpu-watchdog launch still running after {timeout}s:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        return rc

    def wait_for(self, what: str, cond: Callable[[], T | None], timeout: float) -> T:
        """Poll ``cond`` until it returns something truthy; fail with the agent's output on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = cond()
            if value:
                return value
            if self.poll() is not None and not (value := cond()):
                raise AssertionError(f"launch exited ({self.proc.returncode}) before {what}:\n"
                                     f"{self.output()[-4000:]}")
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout}s:\n{self.output()[-4000:]}")
            time.sleep(0.1)

    def kill(self, extra: Iterable[int] = ()) -> None:
        """SIGKILL the agent and everything it started. Idempotent."""
        self.track(extra)
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        for pid, ctime in self._seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == ctime:
                    p.send_signal(signal.SIGKILL)
            except psutil.Error:
                continue
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def start_launch(args: Sequence[str], job_argv: Sequence[str], *, env: Mapping[str, str], tmp_path: Path,
                 job_id: str, max_lifetime_s: int = 300) -> LaunchRun:
    """``gpu-watchdog launch ARGS --state-dir <tmp>/state --job-id JOB -- JOB_ARGV``, output to a file."""
    state_dir = tmp_path / "state"
    out = tmp_path / f"launch-{job_id}.log"
    argv = _safety([CLI, "launch", *args, "--state-dir", str(state_dir), "--job-id", job_id, "--", *job_argv],
                   max_lifetime_s)
    full_env = dict(env)
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    with open(out, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=full_env, cwd=tmp_path)
    return LaunchRun(proc, out, state_dir, job_id)


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("LD_LIBRARY_PATH", "NVML_STANDIN_STATE"):
        env.pop(k, None)
    return env
