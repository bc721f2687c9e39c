"""The multi-node test cluster itself (tests/support/slurm_nodes.py): before per-node agents are tested on it, it
must be what it claims: two nodes that Slurm schedules across, each with its own hostname, /proc and node-local
directory; a 2-node torchrun gloo job written the way users write it; requeues counted from slurmctld's log;
nothing left behind by ``stop()``, also when ``start()`` fails.

Needs root and namespaces; skipped without them, but in CI (``CI=true``) a missing prerequisite fails the tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import short_dir
from slurm_cluster import require
from slurm_nodes import CONTROLLER, SlurmNodes, slurm_nodes_missing_reason

pytestmark = pytest.mark.slow
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}

TRAIN = """
import json, os, socket, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for _ in range(3):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
dist.barrier()
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]), "world": world,
               "host": socket.gethostname(), "sum": t.item()}, f)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmNodes]:
    require(slurm_nodes_missing_reason(), "multi-node Slurm tests")
    base = short_dir()
    c = SlurmNodes(base / "slurm")
    try:
        c.start()
        print(f"2-node slurm cluster up in {c.startup_s:.1f}s")
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


def job_env(c: SlurmNodes) -> dict[str, str]:
    """What the submitting shell exports (sbatch --export=ALL): the venv first on PATH, one thread per rank."""
    env = {k: v for k, v in c.env.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "PYTEST", "SLURM_JOB",
                                "SLURM_PROCID"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def submit(c: SlurmNodes, work: Path, body: str, *args: str) -> str:
    work.mkdir(parents=True, exist_ok=True)
    script = work / "job.sh"
    script.write_text(f"#!/bin/bash\nset -e\n{body}\n")
    return c.sbatch(script, "-o", str(work / "out.log"), "-D", str(work), *args, env=job_env(c))


def why(c: SlurmNodes, job_id: str, work: Path) -> str:
    out = (work / "out.log").read_text(errors="replace")[-3000:] if (work / "out.log").exists() else ""
    return f"job {c.job(job_id)}\n--- job output\n{out}\n{c.logs()}"


def test_each_node_has_its_own_hostname_proc_and_local_dir(cluster: SlurmNodes, tmp_path: Path) -> None:
    """One task per node: `hostname` is the node, /proc lists only the node's processes (a sleep spawned in
    the other node is not there, the test process is not there, one slurmd), node_local is the node's own
    directory, and the node list of the job resolves inside the nodes."""
    sleeps = {n: cluster.spawn(n, ["sleep", f"30{i}"]) for i, n in enumerate(cluster.names, 1)}
    for n in cluster.names:
        (cluster.node_dir(n) / "whoami").write_text(n)
    work = short_dir()
    try:
        job = submit(cluster, work, f"""
scontrol show hostnames "$SLURM_JOB_NODELIST" > {work}/nodelist
srun sh -c 'h=$(hostname); ps -eo pid=,args= > {work}/ps-$h; cat {cluster.node_local}/whoami > {work}/local-$h; \
getent hosts {' '.join(cluster.names)} > {work}/hosts-$h; echo "$SLURMD_NODENAME" > {work}/nodename-$h'
""", "-N", "2", "--ntasks-per-node", "1")
        info = cluster.wait_state(job, TERMINAL, 60)
        assert info["JobState"] == "COMPLETED", why(cluster, job, work)
        assert (work / "nodelist").read_text().split() == cluster.names
        for i, n in enumerate(cluster.names, 1):
            ps = (work / f"ps-{n}").read_text()
            mine = f"sleep 30{i}"
            others = [f"sleep 30{j}" for j in range(1, len(cluster.names) + 1) if j != i]
            assert mine in ps and not any(o in ps for o in others), (n, ps)
            assert len(re.findall(r"slurmd -D -N", ps)) == 1 and f"slurmd -D -N {n}" in ps, (n, ps)
            assert "pytest" not in ps, (n, ps)  # the test process lives in the host's namespaces
            assert (work / f"local-{n}").read_text() == n
            assert (work / f"nodename-{n}").read_text().strip() == n
            resolved = dict(line.split()[::-1] for line in (work / f"hosts-{n}").read_text().splitlines())
            assert resolved == {m: cluster.addr(m) for m in cluster.names}, resolved
        # the same seen from outside Slurm, with node_run: PID 1 is the node's init, the spawned sleep is its own
        for i, n in enumerate(cluster.names, 1):
            r = cluster.node_run(n, ["ps", "-eo", "pid=,args="], check=True)
            pids = {line.split(None, 1)[1]: int(line.split()[0]) for line in r.stdout.strip().splitlines()}
            assert pids[f"sleep 30{i}"] > 1 and min(pids.values()) == 1, r.stdout
            assert cluster.node_run(n, ["hostname"]).stdout.strip() == n
            assert cluster.node_init_pid(n) != cluster.node_init_pid(CONTROLLER)
    finally:
        for p in sleeps.values():
            p.terminate()
        assert [p.wait(10) for p in sleeps.values()] == [-15] * len(sleeps)  # the signal reached the sleep
        shutil.rmtree(work, ignore_errors=True)


def test_a_two_node_torchrun_gloo_job(cluster: SlurmNodes) -> None:
    """2 nodes x 2 ranks: srun starts one torchrun per node, c10d rendezvous at the first node's hostname, gloo
    all_reduce across the nodes' veths; 4 ranks ran, 2 on each node, the job COMPLETED."""
    work = short_dir()
    try:
        (work / "train.py").write_text(TRAIN)
        job = submit(cluster, work, f"""
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
    --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" {work / 'train.py'} {work}
""", "-N", "2", "--ntasks-per-node", "1", "-c", "2", "-J", "torchrun")
        info = cluster.wait_state(job, TERMINAL, 90)
        assert info["JobState"] == "COMPLETED", why(cluster, job, work)
        ranks = [json.loads((work / f"rank-{r}.json").read_text()) for r in range(4)]
        assert {r["world"] for r in ranks} == {4} and {r["sum"] for r in ranks} == {10.0}, ranks
        per_node = {n: sorted(r["local_rank"] for r in ranks if r["host"] == n) for n in cluster.names}
        assert per_node == {n: [0, 1] for n in cluster.names}, ranks
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_requeue_count_counts_slurmctlds_requeues(cluster: SlurmNodes) -> None:
    """`scontrol requeue` of a running batch job: counted once from slurmctld's log, as Restarts= says."""
    work = short_dir()
    try:
        job = submit(cluster, work, "sleep 120", "-J", "requeue")
        cluster.wait_state(job, {"RUNNING"}, 30)
        assert cluster.requeue_count(job) == 0
        cluster.run("scontrol", "requeue", job)
        info = cluster.wait_state(job, {"PENDING", "RUNNING"}, 30)
        assert info["Restarts"] == "1" and cluster.requeue_count(job) == 1, (info, cluster.logs())
        cluster.cancel(job)
        cluster.wait_state(job, TERMINAL, 30)
        assert cluster.requeue_count(job) == 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _host_links() -> list[str]:
    return sorted(re.findall(r"^\d+: (\S+?)[:@]", subprocess.run(["ip", "-o", "link"], capture_output=True,
                                                               text=True, check=True).stdout, re.M))


def _alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


def test_a_second_cluster_has_its_own_subnet_and_stop_leaves_nothing(cluster: SlurmNodes) -> None:
    """A one-node cluster beside the module's: another index (subnet); stop() ends its inits, so every process
    of its namespaces, and frees the index; the host's network namespace never got a link; stop() again is a
    no-op. A start that fails (a slurm.conf slurmctld rejects) cleans up the same way."""
    links = _host_links()
    base = short_dir()
    try:
        other = SlurmNodes(base / "ok", nodes=1, cpus=2).start()
        pids = [other.node_init_pid(n) for n in [CONTROLLER, *other.names]]
        assert other.index != cluster.index and other.addr("gwn1") != cluster.addr("gwn1")
        assert other.run("sinfo", "-h", "-o", "%D %t").stdout.split() == ["1", "idle"]
        other.stop()
        other.stop()
        assert not any(_alive(p) for p in pids)
        assert _host_links() == links
        assert other._lock_fd is None and not other._inits
        bad = SlurmNodes(base / "bad", nodes=1, extra_conf="NoSuchOption=1\n")
        with pytest.raises((RuntimeError, TimeoutError)):
            bad.start(timeout=20)
        assert not bad._inits and _host_links() == links
        left = subprocess.run(["pgrep", "-f", str(base)], capture_output=True, text=True).stdout.split()
        assert left == [], subprocess.run(["ps", "-fp", ",".join(left)], capture_output=True, text=True).stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)
