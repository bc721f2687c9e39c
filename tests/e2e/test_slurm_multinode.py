"""One job, two nodes, one agent per node, no coordinator — on a real 2-node Slurm (tests/support/slurm_nodes.py:
each node its own network, UTS, PID and mount namespaces with its own slurmd and its own ``gpu-watchdog run``,
configured as docs/slurm.md says: the shipped TaskProlog/Epilog, a ``slurm-requeue`` hook, ``fallback.shared_dir``).

The job is written the way users write it: ``sbatch -N 2`` whose batch script is one ``srun`` of torchrun per node
(static rendezvous on the first node, ``--node-rank $SLURM_NODEID``), 2 gloo ranks per node of
``gpu_watchdog.demo.train`` (a P2P hang that ``NCCL_P2P_DISABLE=1`` cures, a checkpoint every step on the shared
directory, resume from it). Ranks 0,1 run on gwn1 (the batch host), ranks 2,3 on gwn2.

Each hang must be requeued exactly once (slurmctld's log), by one agent; the other stands down without a failed
hook; the requeued run completes, and every one of its ranks, on both nodes, runs with the same NCCL settings.

Needs root and namespaces; skipped without them, but in CI (``CI=true``) a missing prerequisite fails the tests.
"""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import GW, short_dir, wait_for
from slurm_cluster import require
from slurm_nodes import SlurmNodes, slurm_nodes_missing_reason
from slurm_site import SCRIPTS, TERMINAL, events, job_env, wait_settled, write_epilog

pytestmark = pytest.mark.slow
NODES = ("gwn1", "gwn2")
RANKS_ON = {"gwn1": (0, 1), "gwn2": (2, 3)}


