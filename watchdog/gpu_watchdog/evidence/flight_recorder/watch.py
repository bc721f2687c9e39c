"""The Flight Recorder while a job is suspect (an ``evidence.source.JobWatch``): once per suspect streak its ranks
are asked for dumps on the worker pool (a rank's environment read and a byte per dump FIFO; nothing for a job
without a trigger), so the incident finds them written at confirmation. A job running again starts a new streak."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor

from gpu_watchdog.config.schema import FlightRecorderConfig
from gpu_watchdog.evidence.flight_recorder.dumps import SuspectDumps
from gpu_watchdog.model import Finding, JobState, JobStatus, NodeSample


class SuspectDumpWatch:
    def __init__(self, dumps: SuspectDumps, pool: Executor, cfg: Callable[[], FlightRecorderConfig]) -> None:
        self.dumps = dumps
        self._pool = pool
        self._cfg = cfg  # read each tick: a reload replaces the config

    def watch(self, jobs: Mapping[str, JobStatus], sample: NodeSample | None = None) -> list[Finding]:
        for js in jobs.values():
            if js.state == JobState.RUNNING:
                self.dumps.end(js.job_id)
            elif (js.state == JobState.SUSPECT and js.onset is not None and js.rank_pids
                  and self._cfg().dump_on_suspect and self.dumps.claim(js.job_id, js.onset)):
                self._pool.submit(self.dumps.ask, js.job_id, js.onset, dict(js.rank_pids))
        return []

    def forget(self, job_id: str) -> None:
        self.dumps.end(job_id)

    def jobs(self) -> set[str]:
        return self.dumps.jobs()
