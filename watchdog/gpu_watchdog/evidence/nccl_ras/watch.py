"""NCCL RAS while a job runs (an ``evidence.source.JobWatch``): the poller's own thread is asked (it never blocks
the tick) about every job that looks hung, and all the time about the jobs whose rank 0 runs here. One query
gathers from every node of the job, so only rank 0's node watches; the others ask when their own signals suspect.
What the polls observe reaches the detector through ``RasPoller.take_progress``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpu_watchdog.config.schema import RasConfig
from gpu_watchdog.evidence.nccl_ras.poll import RasPoller
from gpu_watchdog.model import Finding, JobState, JobStatus, NodeSample


class RasWatch:
    def __init__(self, poller: RasPoller, cfg: Callable[[], RasConfig]) -> None:
        self.poller = poller
        self._cfg = cfg  # read each tick: a reload replaces the config

    def watch(self, jobs: Mapping[str, JobStatus], sample: NodeSample | None = None) -> list[Finding]:
        every = self._cfg().watch_interval_s
        for js in jobs.values():
            if js.state in (JobState.SUSPECT, JobState.STALLED) and js.rank_pids:
                self.poller.poll_due(js.job_id, js.rank_pids)
            elif every > 0 and 0 in js.rank_pids:
                self.poller.poll_due(js.job_id, js.rank_pids, every)
        return []

    def forget(self, job_id: str) -> None:
        self.poller.forget(job_id)

    def jobs(self) -> set[str]:
        return self.poller.jobs()