class Site:
    """The cluster, one agent per node, and what a job needs to reach them."""

    def __init__(self, base: Path, cluster: SlurmNodes) -> None:
        self.base = base
        self.cluster = cluster
        self.shared = base / "shared"
        self.config = base / "config.toml"
        local = cluster.node_local  # the same path on every node, each node's own directory behind it
        self.config.write_text(f"""
[agent]
interval_s = 0.5
backend = "proc"
state_dir = "{local / 'state'}"

[detect]
waiting_timeout_s = 20.0

[recovery]
stop_grace_s = 3.0
checkpoint_grace_s = 10.0
max_restarts = 2
restart_backoff_s = 0

[fallback]
shared_dir = "{self.shared}"
actor_grace_s = 8.0

[daemon]
control_socket = "{local / 'control.sock'}"
socket_group = ""
housekeeping_interval_s = 600.0

[hooks.slurm-requeue]
type = "slurm-requeue"
timeout_s = 30
""")
        self.agents: dict[str, Any] = {}
        for node in NODES:
            self.start_agent(node)

    def socket(self, node: str) -> Path:
        return self.cluster.node_dir(node) / "control.sock"

    def start_agent(self, node: str) -> None:
        self.socket(node).unlink(missing_ok=True)
        self.agents[node] = self.cluster.spawn(node, [GW, "run", "--config", str(self.config)],
                                               log=self.base / f"agent-{node}.log")
        wait_for(self.socket(node).exists, 30, f"{node}'s agent", lambda: self.agent_log(node))

    def stop_agent(self, node: str) -> None:
        p = self.agents.pop(node)
        p.send_signal(signal.SIGTERM)
        p.wait(20)

    def agent_log(self, node: str) -> str:
        path = self.base / f"agent-{node}.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""

    def job_env(self) -> dict[str, str]:
        """What the submitting shell exports (sbatch --export=ALL): gpu-watchdog and the daemon's config (the
        TaskProlog reads its socket, and the shared directory, from it), gloo on the node's interface."""
        return job_env(self.cluster.env, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
                       GPU_WATCHDOG_CONFIG=str(self.config))

    def submit(self, name: str, train_args: str, *, port: int, node2_env: str = "") -> tuple[str, Path]:
        """``sbatch -N 2``: one srun task per node, each torchrun with 2 ranks (``node2_env``: exported on gwn2
        only, a node launched differently)."""
        work = self.base / name
        work.mkdir()
        train = (f"-m gpu_watchdog.demo.train --ckpt-dir {work} --step-s 0.05 --events {work / 'events.jsonl'} "
                 f"{train_args}")
        per_node = (f"[ \"$SLURM_NODEID\" = 1 ] && export {node2_env}; " if node2_env else "") + (
            f"exec torchrun --nnodes 2 --nproc-per-node 2 --node-rank $SLURM_NODEID --master-addr gwn1 "
            f"--master-port {port} {train}")
        script = work / "job.sh"
        script.write_text(f"#!/bin/bash\nsrun --ntasks-per-node 1 bash -c '{per_node}'\n")
        job_id = self.cluster.sbatch(script, "-J", name, "-N", "2", "--ntasks-per-node", "1", "-c", "2",
                                     "-o", str(work / "out.log"), "--open-mode=append", env=self.job_env())
        return job_id, work

    def incidents(self, job_id: str) -> dict[str, list[dict[str, Any]]]:
        """Each node's incidents of the job (summary.json), oldest first."""
        out: dict[str, list[dict[str, Any]]] = {}
        for node in NODES:
            found = []
            for path in (self.cluster.node_dir(node) / "state").rglob("summary.json"):
                try:
                    doc = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if doc.get("job_id") == job_id:
                    found.append(doc)
            out[node] = sorted(found, key=lambda d: d.get("detected_at") or 0)
        return out

    def wait_end(self, job_id: str, work: Path, timeout: float) -> dict[str, str]:
        """The job's final state, every incident of it finished (slurm_site.wait_settled)."""
        return wait_settled(lambda: self.cluster.job(job_id),
                            lambda: any(i.get("outcome") is None for incs in self.incidents(job_id).values()
                                        for i in incs), timeout, f"job {job_id} to end", lambda: self.why(job_id, work))

    def why(self, job_id: str, work: Path) -> str:
        text = (work / "out.log").read_text(errors="replace") if (work / "out.log").exists() else ""
        out = text if len(text) < 6000 else f"{text[:2500]}\n[…]\n{text[-3500:]}"  # the first error and the end
        logs = "\n".join(f"--- agent {n}\n{self.agent_log(n)}" for n in NODES)
        reports = "\n".join(f"--- {p.parent.name} on {n}\n{p.read_text(errors='replace')[-3000:]}" for n in NODES
                            for p in (self.cluster.node_dir(n) / "state").rglob("report.txt")
                            if f"-{job_id}-" in p.parent.name)
        return f"job {self.cluster.job(job_id)}\n--- job output\n{out}\n{logs}\n{reports}"


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    require(slurm_nodes_missing_reason(), "multi-node Slurm tests")
    base = short_dir()
    epilog = base / "epilog.sh"
    cluster = SlurmNodes(base / "slurm", cpus=8, task_prolog=str(SCRIPTS / "task_prolog.sh"), epilog=str(epilog))
    write_epilog(epilog, cluster.node_local / "control.sock")
    cluster.start()
    try:
        s = Site(base, cluster)
        print(f"2-node slurm cluster and agents up in {cluster.startup_s:.1f}s")
        yield s
    finally:
        for job in cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
            cluster.cancel(job)
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def jobs(site: Site) -> dict[str, tuple[str, Path]]:
    """The jobs that run side by side with both agents up."""
    return {
        "healthy": site.submit("healthy", "--hang-at 0 --steps 12", port=29510),
        "culprit-node1": site.submit("culprit-node1", "--hang-at 5 --hang-rank 1 --steps 14", port=29511),
        "culprit-node2": site.submit("culprit-node2", "--hang-at 5 --hang-rank 3 --steps 14", port=29512),
        # rank 3 computes forever once (alive, busy): gwn1 sees only its ranks wait, gwn2 sees rank 3 run
        "busy-node2": site.submit("busy-node2", "--hang-at 5 --hang-rank 3 --hang-busy --steps 14", port=29515),
        # gwn2 launched with a protocol of its own: the seed's multi-node failure, caught before it hangs
        "mismatch": site.submit("mismatch", "--hang-at 0 --steps 200", port=29513, node2_env="NCCL_PROTO=Simple"),
    }


