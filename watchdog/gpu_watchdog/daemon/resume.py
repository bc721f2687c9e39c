"""Finish the incidents a killed daemon left unfinished, once, when it starts again.

Rule (store/db.py): an interrupted restart hook is never re-run (a requeue or pod delete that ran twice could kill
the job's next run); interrupted idempotent steps are closed; a stop that did not complete is done again; a restart
hook that never started runs once if the job is still registered.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from gpu_watchdog.act.recovery import stop_job
from gpu_watchdog.errors import UsageError
from gpu_watchdog.store.incidents import Incident

if TYPE_CHECKING:  # typing only: the daemon calls this module, never the other way round at run time
    from gpu_watchdog.daemon.service import Daemon

log = logging.getLogger("gpu_watchdog.daemon")
RESTARTING_KINDS = ("stall", "gpu_fault", "restart")


def _close_interrupted(daemon: Daemon, inc: Incident | None, action: dict) -> None:
    note = ("interrupted by a daemon restart; not re-run (it may have taken effect)"
            if action["action"] == "restart_hook" else "interrupted by a daemon restart")
    daemon.store.end_action(action["seq"], None, f"{action['detail']}; {note}".lstrip("; "))
    if inc is None:
        return
    for e in inc.summary.get("actions", []):
        if e.get("action") == action["action"] and e.get("ok") is None and "done_at" not in e:
            e.update(ok=False, detail=f"{e.get('detail') or ''}; {note}".lstrip("; "), done_at=time.time(),
                     interrupted=True)
    inc.save()


def resume_incidents(daemon: Daemon) -> list[str]:
    done = []
    for row in daemon.store.unfinished_incidents():
        try:
            inc: Incident | None = daemon.incidents.get(row["id"])
        except UsageError:
            inc = None
        actions = daemon.store.actions(row["id"])
        for a in actions:
            if a["finished_at"] is None:
                _close_interrupted(daemon, inc, a)
        if inc is None:
            daemon.store.finish_incident(row["id"], "incident directory missing after a restart")
            continue
        hook_started = any(a["action"] == "restart_hook" for a in actions)
        gave_up = any(a["action"] == "give_up" for a in actions)
        reg = daemon.registrations().get(row["job_id"] or "")
        if hook_started:
            outcome = "resumed after a daemon restart: restart hook interrupted, not re-run"
        elif gave_up or row["kind"] not in RESTARTING_KINDS or reg is None:
            outcome = "resumed after a daemon restart: nothing left to do"
        else:
            target = daemon.target(row["job_id"], reg)
            stop_job(daemon.ctx, inc, target, "resumed: ")
            ok = target.restart(inc, daemon.fallback.level(row["job_id"]), "")
            outcome = f"resumed after a daemon restart: restart hook {'ran' if ok else 'failed or missing'}"
        inc.finish(outcome)
        log.info("incident %s: %s", row["id"], outcome)
        done.append(row["id"])
    return done
