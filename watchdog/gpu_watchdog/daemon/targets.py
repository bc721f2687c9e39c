"""The daemon's jobs as the act stage sees them (act.target.JobTarget): a registered job, whose restart is the
restart hook it registered, and the ranks of a job nobody registered (``daemon.stop_unregistered``). Neither calls
back into the daemon: each holds only what it acts through."""

from __future__ import annotations

import os
from collections.abc import Callable

from gpu_watchdog.act.stopper import JobProcess
from gpu_watchdog.act.transcript import Transcript
from gpu_watchdog.daemon.restart_hooks import RestartHooks
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import NodeSample, Registration


class RegisteredJob:
    """Its processes are the registry's; its restart is the restart hook it registered."""

    def __init__(self, job_id: str, reg: Registration, control: ControlDir,
                 processes: Callable[[], list[JobProcess]], hooks: RestartHooks) -> None:
        self.job_id = job_id
        self.reg = reg
        self.control = control
        self._processes = processes
        self._hooks = hooks
        self.may_signal_checkpoint = reg.checkpoint_opt_in  # never a signal it did not ask for
        self.run: int | None = reg.run  # Slurm's restart count, from the TaskProlog

    def processes(self) -> list[JobProcess]:
        return self._processes()

    def poll(self) -> int | None:
        return None if self.processes() else 0

    def restart(self, inc: Transcript, level: int, shown: str) -> bool:
        return self._hooks.restart(inc, self.job_id, self.reg.restart_hook, level, self.run)


class UnregisteredRanks:
    """The ranks of a job nobody registered: only processes sampled as its ranks (never the daemon); there is
    nothing to restart."""

    may_signal_checkpoint = False

    def __init__(self, job_id: str, control: ControlDir, last_sample: Callable[[], NodeSample | None]) -> None:
        self.job_id = job_id
        self.control = control
        self._last_sample = last_sample

    def processes(self) -> list[JobProcess]:
        sample = self._last_sample()
        return [JobProcess(p.pid, p.create_time) for p in (sample.processes if sample else ())
                if p.is_rank and p.job and p.job.job_id == self.job_id and p.pid != os.getpid()]

    def poll(self) -> int | None:
        return None

    def restart(self, inc: Transcript, level: int, shown: str) -> bool:
        return False
