"""Restart hooks: run a named argv template from the root-owned config, never a shell, always with a timeout.

``render_argv`` substitutes ``{job_id} {node} {level} {incident}`` inside each argv element; every value is
validated first (job ids by ``fallback.validate_job_id``, node names and incident ids by pattern, the level is
an int), and one template element always yields exactly one argv element, so a value can neither add
arguments nor start an option. ``run_hook`` runs it in its own session with stdin closed, kills the whole
group at the timeout and returns the exit code, the elapsed time and the tail of its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from gpu_watchdog.config.schema import HookSpec
from gpu_watchdog.policy.hook_values import render_argv

OUTPUT_TAIL_BYTES = 4096
# The only variables a hook inherits from the daemon (plus GPU_WATCHDOG_* set per call).
_PASS_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "KUBECONFIG", "SLURM_CONF")


@dataclass(frozen=True)
class HookResult:
    argv: tuple[str, ...]
    exit_code: int | None  # None: did not finish (timeout) or could not start
    timed_out: bool
    elapsed_s: float
    output: str  # tail of stdout+stderr
    error: str = ""  # could not start: why

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def detail(self) -> str:
        if self.error:
            return f"{self.argv[0]}: {self.error}"
        what = (f"timed out after {self.elapsed_s:.1f}s (process group killed)" if self.timed_out
                else f"exit {self.exit_code} after {self.elapsed_s:.1f}s")
        out = self.output.strip().replace("\n", " | ")[-300:]
        return f"{' '.join(self.argv)}: {what}" + (f"; output: {out}" if out else "")

    def to_json(self) -> dict[str, object]:
        return {"argv": list(self.argv), "exit_code": self.exit_code, "timed_out": self.timed_out,
                "elapsed_s": round(self.elapsed_s, 3), "output": self.output, "error": self.error}


def run_hook(spec: HookSpec, values: Mapping[str, str], *, extra_env: Mapping[str, str] | None = None,
             on_start: object = None) -> HookResult:
    argv = render_argv(spec.argv, values)
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    env.update({"GPU_WATCHDOG_JOB_ID": values["job_id"], "GPU_WATCHDOG_NODE": values["node"],
                "GPU_WATCHDOG_LEVEL": values["level"], "GPU_WATCHDOG_INCIDENT": values["incident"]})
    env.update(extra_env or {})
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, cwd="/", start_new_session=True, close_fds=True)
    except OSError as e:
        return HookResult(argv, None, False, time.monotonic() - t0, "", f"cannot start: {e.strerror or e}")
    if callable(on_start):
        on_start(proc.pid)
    try:
        out, _ = proc.communicate(timeout=spec.timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild kept the pipe open: give up on the output
            out = b""
        timed_out = True
    text = (out or b"")[-OUTPUT_TAIL_BYTES:].decode(errors="replace")
    return HookResult(argv, None if timed_out else proc.returncode, timed_out, time.monotonic() - t0, text)
