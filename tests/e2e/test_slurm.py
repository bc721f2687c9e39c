"""gpu-watchdog under a real Slurm (munged + slurmctld + slurmd on 127.0.0.1, tests/support/slurm_cluster.py):
3-rank gloo sbatch + torchrun jobs (gpu_watchdog.demo.train: a P2P hang that NCCL_P2P_DISABLE=1 cures, a
checkpoint every step, resume from it), the shipped TaskProlog/Epilog as the only integration, the daemon with
a ``slurm-requeue`` hook. One cluster and one daemon for the module.

Needs root (munged, slurmd); skipped without it, but in CI (``CI=true``) a missing Slurm fails the tests.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import DaemonProc, short_dir, wait_for
from repo_paths import REPO
from slurm_cluster import SlurmCluster, require, slurm_missing_reason
from slurm_site import SCRIPTS, events, job_env, wait_settled, write_epilog

pytestmark = pytest.mark.slow
DETECT_LIMIT_S = 15.0  # issue 16: a hang found at most this long after its onset


class Site:
    """The cluster, the daemon and what a job needs to reach it."""

    def __init__(self, base: Path, cluster: SlurmCluster) -> None:
        self.base = base
        self.cluster = cluster
        self.config = base / "config.toml"
        self.config.write_text(f"""
[agent]
interval_s = 0.5
backend = "proc"
state_dir = "{base / 'state'}"

[recovery]
stop_grace_s = 3.0
checkpoint_grace_s = 20.0
max_restarts = 1

[daemon]
control_socket = "{base / 'control.sock'}"
socket_group = ""
housekeeping_interval_s = 600.0
give_up_hook = "slurm-give-up"

[hooks.slurm-requeue]
type = "slurm-requeue"
timeout_s = 30

[hooks.slurm-give-up]
type = "slurm-give-up"
timeout_s = 30
""")
        self.daemon = self.start_daemon()

    def start_daemon(self) -> DaemonProc:
        d = DaemonProc(self.base, self.config, env=self.cluster.env)  # scontrol needs SLURM_CONF and PATH
        d.wait_socket()
        return d

    def job_env(self) -> dict[str, str]:
        """What the submitting shell exports (sbatch --export=ALL): where gpu-watchdog and its socket are."""
        return job_env(self.cluster.env, GPU_WATCHDOG_SOCKET=self.daemon.socket)

    def submit(self, name: str, train_args: str, *, pre: str = "", program: str = "-m gpu_watchdog.demo.train",
               background: bool = False, sbatch_args: tuple[str, ...] = ()) -> tuple[str, Path]:
        """A batch script that is only torchrun (after ``pre``): 3 gloo ranks of ``program``."""
        work = self.base / name
        work.mkdir()
        script = work / "job.sh"
        if program.startswith("-m gpu_watchdog.demo.train"):
            train_args = f"--ckpt-dir {work} --step-s 0.05 {train_args}"
            train_args = train_args if "--steps" in train_args else f"{train_args} --steps 16"
        run = f"torchrun --standalone --nproc-per-node 3 {program} --events {work / 'events.jsonl'} {train_args}"
        if background:  # the --signal pattern of docs/slurm.md: bash runs a trap only between commands
            run = (f"{run} &\ntrainer=$!\ntrap '{SCRIPTS / 'preempt.sh'}; exit $?' USR1\n"
                   f"wait \"$trainer\"")
        script.write_text(f"#!/bin/bash\n{pre}\n{run}\n")
        job_id = self.cluster.sbatch(script, "-J", name, "-c", "3", "-o", str(work / "out.log"),
                                     "--open-mode=append", *sbatch_args, env=self.job_env())
        return job_id, work

    def incidents(self, job_id: str) -> list[dict[str, Any]]:
        rows = self.daemon.call("incidents", limit=100, check=False).get("incidents") or []
        out = []
        for r in rows:
            if r.get("job_id") != job_id:
                continue
            try:
                out.append({**json.loads((Path(r["dir"]) / "summary.json").read_text()), "row": r})
            except (OSError, ValueError):
                continue
        return out

    def wait_end(self, job_id: str, work: Path, timeout: float) -> dict[str, str]:
        """The job's final state, every incident of it finished (slurm_site.wait_settled)."""
        return wait_settled(lambda: self.cluster.job(job_id),
                            lambda: any(i["row"].get("outcome") is None for i in self.incidents(job_id)), timeout,
                            f"job {job_id} to end", lambda: self.why(job_id, work))

    def why(self, job_id: str, work: Path) -> str:
        out = (work / "out.log").read_text(errors="replace")[-3000:] if (work / "out.log").exists() else ""
        return f"job {self.cluster.job(job_id)}\n--- job output\n{out}\n--- daemon\n{self.daemon.log_text()}"


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    require(slurm_missing_reason(), "real-Slurm tests")
    base = short_dir()
    epilog = write_epilog(base / "epilog.sh", base / "control.sock")
    cluster = SlurmCluster(base / "slurm", task_prolog=str(SCRIPTS / "task_prolog.sh"), epilog=str(epilog))
    t0 = time.monotonic()
    cluster.start()
    s = None
    try:
        s = Site(base, cluster)
        print(f"slurm cluster up in {cluster.startup_s:.1f}s, daemon in {time.monotonic() - t0:.1f}s")
        yield s
    finally:
        if s is not None:
            for job in cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
                cluster.cancel(job)
            s.daemon.kill(signal.SIGTERM)
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def jobs(site: Site) -> dict[str, tuple[str, Path]]:
    """The module's jobs, submitted together (they run side by side: one wait instead of four)."""
    return {
        "hang": site.submit("hang", "--hang-at 5 --hang-rank 1"),
        "healthy": site.submit("healthy", "--hang-at 0"),
        "client": site.submit("client", "--hang-at 5 --hang-rank 1 --client"),
        "always": site.submit("always", "--hang-at 4 --hang-rank 2 --hang-always"),
        "preempt": site.submit("preempt", "--hang-at 0 --client --steps 200", background=True),
        # rank 0 writes a checkpoint for 10 s while its peers wait in barrier: a legit pause
        "save": site.submit("save", f"--scenario save --pause-s 10 --step-at 3 --steps 5 --workdir {site.base}",
                            program=str(REPO / "tests" / "jobs" / "train.py")),
    }