def _stalls(site: Site, job_id: str) -> dict[str, list[dict[str, Any]]]:
    return {n: [i for i in incs if i.get("kind") == "stall"] for n, incs in site.incidents(job_id).items()}


def _action(inc: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [a for a in inc.get("actions") or () if a.get("action") == name]


def _assert_recovered_once(site: Site, job_id: str, work: Path, hang_rank: int, actor: str) -> None:
    """Requeued exactly once by ``actor``'s agent, the rerun completed from its checkpoint, every rank of it on
    both nodes with the same NCCL settings; the other agent stood down; no failed hook anywhere."""
    info = site.wait_end(job_id, work, 300)
    why = site.why(job_id, work)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", why
    assert site.cluster.requeue_count(job_id) == 1, why
    ev = events(work)
    starts = [e for e in ev if e["event"] == "start"]
    assert len(starts) == 8, ev
    rerun = starts[4:]
    assert {e["host"]: sorted(r["rank"] for r in rerun if r["host"] == e["host"]) for e in rerun} == {
        n: list(RANKS_ON[n]) for n in NODES}, rerun
    settings = {json.dumps(e["nccl"], sort_keys=True) for e in rerun}
    assert len(settings) == 1 and json.loads(settings.pop()).get("NCCL_P2P_DISABLE") == "1", rerun
    onset = [e for e in ev if e["event"] == "hang_onset"]
    assert len(onset) == 1 and {e["step"] for e in rerun} == {onset[0]["step"] - 1}, ev  # resumed
    assert len([e for e in ev if e["event"] == "done"]) == 4, ev
    stalls = _stalls(site, job_id)
    acted = stalls[actor]
    assert len(acted) == 1 and acted[0]["outcome"] == "restart hook ran", (stalls, why)
    assert acted[0].get("culprit_ranks") == [hang_rank], acted[0]
    for node, incs in stalls.items():
        for inc in incs:
            assert all(a.get("ok") or a.get("outcome") == "skipped" for a in _action(inc, "restart_hook")), inc
            assert set(inc.get("culprit_ranks") or [hang_rank]) == {hang_rank}, (node, inc)  # never a remote rank
            if node != actor:  # the other agent stood down on the actor's decision
                assert inc["outcome"] == f"restarted by {actor}", inc
                assert inc["restarted_by"]["incident"] == acted[0]["id"], inc


def test_a_healthy_two_node_job_is_never_touched(site: Site, jobs) -> None:
    job_id, work = jobs["healthy"]
    info = site.wait_end(job_id, work, 240)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", site.why(job_id, work)
    assert site.incidents(job_id) == {n: [] for n in NODES}
    assert site.cluster.requeue_count(job_id) == 0


@pytest.mark.parametrize("name,hang_rank", [("culprit-node1", 1), ("culprit-node2", 3)])
def test_a_hang_on_either_node_is_requeued_once_by_rank_0s_node(site: Site, jobs, name: str, hang_rank: int) -> None:
    """Culprit on the batch host or on the other node: gwn1's agent (rank 0's node) decides the run and requeues;
    gwn2's agent, which may confirm first, waits for that decision and stands down."""
    job_id, work = jobs[name]
    _assert_recovered_once(site, job_id, work, hang_rank, actor="gwn1")


def test_a_busy_culprit_on_the_other_node_is_waited_on_then_restarted_once(site: Site, jobs) -> None:
    """Rank 3 (gwn2) computes forever: gwn1's agent confirms its ranks idle, reads gwn2's published dump — rank 3
    alive, computing — and waits, as it would on one node (an observed incident naming rank 3); at
    waiting_timeout_s one agent restarts the job — once, with no NCCL change (no evidence for one), the same
    settings on every rank — and the rerun completes."""
    job_id, work = jobs["busy-node2"]
    info = site.wait_end(job_id, work, 300)
    why = site.why(job_id, work)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", why
    assert site.cluster.requeue_count(job_id) == 1, why
    rerun = [e for e in events(work) if e["event"] == "start"][4:]
    assert len(rerun) == 4 and len({json.dumps(e["nccl"], sort_keys=True) for e in rerun}) == 1, rerun
    assert rerun[0]["nccl"].get("NCCL_P2P_DISABLE") is None, rerun  # a busy rank is no transport problem
    incs = site.incidents(job_id)
    held = [a["detail"] for i in incs["gwn1"] if i.get("verdict") == "waiting" for a in _action(i, "observe")]
    assert held and "rank 3" in held[0] and "alive there" in held[0], (held, why)
    acted = [i for n in NODES for i in incs[n] if i.get("outcome") == "restart hook ran"]
    assert len(acted) == 1 and acted[0]["signature"] == "waiting_timeout", (acted, why)
    for node in NODES:
        for inc in incs[node]:
            assert all(a.get("ok") or a.get("outcome") == "skipped" for a in _action(inc, "restart_hook")), inc


def test_mismatched_launch_settings_across_nodes_are_one_incident_per_node(site: Site, jobs) -> None:
    """gwn2's ranks run NCCL_PROTO=Simple, gwn1's do not: a config_mismatch incident on every node, naming both
    nodes, the ranks and the variable."""
    job_id, work = jobs["mismatch"]

    def found() -> dict[str, dict[str, Any]] | None:
        got = {n: [i for i in incs if i.get("kind") == "config_mismatch"] for n, incs in
               site.incidents(job_id).items()}
        return {n: incs[0] for n, incs in got.items()} if all(got.values()) else None

    try:
        incs = wait_for(found, 120, "a config_mismatch incident on both nodes", lambda: site.why(job_id, work))
    finally:
        site.cluster.cancel(job_id)
    for node, inc in incs.items():
        text = json.dumps(inc)
        assert "NCCL_PROTO" in text and "gwn1" in text and "gwn2" in text, (node, inc)
    assert site.cluster.requeue_count(job_id) == 0


@pytest.mark.parametrize("down,acting,port", [("gwn1", "gwn2", 29514), ("gwn2", "gwn1", 29516)])
def test_with_one_nodes_agent_down_the_other_recovers_the_job_at_one_level(site: Site, jobs, down: str, acting: str,
                                                                            port: int) -> None:
    """One node's agent is down for the whole job (culprit rank 3, on gwn2). gwn1 down: gwn2's agent waits
    fallback.actor_grace_s for rank 0's node's decision that never comes, then decides run 1 itself. gwn2 down:
    gwn1 sees only its ranks wait in all_reduce and no dump from gwn2 — a transport hang as far as it can tell —
    and decides at once. Either way one requeue, and the unwatched node's TaskProlog, with no daemon to ask,
    exports the run's record from the shared directory: every rank of the rerun has NCCL_P2P_DISABLE=1."""
    for job_id, work in jobs.values():  # the side-by-side jobs are done: only this one runs
        if site.cluster.job(job_id).get("JobState") not in TERMINAL:
            site.wait_end(job_id, work, 300)
    site.stop_agent(down)
    try:
        job_id, work = site.submit(f"{down}-down", "--hang-at 5 --hang-rank 3 --steps 14", port=port)
        info = site.wait_end(job_id, work, 300)
        why = site.why(job_id, work)
        assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", why
        assert site.cluster.requeue_count(job_id) == 1, why
        rerun = [e for e in events(work) if e["event"] == "start"][4:]
        assert len(rerun) == 4 and {e["nccl"].get("NCCL_P2P_DISABLE") for e in rerun} == {"1"}, rerun
        assert len({json.dumps(e["nccl"], sort_keys=True) for e in rerun}) == 1, rerun
        (inc,) = _stalls(site, job_id)[acting]
        # the acting node sees half the job and no dump of the other half: it may name rank 3 (when it runs it)
        # or nobody, never a rank it cannot see
        assert inc["outcome"] == "restart hook ran" and set(inc.get("culprit_ranks") or []) <= {3}, f"{inc}\n{why}"
        (claim,) = _action(inc, "claim_run")
        assert "decided here" in claim["detail"], claim
        assert "not registered" in (work / "out.log").read_text(errors="replace")  # the unwatched node said so
    finally:
        site.start_agent(down)
