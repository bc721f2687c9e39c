"""The hooks the daemon runs for a registered job: its restart hook (a Slurm requeue only while the job is still
in the run this agent saw hang) and ``daemon.give_up_hook``. Each run is an action of the incident."""

from __future__ import annotations

import logging

from gpu_watchdog.act.events import ActionDone
from gpu_watchdog.act.hooks import run_hook
from gpu_watchdog.act.slurm import cancelled, moved_on, show_job
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.act.transcript import Transcript
from gpu_watchdog.errors import UsageError
from gpu_watchdog.model import RestartedBy
from gpu_watchdog.policy.hook_values import placeholder_values, render_argv

log = logging.getLogger("gpu_watchdog.daemon")


class RestartHooks:
    def __init__(self, ctx: ActContext) -> None:
        self.ctx = ctx  # ctx.cfg is the daemon's current config (a reload replaces it)

    def restart(self, inc: Transcript, job_id: str, hook_name: str | None, level: int, run: int | None = None) -> bool:
        """The restart hook; a Slurm requeue only while the job is still in the run this agent saw hang (another
        node's agent, or a late one, may have requeued it already: never a second requeue, never a failed hook)."""
        spec = self.ctx.cfg.hooks.get(hook_name or "")
        if spec is not None and spec.type == "slurm-requeue" and run is not None:
            job = show_job(job_id)
            if cancelled(job):
                inc.record_action("restart_hook", False, "skipped: the job was cancelled in Slurm (JobState=CANCELLED)",
                                  outcome="skipped")
                return False
            why = moved_on(job, run)
            if why:
                inc.record_action("restart_hook", False, f"skipped: {why}; restarted by another agent",
                                  outcome="skipped")
                inc.update(restarted_by=RestartedBy("another agent (Slurm)", None, run + 1).to_json())
                return False
        return self.run(inc, job_id, "restart_hook", hook_name, level)

    def run(self, inc: Transcript, job_id: str, action: str, hook_name: str | None, level: int) -> bool:
        """Run a [hooks.NAME] for this job as the incident's ``action`` (restart_hook, give_up_hook)."""
        ctx = self.ctx
        spec = ctx.cfg.hooks.get(hook_name or "")
        if spec is None:
            why = (f"{action.replace('_', ' ')} {hook_name!r} is no longer in the config" if hook_name
                   else "the job registered no restart hook")
            inc.record_action(action, False, f"not run: {why}")
            return False
        try:
            values = placeholder_values(job_id, ctx.host, level, inc.id)
        except UsageError as e:
            inc.record_action(action, False, f"not run: {e}")
            return False
        argv = render_argv(spec.argv, values)
        with inc.step(action, f"{spec.name}: {' '.join(argv)} (timeout {spec.timeout_s:g}s)") as step:
            env_file = str(ctx.fallback.root / f"{job_id}.json")
            res = run_hook(spec, values, extra_env={"GPU_WATCHDOG_FALLBACK_FILE": env_file})
            step.end(res.ok, res.detail())
        inc.update(**{action: res.to_json()})
        inc.count(ActionDone(action, res.ok))
        (log.info if res.ok else log.warning)("job %s: %s %s", job_id, action.replace("_", " "), res.detail())
        return res.ok