def _one_stall(site: Site, job_id: str) -> dict[str, Any]:
    incs = [i for i in site.incidents(job_id) if i.get("kind") == "stall"]
    assert len(incs) == 1, incs
    return incs[0]


def test_a_preempted_job_checkpoints_and_is_requeued(site: Site, jobs) -> None:
    """First in the module: the signal must reach the job while it trains (the other jobs run meanwhile).
    USR1 to the batch shell (what `--signal=B:USR1@N` sends): the trap runs preempt.sh, the in-job clients
    save at a step boundary, `scontrol requeue`; the rerun resumes from that checkpoint and ends COMPLETED."""
    job_id, work = jobs["preempt"]
    wait_for(lambda: len([e for e in events(work) if e["event"] == "step"]) >= 9, 200, "three steps",
             lambda: site.why(job_id, work), poll=0.5)
    sent = site.cluster.run("scancel", "--signal=USR1", "--batch", job_id, check=False)
    assert sent.returncode == 0, (sent.stderr, site.why(job_id, work))
    info = site.wait_end(job_id, work, 300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", site.why(job_id, work)
    ev = events(work)
    saved = [e["step"] for e in ev if e["event"] == "checkpoint"]
    starts = [e for e in ev if e["event"] == "start"]
    assert len(saved) == 1 and len(starts) == 6 and {e["step"] for e in starts[3:]} == set(saved), ev
    assert len([e for e in ev if e["event"] == "done"]) == 3, ev
    incs = site.incidents(job_id)
    assert incs == [], f"{json.dumps(incs, indent=1)}\n{site.why(job_id, work)}"  # a preemption is no stall


def test_sbatch_torchrun_hang_is_requeued_with_the_fallback_and_completes(site: Site, jobs) -> None:
    """The acceptance path of issue 16 with a batch script that is only torchrun: registered by the TaskProlog,
    the hang found <= 15 s after its onset (the batch shell's SLURM_PROCID=0 is no rank), `scontrol requeue`,
    the rerun gets NCCL_P2P_DISABLE=1 from the TaskProlog, resumes from its checkpoint and ends COMPLETED."""
    hung, work = jobs["hang"]
    info = site.wait_end(hung, work, 300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", site.why(hung, work)
    ev = events(work)
    onset = [e for e in ev if e["event"] == "hang_onset"]
    starts = [e for e in ev if e["event"] == "start"]
    assert len(onset) == 1 and len(starts) == 6, ev
    inc = _one_stall(site, hung)
    assert inc["detected_at"] - onset[0]["t"] <= DETECT_LIMIT_S, (inc["detected_at"] - onset[0]["t"], inc)
    assert inc.get("culprit_ranks") == [1], inc
    assert inc["row"]["outcome"] == "restart hook ran", inc["row"]
    rerun = starts[3:]
    assert {e["nccl_p2p_disable"] for e in rerun} == {"1"}, rerun  # the fallback env reached the rerun
    assert {e["step"] for e in rerun} == {onset[0]["step"] - 1}, rerun  # resumed from its checkpoint
    assert len([e for e in ev if e["event"] == "done"]) == 3, ev


@pytest.mark.parametrize("name", ["healthy", "save"])
def test_healthy_sbatch_jobs_are_never_touched(site: Site, jobs, name: str) -> None:
    """A healthy job, and one whose rank 0 saves for 10 s while the others wait: COMPLETED, never requeued."""
    job_id, work = jobs[name]
    info = site.wait_end(job_id, work, 200)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", site.why(job_id, work)
    assert site.incidents(job_id) == []
    if name == "save":
        assert [e for e in events(work) if e["event"] == "pause_end"], events(work)


def test_a_requeued_job_with_the_client_trains_on(site: Site, jobs) -> None:
    """With the in-job client the ranks checkpoint on the daemon's request and exit 85; the requeued run has a
    control directory of its own (run-1), so it never reads the old request and trains to the end."""
    job_id, work = jobs["client"]
    info = site.wait_end(job_id, work, 300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", site.why(job_id, work)
    inc = _one_stall(site, job_id)
    acts = {a["action"]: a for a in inc["row"]["actions"]}
    assert acts["checkpoint"]["ok"], inc["row"]["actions"]
    ev = events(work)
    starts = [e for e in ev if e["event"] == "start"]
    saved = [e["step"] for e in ev if e["event"] == "checkpoint"]
    assert len(starts) == 6 and saved and {e["step"] for e in starts[3:]} == {max(saved)}, ev
    assert len([e for e in ev if e["event"] == "done"]) == 3, ev


def test_an_always_hanging_job_is_given_up_with_a_slurm_reason(site: Site, jobs) -> None:
    """max_restarts = 1: requeued once, hangs again, given up: stopped, not requeued, and its Slurm comment
    says why (daemon.give_up_hook, type slurm-give-up)."""
    job_id, work = jobs["always"]
    info = site.wait_end(job_id, work, 300)
    assert info["JobState"] != "COMPLETED" and info["Restarts"] == "1", site.why(job_id, work)
    shown = site.cluster.run("scontrol", "show", "job", job_id).stdout
    assert "Comment=gpu-watchdog: gave up, the job kept hanging" in shown, shown
    incs = sorted((i for i in site.incidents(job_id) if i.get("kind") == "stall"), key=lambda i: i["detected_at"])
    assert [i["row"]["outcome"] for i in incs] == ["restart hook ran",
                                                    "gave up: restart budget spent (no restart hook run)"], incs


def test_a_daemon_killed_before_its_requeue_hook_requeues_once_with_the_level(site: Site, jobs) -> None:
    """SIGKILL of the daemon while it stops the job (the batch shell ignores SIGTERM, so the stop takes
    stop_grace_s): the restarted daemon resumes the incident, stops the job and runs the requeue hook once; the
    rerun gets the fallback level that was stored before the stop."""
    for other, work in jobs.values():  # the others are done: only this job's incident is in flight
        site.wait_end(other, work, 300)
    job_id, work = site.submit("sigkill", "--hang-at 5 --hang-rank 1", pre="trap '' TERM")

    def stopping() -> bool:
        for i in site.incidents(job_id):
            acts = i["row"]["actions"]
            if any(a["action"] == "stop" and a["finished_at"] is None for a in acts):
                return True
        return False

    wait_for(stopping, 240, "the daemon to start stopping the job", lambda: site.why(job_id, work), poll=0.2)
    site.daemon.kill(signal.SIGKILL)
    site.daemon = site.start_daemon()
    info = site.wait_end(job_id, work, 300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", site.why(job_id, work)
    inc = _one_stall(site, job_id)
    assert inc["row"]["outcome"] == "resumed after a daemon restart: restart hook ran", inc["row"]
    starts = [e for e in events(work) if e["event"] == "start"]
    assert len(starts) == 6 and {e["nccl_p2p_disable"] for e in starts[3:]} == {"1"}, starts
