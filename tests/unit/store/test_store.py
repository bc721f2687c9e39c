"""The daemon's SQLite store: WAL, actions logged before and after, resume rules, corrupt/unwritable files,
and housekeeping of incident directories."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
from gpu_watchdog.config.schema import Config, DaemonSettings, HookSpec
from gpu_watchdog.daemon.service import Daemon
from gpu_watchdog.export.sdnotify import Notifier
from gpu_watchdog.model import Finding, RegisteredPid, Registration
from gpu_watchdog.store.db import Store


def _daemon(state: Path, hooks: dict[str, HookSpec] | None = None, **kw: object) -> Daemon:
    cfg = Config(daemon=DaemonSettings(socket_group="", **kw), hooks=hooks or {})  # type: ignore[arg-type]
    return Daemon(cfg, cfg.daemon, state, notifier=Notifier(None))


def _finding(job: str = "j1") -> Finding:
    return Finding("stall", "idle_held", job, (0, 1), (1,), time.time() - 5, time.time())


def test_wal_and_roundtrip(tmp_path: Path) -> None:
    s = Store(tmp_path)
    assert not s.problem
    mode = sqlite3.connect(tmp_path / "daemon.sqlite3").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    s.put_job(Registration("j1", (RegisteredPid(5, 1.5, 0),), None, "requeue", True, 0))
    s.add_incident("i1", "j1", "stall", "/x")
    seq = s.begin_action("i1", "restart_hook", "argv")
    assert s.unfinished_incidents()[0]["id"] == "i1"
    assert s.actions("i1")[0]["finished_at"] is None  # logged before it runs
    s.end_action(seq, True, "exit 0")
    s.finish_incident("i1", "done")
    s.close()
    s2 = Store(tmp_path)  # survives a reopen
    assert s2.jobs()["j1"] == Registration("j1", (RegisteredPid(5, 1.5, 0),), None, "requeue", True, 0,
                                           registered_at=s2.jobs()["j1"].registered_at)
    assert s2.jobs()["j1"].registered_at > 0
    assert s2.actions("i1")[0]["ok"] is True and s2.unfinished_incidents() == []


def test_corrupt_store_is_reported_and_daemon_keeps_working(tmp_path: Path) -> None:
    (tmp_path / "daemon.sqlite3").write_bytes(b"this is not a database" * 100)
    s = Store(tmp_path)
    assert "state store unusable" in s.problem and "daemon.sqlite3" in s.problem
    s.add_incident("i1", "j", "stall", "/x")  # in memory
    assert s.unfinished_incidents()[0]["id"] == "i1"
    d = _daemon(tmp_path)
    assert "STATE STORE DEGRADED" in d.status_line()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes")
def test_unwritable_store(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        assert Store(tmp_path).problem
    finally:
        tmp_path.chmod(0o700)


def test_unwritable_store_as_root(tmp_path: Path) -> None:
    (tmp_path / "daemon.sqlite3").mkdir()  # cannot be opened as a file, even by root
    s = Store(tmp_path)
    assert "unusable" in s.problem
    s.put_job(Registration("j"))
    assert "j" in s.jobs()


def test_resume_never_reruns_an_interrupted_hook(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hook = HookSpec("h", "command", ("/bin/sh", "-c", f"echo x >> {marker}"), 5.0)
    d = _daemon(tmp_path / "state", hooks={"h": hook})
    d.register(Registration("j1", restart_hook="h"))
    inc = d.incidents.create(_finding(), "node")
    inc.begin_action("restart_hook", "h: ...")  # the daemon "died" here
    d2 = _daemon(tmp_path / "state", hooks={"h": hook})
    assert d2.resume() == [inc.id]
    assert not marker.exists()
    acts = d2.store.actions(inc.id)
    assert acts[-1]["action"] == "restart_hook" and "not re-run" in acts[-1]["detail"]
    summary = d2.incidents.get(inc.id).summary
    assert "not re-run" in summary["outcome"] and summary["actions"][-1]["interrupted"]
    assert d2.resume() == []  # finished once


def test_resume_runs_a_hook_that_never_started(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hook = HookSpec("h", "command", ("/bin/sh", "-c", f"echo x >> {marker}"), 5.0)
    d = _daemon(tmp_path / "state", hooks={"h": hook})
    d.register(Registration("j1", restart_hook="h"))
    inc = d.incidents.create(_finding(), "node")
    e = inc.begin_action("stop", "SIGTERM")  # died during the stop ladder
    del e
    d2 = _daemon(tmp_path / "state", hooks={"h": hook})
    d2.resume()
    assert marker.read_text() == "x\n"
    acts = [a["action"] for a in d2.store.actions(inc.id)]
    assert acts == ["stop", "stop", "restart_hook"]


def test_failing_and_missing_hooks_are_recorded(tmp_path: Path) -> None:
    hook = HookSpec("h", "command", ("/bin/sh", "-c", "echo nope; exit 7"), 5.0)
    d = _daemon(tmp_path / "state", hooks={"h": hook})
    inc = d.ctx.transcript(d.incidents.create(_finding(), "node"))
    assert not d.hooks.restart(inc, "j1", "h", 1)
    assert not d.hooks.restart(inc, "j1", "gone", 1)
    acts = d.store.actions(inc.id)
    assert "exit 7" in acts[0]["detail"] and "nope" in acts[0]["detail"] and acts[0]["ok"] is False
    assert "no longer in the config" in acts[1]["detail"]
    assert d.incidents.get(inc.id).summary["restart_hook"]["exit_code"] == 7


def test_housekeeping_by_age_and_size(tmp_path: Path) -> None:
    d = _daemon(tmp_path / "state", incident_max_age_days=1.0, incident_max_total_mb=1.0)
    old, big, new, active = (d.incidents.create(_finding(f"j{i}"), "n") for i in range(4))
    for inc in (old, big, new):
        d.store.finish_incident(inc.id, "done")
    now = time.time()
    os.utime(old.dir / "summary.json", (now - 3 * 86400, now - 3 * 86400))
    (big.dir / "blob").write_bytes(b"x" * (2 << 20))
    os.utime(big.dir / "summary.json", (now - 3600, now - 3600))
    os.utime(active.dir / "summary.json", (now - 9 * 86400, now - 9 * 86400))
    removed = d.housekeeping(now)
    assert set(removed) == {old.id, big.id}
    assert new.dir.exists() and active.dir.exists()  # an unfinished incident is never removed
    assert {r["id"] for r in d.store.incidents()} == {new.id, active.id}


def test_restart_budget_survives_a_daemon_restart_and_the_jobs_requeue(tmp_path: Path) -> None:
    """The budget is what stops a restart loop: neither the daemon's own restart nor the job's requeue
    (job-end from the epilog, job-start under the same id) may hand the job a fresh one."""
    cfg = Config().recovery
    d = _daemon(tmp_path / "state")
    reg = Registration("j1")
    d.register(reg)
    now = time.time()
    for i in range(cfg.max_restarts):
        assert d.acts.budget("j1").allow(now + i, hang_step=10 * (i + 1)) == (True, "")
    d.unregister("j1")  # the epilog
    d.register(reg)  # the requeued job's prolog
    allowed, why = d.acts.budget("j1").allow(now + 10, hang_step=100)
    assert not allowed and f"recovery.max_restarts = {cfg.max_restarts}" in why
    d.store.close()

    again = _daemon(tmp_path / "state")  # a new daemon process on the same state dir
    b = again.acts.budget("j1")
    assert len(b.restarts) == cfg.max_restarts and b.last_hang_step == 100
    assert not b.allow(now + 11, hang_step=110)[0]
    # Past the window the restarts no longer count, and housekeeping forgets the untouched budget.
    assert again.acts.budget("j1").allow(now + cfg.restart_window_s + 20, hang_step=120) == (True, "")
    assert again.store.budget("j1") is not None
    again.housekeeping(time.time() + 2 * cfg.restart_window_s + 60)
    assert again.store.budget("j1") is None
    assert again.acts.budget("j1").restarts == []


def test_restart_budget_counts_hangs_that_make_no_progress_across_restarts(tmp_path: Path) -> None:
    cfg = Config().recovery
    d = _daemon(tmp_path / "state")
    now = time.time()
    assert d.acts.budget("j2").allow(now, hang_step=7)[0]
    d.store.close()
    d2 = _daemon(tmp_path / "state")
    for i in range(1, cfg.max_no_progress_restarts):
        assert d2.acts.budget("j2").allow(now + i, hang_step=7)[0]
    allowed, why = d2.acts.budget("j2").allow(now + 50, hang_step=7)
    assert not allowed and "without passing step 7" in why
