"""Start ``gpu-watchdog run`` as a subprocess with its own state dir, socket and config; always clean up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import waiting
from repo_paths import REPO

GW = str(Path(sys.executable).parent / "gpu-watchdog")
HOOK = REPO / "tests" / "hookbin" / "record_hook.py"


def short_dir() -> Path:
    """A short directory (unix socket paths are limited to ~107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="gw-", dir="/tmp"))


def write_config(base: Path, *, hook_sleep: float = 0.0, hook_timeout: float = 30.0, extra: str = "") -> Path:
    cfg = base / "config.toml"
    cfg.write_text(f"""
[agent]
interval_s = 0.5
backend = "proc"
state_dir = "{base / 'state'}"

[recovery]
stop_grace_s = 3.0
checkpoint_grace_s = 0.0

[daemon]
control_socket = "{base / 'control.sock'}"
socket_group = ""
housekeeping_interval_s = 60.0

[hooks.requeue]
argv = ["{sys.executable}", "{HOOK}", "{base / 'hook.record'}", "{hook_sleep}",
        "requeue", "{{job_id}}", "--level={{level}}", "{{incident}}", "{{node}}"]
timeout_s = {hook_timeout}
{extra}
""")
    return cfg


class DaemonProc:
    def __init__(self, base: Path, config: Path, env: dict[str, str] | None = None) -> None:
        self.base = base
        self.config = config
        self.log = base / "daemon.log"
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen([GW, "run", "--config", str(config)], stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)

    @property
    def socket(self) -> str:
        return str(self.base / "control.sock")

    def wait_socket(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not Path(self.socket).exists() or self.call("status", check=False).get("ok") is not True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon socket not up:\n{self.log_text()}")
            time.sleep(0.2)

    def call(self, op: str, check: bool = True, **fields: Any) -> dict[str, Any]:
        from gpu_watchdog.daemon.control import request

        try:
            return request(self.socket, {"op": op, **fields}, timeout_s=30)
        except Exception as e:
            if check:
                raise
            return {"ok": False, "error": str(e)}

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([GW, *args], capture_output=True, text=True, timeout=60)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


def wait_for(pred: Any, timeout: float, what: str, log: Any = None, poll: float = 0.25) -> Any:
    """waiting.wait_for, polling less often: the daemon tests' conditions often run the CLI."""
    return waiting.wait_for(pred, timeout, what, log=log, poll=poll)


def records(base: Path) -> list[dict[str, Any]]:
    p = base / "hook.record"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def register_when_up(daemon: subprocess.Popen[bytes], base: Path, job: Any, job_id: str,
                     daemon_log: Any, ranks_timeout: float = 90.0) -> None:
    """Wait for a daemon started on ``base`` (its control socket ``base/control.sock``) and the job's ranks, then
    register the job (``hook job-start`` with the ``requeue`` restart hook); the daemon's log on any failure."""
    wait_for(lambda: (base / "control.sock").exists() or daemon.poll() is not None, 60, "daemon socket", daemon_log)
    assert daemon.poll() is None, daemon_log()
    job.wait_ranks(ranks_timeout)
    reg = subprocess.run([GW, "hook", "job-start", "--socket", str(base / "control.sock"), "--job-id", job_id,
                          "--pid", str(job.proc.pid), "--restart-hook", "requeue"],
                         capture_output=True, text=True, timeout=60)
    assert reg.returncode == 0, reg.stdout + reg.stderr + daemon_log()
