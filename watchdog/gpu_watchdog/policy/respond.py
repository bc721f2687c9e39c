"""What to do about a finding (pure): the one place that decides between recover, drain, record and observe.

- ``drain``: a GPU fault a restart on this node cannot fix (lost GPU, reset required, any Xid not in
  ``faults.application_xids``): stop the jobs on that GPU, drain the node.
- ``record``: an application Xid (the job's own error; the GPU keeps serving others), ranks launched with
  different settings, a straggler (one rank the others keep waiting for), a wait nearing the job's own collective
  timeout (``deadline``): an incident, nothing is stopped.
- ``recover``: a stall (or a requested restart) of a job this agent supervises — ``launch``'s own job, a job
  registered with the daemon — while ``recovery.enabled``: evidence, checkpoint, stop, restart.
- ``observe``: a stall nobody can restart (a job not registered with the daemon) or with recovery disabled:
  the evidence, and a stop only when ``stop`` says so (``daemon.stop_unregistered``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_watchdog.config.schema import Config
from gpu_watchdog.model import Finding
from gpu_watchdog.sample.xid import is_draining

# Kinds that are recorded and never acted on, with why.
RECORD_ONLY_KINDS = {
    "config_mismatch": "ranks launched with different settings hang later; nothing to stop yet",
    "straggler": "a slow rank is not a stuck one: observed, never stopped",
    "deadline": "a wait nearing the job's own timeout may still complete: a warning, never a stop",
}
RECOVER, DRAIN, RECORD, OBSERVE = "recover", "drain", "record", "observe"


@dataclass(frozen=True)
class Response:
    action: str  # RECOVER | DRAIN | RECORD | OBSERVE
    why: str
    stop: bool = False  # observe: stop the job's ranks (there is no way to restart them)


def respond(finding: Finding, cfg: Config, *, supervised: bool, stop_unsupervised: bool = False) -> Response:
    if finding.kind == "gpu_fault":
        if is_draining(finding.signature):
            return Response(DRAIN, "a GPU fault no restart on this node can fix")
        return Response(RECORD, "an application Xid: the job's own error, the GPU serves on")
    if finding.kind in RECORD_ONLY_KINDS:
        return Response(RECORD, RECORD_ONLY_KINDS[finding.kind])
    if not cfg.recovery.enabled:
        return Response(OBSERVE, "recovery disabled (recovery.enabled = false): watching on")
    if supervised:
        return Response(RECOVER, "a stall of a supervised job")
    if stop_unsupervised:
        return Response(OBSERVE, "job not registered with the daemon: stopped, no restart hook", stop=True)
    return Response(OBSERVE, "job not registered with the daemon: not stopped, no restart hook")
