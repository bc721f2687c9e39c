"""Job-configuration consistency: ranks launched with different NCCL / world settings are caught at start.

Unit tests of ``check_ranks`` (the digest is stable and names what differs), of the launcher's check
(exported digest, one incident per distinct mismatch, the environment read after an exec wrapper), and
two real 4-rank gloo jobs under ``gpu-watchdog launch``: one where rank 3 was started through
``tests/jobs/skewed_env.py`` with ``NCCL_P2P_DISABLE=1`` (flagged before its first training step), and the
same job without the skew (not flagged).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.act.events import IncidentOpened
from gpu_watchdog.config.schema import AgentConfig, Config
from gpu_watchdog.detect.consistency import (
    CROSS_NODE_EVERY_S,
    CROSS_NODE_S,
    ConfigWatch,
    check_nodes,
    check_ranks,
    relevant,
    run_key,
)
from gpu_watchdog.launch.launcher import Launcher
from gpu_watchdog.model import JobStatus, NodeSample
from gpu_watchdog.store.job_runs import JobRuns
from launch_harness import base_env, read_events, start_launch, torchrun, write_config
from repo_paths import REPO

SKEWED = REPO / "tests" / "jobs" / "skewed_env.py"
TRAIN = REPO / "tests" / "jobs" / "train.py"
CLI = str(Path(sys.executable).with_name("gpu-watchdog"))

BASE = {"NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def rank_env(rank: int, **extra: str) -> dict[str, str]:
    """What a rank's environment looks like: the shared settings plus per-rank noise that must not count."""
    return {**BASE, "RANK": str(rank), "LOCAL_RANK": str(rank), "PATH": f"/p{rank}", "HOSTNAME": "n1",
            "NCCL_DEBUG_FILE": f"/tmp/nccl.{rank}.log", **extra}


# == check_ranks =============================================================================================
def test_consistent_ranks_share_a_digest_independent_of_rank_order_and_noise() -> None:
    a = check_ranks({r: rank_env(r) for r in range(4)})
    b = check_ranks({r: rank_env(r) for r in (3, 1, 0, 2)})
    assert a.consistent and b.consistent and a.differences == () and a.summary == "consistent"
    assert a.digest == b.digest and len(a.digest) == 16 and int(a.digest, 16) >= 0
    # The digest is of the settings, not of the ranks: another node of the job (ranks 4-7) matches.
    assert check_ranks({r: rank_env(r) for r in range(4, 8)}).digest == a.digest
    # A node of the same job with a different setting does not.
    assert check_ranks({r: rank_env(r, NCCL_PROTO="Simple") for r in range(4, 8)}).digest != a.digest


