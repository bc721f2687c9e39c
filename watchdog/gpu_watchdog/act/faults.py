"""GPU faults (a lost GPU, a reset-required GPU, an Xid event), for ``launch`` and the daemon alike.

No NCCL setting helps a broken GPU, and restarting on it just burns another timeout, so (``policy.respond``):

- **draining** fault (``gpu_lost``, ``reset_required``, ``xid`` — any Xid not in ``faults.application_xids``):
  record the incident (GPU, Xid, jobs on that GPU), stop the supervised jobs on that GPU with the stop ladder
  (no checkpoint request: state computed on a faulted GPU is not worth saving), run the drain hook once per GPU
  and leave the jobs' fallback levels untouched. What happens to a stopped job next is the caller's:
  ``launch`` exits ``EXIT_GPU_FAULT`` (74), the daemon runs its restart hook so the scheduler places it elsewhere;
- **application** Xid (``xid_application``): the incident only. The job is never stopped for it.

Both hooks run through ``act.hooks.run_hook``: no shell, one argv element per template element, validated
values, their own session, a timeout.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpu_watchdog.act.events import ActionDone, GpuFaulted
from gpu_watchdog.act.hooks import HookResult, run_hook
from gpu_watchdog.act.recovery import stop_job
from gpu_watchdog.act.target import ActContext, JobTarget
from gpu_watchdog.act.transcript import Transcript
from gpu_watchdog.config.schema import HookSpec
from gpu_watchdog.errors import WatchdogError
from gpu_watchdog.model import Finding, NodeSample
from gpu_watchdog.policy.drain import drain_reason, drain_spec, drain_values
from gpu_watchdog.store.incidents import Incident

GPU_FAULT_ADVICE = "GPU fault: no NCCL change helps; drain the node and run the job elsewhere"


def run_drain(spec: HookSpec, values: Mapping[str, str]) -> HookResult:
    extra = {"GPU_WATCHDOG_REASON": values["reason"], "GPU_WATCHDOG_GPU": values["gpu"],
             "GPU_WATCHDOG_XID": values["xid"]}
    return run_hook(spec, values, extra_env=extra)


class GpuFaultHandler:
    def __init__(self, ctx: ActContext, hooks: Mapping[str, HookSpec]) -> None:
        self.ctx = ctx
        self.hooks = hooks

    def _open(self, finding: Finding, sample: NodeSample) -> tuple[Transcript, str, int | None, list[str]]:
        ctx = self.ctx
        gpu = finding.devices[0] if finding.devices else ""
        devs = [d for d in sample.devices if d.uuid in finding.devices]
        fault = next((d.fault for d in devs if d.fault is not None), None)
        xid = fault.xid if fault is not None else None
        pids = {pid for d in devs for pid in d.pids}
        jobs = sorted({p.job.job_id for p in sample.processes if p.job is not None and p.pid in pids})
        t = ctx.transcript(ctx.open_incident(finding))
        t.update(gpu=gpu, xid=xid, jobs=jobs, fallback=None)
        t.count(GpuFaulted(gpu, xid if xid is not None else finding.signature))
        t.say(f"GPU_FAULT on {gpu or 'a GPU'} ({finding.signature}{f', Xid {xid}' if xid is not None else ''}): "
              f"{finding.detail}; incident {t.id}")
        return t, gpu, xid, jobs

    def record(self, finding: Finding, sample: NodeSample) -> Incident:
        """An application Xid: the incident, nothing stopped, the node not drained."""
        t, _gpu, xid, _jobs = self._open(finding, sample)
        t.update(drain=False, advice=f"Xid {xid} is an application error (faults.application_xids): no drain, "
                                     "no restart; look at the job's own error output")
        t.report()
        t.finish("recorded (application Xid)")
        t.say("application Xid: incident recorded; the node is not drained and the job is watched on")
        return t.incident

    def drain(self, finding: Finding, sample: NodeSample, targets: Mapping[str, JobTarget]) -> tuple[Transcript,
                                                                                                  list[str]]:
        """Stop the supervised jobs on the faulted GPU and drain the node; returns the incident and the ids of
        the jobs stopped (the caller decides what becomes of them)."""
        ctx = self.ctx
        t, gpu, xid, jobs = self._open(finding, sample)
        hit = sorted((set(jobs) | ({finding.job_id} if finding.job_id else set())) & set(targets))
        t.update(drain=True, advice=GPU_FAULT_ADVICE, stopped_jobs=hit)
        if not ctx.cfg.recovery.enabled:
            t.record_action("none", True, "recovery disabled: no job stopped, the node not drained")
            t.report()
            t.finish("recorded (recovery disabled)")
            t.say("recovery disabled: watching on")
            return t, []
        for job_id in hit:
            # No wait for the GPU memory: a faulted GPU may never report it free, and the job runs elsewhere next.
            stop_job(ctx, t, targets[job_id], f"job {job_id}: ", wait_memory=False)
        self._drain(t, finding, gpu, xid, hit[0] if hit else "")
        t.report()
        return t, hit

    def _drain(self, t: Transcript, finding: Finding, gpu: str, xid: int | None, job_id: str) -> None:
        ctx = self.ctx
        key = gpu or finding.signature  # a node drained for a GPU is drained: once per GPU
        if key in ctx.drained:
            t.record_action("drain", True, "skipped: the node was already drained for this fault")
            return
        try:
            spec = drain_spec(ctx.cfg.faults, self.hooks)
            values = drain_values(job_id or "node", ctx.host, ctx.fallback.level(job_id) if job_id else 0, t.id,
                                  drain_reason(finding.signature, xid, gpu), gpu, xid)
        except WatchdogError as e:
            t.record_action("drain", False, f"not run: {e}")
            t.count(ActionDone("drain", False))
            t.say(f"drain: not run: {e}")
            return
        if spec is None:
            t.record_action("drain", True, "skipped: no faults.drain_command or faults.drain_hook configured")
            t.say("drain: nothing configured (faults.drain_command is empty)")
            return
        with t.step("drain", f"{spec.name}: {' '.join(spec.argv)}") as step:
            res = run_drain(spec, values)
            step.end(res.ok, res.detail())
        t.update(drain_hook=res.to_json())
        t.count(ActionDone("drain", res.ok))
        if res.ok:
            ctx.drained.add(key)
        t.say(f"drain: {res.detail()}")


def record(ctx: ActContext, hooks: Mapping[str, HookSpec], finding: Finding, sample: NodeSample) -> Incident:
    """``respond``'s "record": an incident and nothing else — an application Xid (its GPU and jobs named), launch
    settings that differ between ranks, a straggler (its section: ``finding.facts``)."""
    if finding.kind == "gpu_fault":
        return GpuFaultHandler(ctx, hooks).record(finding, sample)
    inc = ctx.open_incident(finding)
    if finding.facts:
        inc.update(**{finding.kind: dict(finding.facts)})
    inc.finish("recorded")
    return inc
