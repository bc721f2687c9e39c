"""act.slurm: the requeue goes ahead only while the job is still in the run the agent saw hang."""

from __future__ import annotations

import subprocess
from typing import Any

from gpu_watchdog.act.slurm import SlurmJob, cancelled, moved_on, parse_show_job, show_job
from gpu_watchdog.config.schema import RecoveryConfig
from gpu_watchdog.policy.budget import RestartBudget

LINE = ("JobId=4242 JobName=train UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A Priority=1 Nice=0 "
        "Account=(null) QOS=normal JobState={state} Reason=None Dependency=(null) Requeue=1 Restarts={restarts} "
        "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:01:02 NodeList=n[1-2]")


def test_the_state_and_run_are_read_from_scontrol_show_job() -> None:
    assert parse_show_job(LINE.format(state="RUNNING", restarts=2)) == SlurmJob("RUNNING", 2)
    assert parse_show_job("slurm_load_jobs error: Invalid job id specified") is None


def test_a_job_already_requeued_or_in_a_newer_run_is_not_requeued_again() -> None:
    assert moved_on(SlurmJob("RUNNING", 0), 0) == ""
    assert "already in run 1" in moved_on(SlurmJob("PENDING", 1), 0)  # requeued by the other node's agent
    assert "already requeued" in moved_on(SlurmJob("REQUEUED", 0), 0)  # being requeued right now
    # the agent's own stop ends the batch step: a job that is ending or ended in this run is still requeued
    for state in ("COMPLETING", "FAILED", "COMPLETED"):
        assert moved_on(SlurmJob(state, 0), 0) == ""
    assert "already in run 1" in moved_on(SlurmJob("RUNNING", 1), 0)  # a late agent: the next run is up
    assert moved_on(None, 0) == ""  # Slurm could not say: the requeue goes ahead, as before


def test_a_cancelled_job_is_never_brought_back() -> None:
    assert cancelled(SlurmJob("CANCELLED", 0))
    assert not cancelled(SlurmJob("FAILED", 0)) and not cancelled(None)


def test_scontrol_missing_or_failing_says_nothing() -> None:
    def missing(*_a: Any, **_k: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError("scontrol")

    def ok(argv: list[str], **_k: Any) -> subprocess.CompletedProcess[str]:
        assert argv == ["scontrol", "-o", "show", "job", "4242"]
        return subprocess.CompletedProcess(argv, 0, LINE.format(state="PENDING", restarts=1), "")

    assert show_job("4242", run=missing) is None
    assert show_job("4242", run=ok) == SlurmJob("PENDING", 1)


def test_a_restart_another_agent_made_is_refunded() -> None:
    b = RestartBudget(RecoveryConfig(max_restarts=1))
    assert b.allow(0.0, None)[0]
    b.refund()
    assert b.allow(1.0, None)[0]  # the refunded restart left room for this one
