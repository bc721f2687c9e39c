"""Finish the incidents a killed daemon left unfinished, once, when it starts again.

Rule (store/db.py): an interrupted restart hook is never re-run (a requeue or pod delete that ran twice could kill
the job's next run); interrupted idempotent steps are closed; a stop that did not complete is done again; a restart
hook that never started runs once if the job is still registered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gpu_watchdog.act.recovery import stop_job
from gpu_watchdog.act.target import ActContext, JobTarget
from gpu_watchdog.errors import UsageError
from gpu_watchdog.store.db import Store
from gpu_watchdog.store.incidents import Incident

log = logging.getLogger("gpu_watchdog.daemon")
RESTARTING_KINDS = ("stall", "gpu_fault", "restart")


def _close_interrupted(store: Store, inc: Incident | None, action: dict) -> None:
    note = ("interrupted by a daemon restart; not re-run (it may have taken effect)"
            if action["action"] == "restart_hook" else "interrupted by a daemon restart")
    store.end_action(action["seq"], None, f"{action['detail']}; {note}".lstrip("; "))
    if inc is None:
        return
    for e in inc.summary.get("actions", []):
        if e.get("action") == action["action"] and e.get("ok") is None and "done_at" not in e:
            e.update(ok=False, detail=f"{e.get('detail') or ''}; {note}".lstrip("; "), done_at=time.time(),
                     interrupted=True)
    inc.save()


def resume_incidents(store: Store, ctx: ActContext, registered: Callable[[str], JobTarget | None]) -> list[str]:
    """Finish what the journal (``store``) shows unfinished; ``registered(job_id)``: the job's target while it is
    still registered, else None."""
    done = []
    for row in store.unfinished_incidents():
        try:
            inc: Incident | None = ctx.incidents.get(row["id"])
        except UsageError:
            inc = None
        actions = store.actions(row["id"])
        for a in actions:
            if a["finished_at"] is None:
                _close_interrupted(store, inc, a)
        if inc is None:
            store.finish_incident(row["id"], "incident directory missing after a restart")
            continue
        hook_started = any(a["action"] == "restart_hook" for a in actions)
        gave_up = any(a["action"] == "give_up" for a in actions)
        target = registered(row["job_id"] or "")
        if hook_started:
            outcome = "resumed after a daemon restart: restart hook interrupted, not re-run"
        elif gave_up or row["kind"] not in RESTARTING_KINDS or target is None:
            outcome = "resumed after a daemon restart: nothing left to do"
        else:
            t = ctx.transcript(inc)
            stop_job(ctx, t, target, "resumed: ")
            ok = target.restart(t, ctx.fallback.level(row["job_id"]), "")
            outcome = f"resumed after a daemon restart: restart hook {'ran' if ok else 'failed or missing'}"
        inc.finish(outcome)
        log.info("incident %s: %s", row["id"], outcome)
        done.append(row["id"])
    return done