def test_only_the_launch_settings_count() -> None:
    env = {**BASE, "NCCL_P2P_DISABLE": "1", "TORCH_NCCL_BLOCKING_WAIT": "1", "NPROC_PER_NODE": "4",
           "MY_NCCL_THING": "x", "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "RANK": "0", "NCCL_DEBUG_FILE": "/x"}
    assert set(relevant(env)) == {*BASE, "NCCL_P2P_DISABLE", "TORCH_NCCL_BLOCKING_WAIT", "NPROC_PER_NODE"}


def test_differences_are_named() -> None:
    envs = {r: rank_env(r) for r in range(4)}
    envs[3]["NCCL_P2P_DISABLE"] = "1"
    envs[2]["LOCAL_WORLD_SIZE"] = "8"
    rep = check_ranks(envs)
    assert not rep.consistent
    assert rep.differences == ("LOCAL_WORLD_SIZE: ranks 0,1,3=4, rank 2=8",
                               "NCCL_P2P_DISABLE: ranks 0,1,2=(unset), rank 3=1")
    assert rep.summary == "; ".join(rep.differences)
    # Stable too, and never equal to a consistent node's digest.
    again = check_ranks({r: envs[r] for r in (2, 0, 3, 1)})
    assert again.digest == rep.digest and again.differences == rep.differences
    assert rep.digest != check_ranks({r: rank_env(r) for r in range(4)}).digest
    assert rep.digest != check_ranks({r: {**rank_env(r), "NCCL_P2P_DISABLE": "1"} for r in range(4)}).digest


def test_no_ranks_and_one_rank_are_consistent() -> None:
    assert check_ranks({}).consistent
    assert check_ranks({0: rank_env(0)}).consistent


# == the launcher's check ====================================================================================
class Metrics:
    def __init__(self) -> None:
        self.configs: list[tuple[str, str]] = []
        self.incidents: list[str] = []

    def job_config(self, job_id: str, digest: str) -> None:
        self.configs.append((job_id, digest))

    def count(self, event: object) -> None:
        if isinstance(event, IncidentOpened):
            self.incidents.append(event.kind)


class Scanner:
    def __init__(self, envs: dict[int, dict[str, str]]) -> None:
        self.envs = envs

    def env_of(self, pid: int) -> dict[str, str]:
        return self.envs.get(pid, {})


PIDS = {r: 4_000_000 + r for r in range(4)}  # no such processes: the scanner's copies are used


class Checked:
    """A Launcher that never starts its job, and the engine's launch-settings check over a stand-in backend whose
    scanner holds ``envs``; each check's finding goes where the launcher sends it (an incident)."""

    def __init__(self, tmp_path: Path, job_id: str, envs: dict[int, dict[str, str]], metrics: Metrics) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from gpu_watchdog.engine.loop import Engine

        cfg = Config(agent=AgentConfig(hostname="n1"))
        self.backend = type("B", (), {"scanner": Scanner(envs)})()
        self.lc = Launcher(cfg, ["true"], state_dir=tmp_path, job_id=job_id, out=io.StringIO(), metrics=metrics)
        self.engine = Engine(cfg, self.backend, self.lc.fallback, ThreadPoolExecutor(1), health=self.lc.health,
                             metrics=metrics)
        self.incidents = self.lc.incidents
        self.config_watch = self.engine.config_watch(job_id)

    def check(self, _backend: Any, status: JobStatus, t: float) -> None:
        finding = self.engine.check_launch_settings(status, t)
        if finding is not None:
            self.lc.record(finding, NodeSample(t, "n1", "proc", (), ()))


def launcher_with(tmp_path: Path, job_id: str, envs: dict[int, dict[str, str]]) -> tuple[Checked, Any, Metrics]:
    metrics = Metrics()
    checked = Checked(tmp_path, job_id, envs, metrics)
    return checked, checked.backend, metrics


def test_launcher_check_exports_the_digest_and_records_one_incident_per_mismatch(tmp_path: Path) -> None:
    pids = PIDS
    envs = {pids[r]: rank_env(r) for r in range(4)}
    lc, backend, metrics = launcher_with(tmp_path, "job-c", envs)
    status = JobStatus("job-c", ranks=(0, 1, 2, 3), rank_pids=pids)
    lc.check(backend, status, 100.0)
    assert lc.incidents.list() == [] and metrics.configs[-1] == ("job-c", check_ranks(
        {r: rank_env(r) for r in range(4)}).digest)
    envs[pids[3]]["NCCL_P2P_DISABLE"] = "1"
    lc.check(backend, status, 101.0)
    assert lc.incidents.list() == []  # seen once: maybe a rank read before it exec'd
    lc.check(backend, status, 102.0)
    lc.check(backend, status, 103.0)  # the same mismatch again: no second incident
    [inc] = lc.incidents.list()
    assert (inc["kind"], inc["signature"], inc["job_id"], inc["detected_at"]) == ("config_mismatch", "env_mismatch",
                                                                                  "job-c", 102.0)
    assert inc["ranks"] == [0, 1, 2, 3] and inc["evidence"] == "process"
    assert "NCCL_P2P_DISABLE: ranks 0,1,2=(unset), rank 3=1" in inc["reason"]
    assert metrics.incidents == ["config_mismatch"] and metrics.configs[-1][1] != metrics.configs[0][1]


def test_one_more_rank_with_the_same_mismatch_is_not_a_second_incident(tmp_path: Path) -> None:
    """Seen in CI: the check ran on ranks 0,1,3 (rank 2 not identified yet), then again on all four. The
    disagreement (NCCL_P2P_DISABLE unset vs 1) is the same, so there is one incident; and while
    LOCAL_WORLD_SIZE says more ranks are coming, the launcher waits for them before comparing."""
    three = check_ranks({r: {**rank_env(r), **({"NCCL_P2P_DISABLE": "1"} if r == 3 else {})} for r in (0, 1, 3)})
    four = check_ranks({r: {**rank_env(r), **({"NCCL_P2P_DISABLE": "1"} if r == 3 else {})} for r in range(4)})
    assert three.digest != four.digest and three.mismatch == four.mismatch == (("NCCL_P2P_DISABLE", ("(unset)", "1")),)
    pids = PIDS
    envs = {pids[r]: rank_env(r) for r in range(4)}
    envs[pids[3]]["NCCL_P2P_DISABLE"] = "1"
    lc, backend, _ = launcher_with(tmp_path, "job-d", envs)
    partial = JobStatus("job-d", ranks=(0, 1, 3), rank_pids={r: pids[r] for r in (0, 1, 3)})
    full = JobStatus("job-d", ranks=(0, 1, 2, 3), rank_pids=pids)
    watch = ConfigWatch()
    env_of = backend.scanner.env_of
    assert not watch.due(partial.rank_pids, env_of, 10.0) and not watch.due(partial.rank_pids, env_of, 11.0)
    assert watch.due(partial.rank_pids, env_of, 20.0)  # LOCAL_WORLD_SIZE=4, but nobody else came in 10 s
    assert not watch.due(full.rank_pids, env_of, 21.0) and watch.due(full.rank_pids, env_of, 22.0)
    assert watch.due(full.rank_pids, env_of, 23.0) and watch.due(full.rank_pids, env_of, 51.9)  # settling
    assert not watch.due(full.rank_pids, env_of, 52.0)  # CONFIG_SETTLE_S after the first comparison: done
    lc.check(backend, partial, 100.0)
    lc.check(backend, full, 101.0)
    lc.check(backend, full, 102.0)
    [inc] = lc.incidents.list()
    assert inc["detected_at"] == 101.0 and "ranks 0,1,2=(unset), rank 3=1" in inc["reason"]
    envs[pids[1]]["NCCL_PROTO"] = "Simple"  # a new disagreement is news
    lc.check(backend, full, 103.0)
    lc.check(backend, full, 104.0)
    assert len(lc.incidents.list()) == 2


def test_a_rank_read_before_its_wrapper_execd_is_not_a_mismatch(tmp_path: Path) -> None:
    """``export NCCL_IB_HCA=…; exec python train.py`` in a wrapper: until the exec, /proc shows the wrapper's
    inherited environment. One comparison that catches rank 2 there is no incident, and the digest the
    node exports ends on the settings the ranks really run with."""
    pids = PIDS
    final = {pids[r]: {**rank_env(r), "NCCL_IB_HCA": "mlx5_0"} for r in range(4)}
    envs = {**final, pids[2]: rank_env(2)}  # rank 2 has not exec'd yet
    lc, backend, metrics = launcher_with(tmp_path, "job-w", envs)
    status = JobStatus("job-w", ranks=(0, 1, 2, 3), rank_pids=pids)
    watch, t = lc.config_watch, 10.0
    while not watch.due(pids, backend.scanner.env_of, t):
        t += 1.0
    lc.check(backend, status, t)
    envs[pids[2]] = final[pids[2]]  # it exec'd
    assert watch.due(pids, backend.scanner.env_of, t + 1.0)
    lc.check(backend, status, t + 1.0)
    assert lc.incidents.list() == []
    assert metrics.configs[-1] == ("job-w", check_ranks({r: final[pids[r]] for r in range(4)}).digest)
    assert metrics.configs[0][1] != metrics.configs[-1][1]


def test_the_daemon_checks_every_jobs_ranks_and_reports_a_mismatch_once(tmp_path: Path) -> None:
    from gpu_watchdog.config.schema import DaemonSettings
    from gpu_watchdog.daemon.service import Daemon
    from gpu_watchdog.export.metrics import AgentMetrics
    from gpu_watchdog.export.sdnotify import Notifier
    from gpu_watchdog.model import JobIdentity, NodeSample, ProcessSample

    pids = {r: 4_100_000 + r for r in range(4)}  # no such processes: the scanner's copies are used
    envs = {pids[r]: rank_env(r) for r in range(4)}
    envs[pids[2]]["NCCL_P2P_DISABLE"] = "1"

    class Node:
        name = "fake"
        scanner = Scanner(envs)
        jobs = True

        def sample(self) -> NodeSample:
            procs = tuple(ProcessSample(pid, 1.0, 1, "sleeping", 1.0, 0, 1 << 20,
                                        job=JobIdentity("jm", rank=r, local_rank=r, world_size=4), is_rank=True)
                          for r, pid in pids.items()) if self.jobs else ()
            return NodeSample(t=time.time(), hostname="n1", backend="fake", processes=procs)

        def close(self) -> None:
            pass

    node, metrics = Node(), AgentMetrics()
    d = Daemon(Config(), DaemonSettings(socket_group=""), tmp_path, backend=node,  # type: ignore[arg-type]
               metrics=metrics, notifier=Notifier(None))
    for _ in range(5):
        d.tick()
    d.wait_idle()
    [inc] = d.incidents.list()
    assert (inc["kind"], inc["job_id"], inc["ranks"]) == ("config_mismatch", "jm", [0, 1, 2, 3])
    assert "NCCL_P2P_DISABLE: ranks 0,1,3=(unset), rank 2=1" in inc["reason"], inc
    assert inc["outcome"] and d.store.unfinished_incidents() == []
    assert metrics.job_configs()["jm"] == check_ranks({r: envs[pids[r]] for r in range(4)}).digest
    node.jobs = False  # the job ended: its digest is no longer exported
    d.tick()
    assert "jm" not in metrics.job_configs()


# == real jobs under launch ==================================================================================
def skewed_job_argv(events: Path, workdir: Path, steps: int = 8) -> list[str]:
    argv = [torchrun(), "--standalone", "--nproc-per-node", "4", str(SKEWED), str(TRAIN), "--scenario", "healthy",
            "--steps", str(steps), "--step-s", "0.05", "--events", str(events), "--workdir", str(workdir)]
    timeout_bin = shutil.which("timeout")
    return [timeout_bin, "-s", "KILL", "240", *argv] if timeout_bin else argv


def run_job(tmp_path: Path, job_id: str, skew_rank: str) -> tuple[int, Any, list[dict[str, Any]]]:
    events = tmp_path / "events.jsonl"
    cfg = write_config(tmp_path / "watchdog.toml", {"agent": {"interval_s": 0.25}})  # flagged before step 1
    env = {**base_env(), "SKEW_RANK": skew_rank}
    env.pop("NCCL_P2P_DISABLE", None)
    run = start_launch(["--backend", "proc", "--config", str(cfg)], skewed_job_argv(events, tmp_path), env=env,
                       tmp_path=tmp_path, job_id=job_id, max_lifetime_s=240)
    try:
        rc = run.wait(timeout=200)
    finally:
        run.kill([e["pid"] for e in read_events(events) if "pid" in e])
    return rc, run, read_events(events)


@pytest.mark.slow
def test_a_rank_started_with_a_different_nccl_p2p_disable_is_flagged_at_start(tmp_path: Path) -> None:
    rc, run, events = run_job(tmp_path, "skewed", skew_rank="3")
    out = run.output()
    assert rc == 0, out[-3000:]  # gloo ignores NCCL settings: the job itself runs to the end
    incs = run.incidents()
    assert [(i["kind"], i["signature"]) for i in incs] == [("config_mismatch", "env_mismatch")], incs
    inc = incs[0]
    assert inc["job_id"] == "skewed" and inc["ranks"] == [0, 1, 2, 3]
    assert "NCCL_P2P_DISABLE: ranks 0,1,2=(unset), rank 3=1" in inc["reason"], inc["reason"]
    first_step = min(e["t"] for e in events if e["event"] == "step")
    print(f"mismatch detected {first_step - inc['detected_at']:.2f}s before the first step")
    assert inc["detected_at"] < first_step, (inc["detected_at"], first_step)  # before any training happened
    assert "WARNING: ranks were launched with different settings" in out
    listed = json.loads(subprocess.run([CLI, "incidents", "--json", "--state-dir", str(run.state_dir)],
                                       capture_output=True, text=True, check=True).stdout)
    assert [i["kind"] for i in listed] == ["config_mismatch"]


@pytest.mark.slow
def test_the_same_job_without_the_skew_is_not_flagged(tmp_path: Path) -> None:
    rc, run, events = run_job(tmp_path, "even", skew_rank="none")
    assert rc == 0, run.output()[-3000:]
    assert len([e for e in events if e["event"] == "done"]) == 4
    assert run.incidents() == [], run.incidents()
    assert "different settings" not in run.output()


# ---- across nodes (fallback.shared_dir) -----------------------------------------------------------------

def test_launch_settings_are_compared_across_nodes_run_by_run(tmp_path: Path) -> None:
    """The seed's multi-node failure: node 1 started with NPROC_PER_NODE=2, node 2 with 4 and NCCL_PROTO=Simple. Each
    node's ranks agree among themselves; across the nodes the difference is named with its nodes and ranks."""
    n1 = {r: {"NPROC_PER_NODE": "2", "WORLD_SIZE": "6", "NCCL_SOCKET_IFNAME": "eth0"} for r in (0, 1)}
    n2 = {r: {"NPROC_PER_NODE": "4", "WORLD_SIZE": "6", "NCCL_PROTO": "Simple", "NCCL_SOCKET_IFNAME": "ens5"}
          for r in (2, 3, 4, 5)}
    JobRuns(tmp_path, "node2").publish_settings("job-7", "0", n2)
    JobRuns(tmp_path, "node2").publish_settings("job-7", "1", n1 | {})  # another run: not compared with run 0
    peers = JobRuns(tmp_path, "node1").peer_settings("job-7", "0")
    assert list(peers) == ["node2"] and peers["node2"] == n2
    report = check_nodes({"node1": n1, **peers})
    assert not report.consistent
    assert report.differences == ("NCCL_PROTO: node1 (ranks 0,1)=(unset), node2 (ranks 2-5)=Simple",
                                  "NPROC_PER_NODE: node1 (ranks 0,1)=2, node2 (ranks 2-5)=4")  # no IFNAME: per node
    assert check_nodes({"node1": n1, "node3": {6: dict(n1[0])}}).consistent
    assert run_key([{"SLURM_RESTART_COUNT": "2"}]) == "2" and run_key([{}]) == "0"


def test_a_cross_node_mismatch_is_one_finding_and_only_while_the_run_is_young() -> None:
    watch = ConfigWatch(wait_s=0.0)
    assert not watch.cross_due(0.0)  # this node's own ranks not compared yet
    env = {0: 10}
    watch.due(env, lambda pid: {}, 0.0)
    assert watch.due(env, lambda pid: {}, 1.0)  # first local comparison at t=1
    assert watch.cross_due(1.0) and not watch.cross_due(2.0) and watch.cross_due(1.0 + CROSS_NODE_EVERY_S)
    assert not watch.cross_due(2.0 + CROSS_NODE_S)
    report = check_nodes({"a": {0: {"NCCL_PROTO": "Simple"}}, "b": {1: {}}})
    js = JobStatus("job-7", ranks=(0,))
    assert watch.cross_finding(report, js, 3.0) is None  # once may be another node's record a moment old
    first = watch.cross_finding(report, js, 3.0 + CROSS_NODE_EVERY_S)
    assert first is not None and first.kind == "config_mismatch" and "a (rank 0)=Simple" in first.detail
    assert watch.cross_finding(report, js, 4.0 + CROSS_NODE_EVERY_S) is None  # the same disagreement is not news



def test_an_srun_task_that_has_not_started_its_ranks_is_not_compared() -> None:
    """The 2-node Slurm race: gwn2's srun task (SLURM_PROCID=1, none of torchrun's variables, no RANK) was published
    as rank 1 while its torchrun agent waited in the rendezvous, and gwn1 found LOCAL_WORLD_SIZE, MASTER_ADDR, … unset
    there. Once any process of the job is one of torch's ranks, only those are compared; a job launched with srun
    alone (no RANK anywhere) is compared as before."""
    worker = {"RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gwn1", "WORLD_SIZE": "4"}
    task: dict[str, str] = {}
    assert check_nodes({"gwn1": {0: worker, 1: {**worker, "RANK": "1"}}, "gwn2": {1: task}}).consistent
    assert check_ranks({0: worker, 1: task}).consistent
    skewed = {**worker, "RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    assert not check_nodes({"gwn1": {0: worker}, "gwn2": {1: task, 2: skewed}}).consistent
    srun_only = check_nodes({"a": {0: {"NCCL_PROTO": "Simple"}}, "b": {1: {}}})
    assert not srun_only.consistent and "NCCL_PROTO" in srun_only.summary
