"""What ``launch`` does on a ``gpu_fault`` finding (a lost GPU, a reset-required GPU, or an Xid event).

No NCCL setting helps a broken GPU, and restarting on it just burns another timeout, so:

- **draining** fault (``gpu_lost``, ``reset_required``, ``xid`` — any Xid not in ``faults.application_xids``)
  on a GPU the launched job uses: record the incident (GPU, Xid, jobs on that GPU), stop the job with the
  stop ladder (no checkpoint request: state computed on a faulted GPU is not worth saving), run the drain
  hook, leave the job's fallback level untouched, and exit ``EXIT_GPU_FAULT`` (74) so the caller (a batch
  script, the scheduler) runs the job elsewhere;
- draining fault on a GPU the job does not use: record it and drain the node (running jobs may finish), but
  keep supervising the job;
- **application** Xid (``xid_application``): the incident only; the stall logic carries on as usual.

The drain hook is ``faults.drain_hook`` (a ``[hooks.NAME]`` of the config) when set, else the argv
``faults.drain_command`` (default: Slurm ``scontrol update nodename={node} state=drain reason=…``). Both run
through ``gpu_watchdog.act.hooks.run_hook``: no shell, one argv element per template element, validated values,
its own session, a timeout. The node is drained at most once per ``launch``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpu_watchdog.act.hooks import HookResult, placeholder_values, run_hook
from gpu_watchdog.act.recovery import EXIT_GPU_FAULT, job_processes
from gpu_watchdog.act.stopper import stop_processes
from gpu_watchdog.config.schema import FaultsConfig, HookSpec
from gpu_watchdog.detect.detector import Finding
from gpu_watchdog.errors import WatchdogError
from gpu_watchdog.evidence.report import render_report
from gpu_watchdog.model import NodeSample
from gpu_watchdog.policy.fallback import decide
from gpu_watchdog.sample.xid import is_draining

if TYPE_CHECKING:
    import subprocess

_GPU_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,95}$")
_REASON_BAD = re.compile(r"[^A-Za-z0-9 ._:,=/+-]")


def drain_reason(signature: str, xid: int | None, gpu: str) -> str:
    """A short reason for the scheduler (Slurm shows it in ``sinfo -R``): printable, no shell metacharacters."""
    what = f"Xid {xid}" if xid is not None else signature.replace("_", " ")
    return _REASON_BAD.sub("_", f"{what} on {gpu or 'a GPU'}")[:200]


def drain_values(job_id: str, node: str, level: int, incident: str, reason: str, gpu: str,
                 xid: int | None) -> dict[str, str]:
    """Placeholder values for the drain argv; UsageError when one is not safe to substitute."""
    from gpu_watchdog.errors import UsageError

    values = placeholder_values(job_id, node, level, incident)
    if gpu and not _GPU_RE.match(gpu):
        raise UsageError(f"invalid GPU id {gpu!r}")
    values.update(reason=_REASON_BAD.sub("_", reason)[:200], gpu=gpu, xid="" if xid is None else str(int(xid)))
    return values


def drain_spec(cfg: FaultsConfig, hooks: Mapping[str, HookSpec]) -> HookSpec | None:
    """The hook that drains the node: ``faults.drain_hook`` when set, else ``faults.drain_command``; None when
    neither is configured."""
    if cfg.drain_hook:
        spec = hooks.get(cfg.drain_hook)
        if spec is None:
            raise WatchdogError(f"faults.drain_hook: no [hooks.{cfg.drain_hook}] in the config")
        return spec
    if not cfg.drain_command:
        return None
    return HookSpec("drain_command", "command", tuple(cfg.drain_command), cfg.drain_timeout_s)


def run_drain(spec: HookSpec, values: Mapping[str, str]) -> HookResult:
    extra = {"GPU_WATCHDOG_REASON": values["reason"], "GPU_WATCHDOG_GPU": values["gpu"],
             "GPU_WATCHDOG_XID": values["xid"]}
    return run_hook(spec, values, extra_env=extra)


class FaultPolicy:
    """The launcher's gpu_fault handling; ``handle`` returns an exit code for launch, or None to go on."""

    def __init__(self, launcher: Any, hooks: Mapping[str, HookSpec] | None = None) -> None:
        self.lc = launcher
        self.hooks = dict(hooks or {})
        self.drained: str | None = None  # the incident that drained the node

    def _metric(self, name: str, *args: Any) -> None:
        if self.lc.metrics is not None:
            getattr(self.lc.metrics, name)(*args)

    def handle(self, finding: Finding, child: subprocess.Popen[bytes], sample: NodeSample) -> int | None:
        lc = self.lc
        cfg = lc.cfg
        devs = [d for d in sample.devices if d.uuid in finding.devices]
        fault = next((d.fault for d in devs if d.fault is not None), None)
        xid = fault.xid if fault is not None else None
        gpu = finding.devices[0] if finding.devices else ""
        pids = {pid for d in devs for pid in d.pids}
        jobs = sorted({p.job.job_id for p in sample.processes if p.job is not None and p.pid in pids})
        ours = lc.job_id in jobs
        drain = is_draining(finding.signature)

        inc = lc.incidents.create(finding, lc.host)
        inc.update(gpu=gpu, xid=xid, jobs=jobs, drain=drain, fallback=None)
        self._metric("incident", finding.kind)
        self._metric("gpu_fault", gpu, xid if xid is not None else finding.signature)
        lc.say(f"GPU_FAULT on {gpu or 'a GPU'} ({finding.signature}{f', Xid {xid}' if xid is not None else ''}): "
               f"{finding.detail}; incident {inc.id}")

        if not drain:
            inc.update(advice=f"Xid {xid} is an application error (faults.application_xids): no drain, no "
                              "restart; look at the job's own error output")
            inc.write_report(render_report(inc.summary, []))
            lc.say("application Xid: incident recorded; the node is not drained and the job is watched on")
            return None

        advice = decide(cfg.fallback, lc.fallback.level(lc.job_id), "gpu_fault", None).advice
        inc.update(advice=advice)
        if not cfg.recovery.enabled:
            inc.record_action("none", True, "recovery disabled: the job was not stopped, the node not drained")
            inc.write_report(render_report(inc.summary, []))
            lc.say("recovery disabled: watching on")
            return None

        if ours:
            self._stop(inc, child)
        self._drain(inc, finding.signature, xid, gpu)
        if not ours:
            inc.write_report(render_report(inc.summary, []))
            lc.say(f"job {lc.job_id} does not use {gpu or 'that GPU'}: watching on")
            return None
        inc.record_action("exit", True, f"launch exits {EXIT_GPU_FAULT}: the job must run on another node "
                                        "(its fallback level is unchanged)")
        inc.write_report(render_report(inc.summary, []))
        lc.say(f"giving up on this node: {advice} (exit {EXIT_GPU_FAULT})")
        return EXIT_GPU_FAULT

    def _stop(self, inc: Any, child: subprocess.Popen[bytes]) -> None:
        if child.poll() is not None:
            inc.record_action("stop", True, f"the job had already exited with {child.returncode}")
            return
        grace = self.lc.cfg.recovery.stop_grace_s
        procs = job_processes(child)
        entry = inc.begin_action("stop", f"SIGTERM to {len(procs)} job processes, SIGKILL after {grace:.0f}s")

        def reap() -> None:
            child.poll()

        res = stop_processes(procs, grace, reap=reap)
        child.poll()
        inc.end_action(entry, res.ok, res.detail)
        self._metric("action", "stop", res.ok)
        self.lc.say(f"stopped the job: {res.detail}")

    def _drain(self, inc: Any, signature: str, xid: int | None, gpu: str) -> None:
        lc = self.lc
        if self.drained is not None:
            inc.record_action("drain", True, f"skipped: the node was already drained for incident {self.drained}")
            return
        try:
            spec = drain_spec(lc.cfg.faults, self.hooks)
            values = drain_values(lc.job_id, lc.host, lc.fallback.level(lc.job_id), inc.id,
                                  drain_reason(signature, xid, gpu), gpu, xid)
        except WatchdogError as e:
            inc.record_action("drain", False, f"not run: {e}")
            self._metric("action", "drain", False)
            lc.say(f"drain: not run: {e}")
            return
        if spec is None:
            inc.record_action("drain", True, "skipped: no faults.drain_command or faults.drain_hook configured")
            lc.say("drain: nothing configured (faults.drain_command is empty)")
            return
        entry = inc.begin_action("drain", f"{spec.name}: {' '.join(spec.argv)}")
        res = run_drain(spec, values)
        inc.end_action(entry, res.ok, res.detail())
        inc.update(drain_hook=res.to_json())
        self._metric("action", "drain", res.ok)
        if res.ok:
            self.drained = inc.id
        lc.say(f"drain: {res.detail()}")
