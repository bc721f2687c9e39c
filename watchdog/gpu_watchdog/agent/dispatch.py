"""Every finding of a tick to its host's handler, the same way for ``launch`` and the daemon: ``policy.respond``
says recover, drain, record or observe; the host carries it out its own way (``launch`` inline, turning outcomes
into its exit code; the daemon in its worker pool, turning them into hooks). The first handler that returns an
outcome ends the tick's dispatch (``launch``: its run is over)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Generic, Protocol, TypeVar

from gpu_watchdog.act.faults import record
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.schema import Config, HookSpec
from gpu_watchdog.model import Finding, JobStatus, NodeSample
from gpu_watchdog.policy.respond import DRAIN, RECORD, RECOVER, Response, respond

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Handlers(Protocol[T_co]):
    """What a host does with each of ``respond``'s answers; None: nothing ends the run."""

    def recover(self, finding: Finding, sample: NodeSample, status: JobStatus | None) -> T_co | None: ...

    def drain(self, finding: Finding, sample: NodeSample) -> T_co | None: ...

    def record(self, finding: Finding, sample: NodeSample) -> T_co | None: ...

    def observe(self, finding: Finding, sample: NodeSample, status: JobStatus | None,
                response: Response) -> T_co | None: ...


class Dispatcher(Generic[T]):
    def __init__(self, cfg: Callable[[], Config], handlers: Handlers[T], supervised: Callable[[str | None], bool],
                 stop_unsupervised: Callable[[], bool] = lambda: False) -> None:
        self._cfg = cfg  # read at each dispatch: a reload replaces the config
        self._handlers = handlers
        self._supervised = supervised
        self._stop_unsupervised = stop_unsupervised

    def dispatch(self, findings: Iterable[Finding], sample: NodeSample,
                 jobs: Mapping[str, JobStatus]) -> T | None:
        h = self._handlers
        for f in findings:
            response = respond(f, self._cfg(), supervised=self._supervised(f.job_id),
                               stop_unsupervised=self._stop_unsupervised())
            status = jobs.get(f.job_id) if f.job_id else None
            if response.action == RECOVER:
                out = h.recover(f, sample, status)
            elif response.action == DRAIN:
                out = h.drain(f, sample)
            elif response.action == RECORD:
                out = h.record(f, sample)
            else:
                out = h.observe(f, sample, status, response)
            if out is not None:
                return out
        return None


def record_finding(ctx: ActContext, hooks: Mapping[str, HookSpec], finding: Finding, sample: NodeSample,
                   warn: Callable[[str], None]) -> None:
    """``respond``'s "record", for both hosts: the incident (an application Xid, ranks launched with different
    settings) and one warning line (a GPU fault's handler says its own)."""
    inc = record(ctx, hooks, finding, sample)
    if finding.kind != "gpu_fault":
        warn(f"{finding.detail} (incident {inc.id})")
