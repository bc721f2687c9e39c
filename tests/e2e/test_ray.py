"""Ray jobs under ``launch``: a Ray Train ``TorchTrainer`` DDP job and an actor group that forms its own process group
(the RLHF frameworks' shape), each on a local ``ray.init()`` cluster under the driver. Their ranks come from Ray's own
records (Ray Train's worker logs, the actor's ``__repr__``), never from the environment; Ray's service processes are
never ranks. The rows are asserted the zoo's way (tests/support/zoo_runs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.processes import ProcessScanner
from zoo_runs import RAY, ZOO, Case, Row, assert_row, run_case, run_variant

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Row | BaseException]:
    base = tmp_path_factory.mktemp("ray")
    with ThreadPoolExecutor(2) as pool:
        futures = {c.name: pool.submit(run_case, base / c.name, c) for c in RAY}
        return {name: fut.exception() or fut.result() for name, fut in futures.items()}


@pytest.mark.parametrize("case", RAY, ids=lambda c: c.name)
def test_ray_row(rows: dict[str, Row | BaseException], case: Case) -> None:
    """The Ray Train worker blocked in its own code and the actor group's mismatched collectives are confirmed ≤10 s
    after the onset, the culprit named by its Ray rank, restarted once without an NCCL change, and the job finishes;
    the slow checkpoint on rank 0 and every actor polling for its shard run to the end untouched."""
    row = rows[case.name]
    if isinstance(row, BaseException):
        raise row
    assert_row(case, row)


def test_an_actor_killed_mid_step_is_named(tmp_path: Path) -> None:
    """SIGKILL of actor 1 (as the OOM killer does): its peer's gloo collective fails, the driver's ray.get raises and
    the job ends; the incident names rank 1, read from Ray (the actor's __repr__), and how it ended."""
    row = run_variant(tmp_path, "ray_actor_group", "killed", nproc=2, spawns=True, timeout_s=150,
                      args=("--steps", "40", "--hang-step", "20", "--rank", "1"))
    assert row.culprit == (1,) and row.detected_after_s is not None and row.detected_after_s <= 10.0, row
    assert row.rc == 1 and row.actions == ("restart",), row  # recovery.restart_on_crash is off by default


def test_no_ray_service_process_is_ever_a_rank(tmp_path: Path) -> None:
    """While an actor group trains, the scanner's ranks are exactly its two actors; the GCS, the raylet, the dashboard,
    the agents, the log monitor and idle workers — all holding TCP connections to the job's processes — are none."""
    env = dict(os.environ, GPU_WATCHDOG_JOB_ID="ray-services")
    job = subprocess.Popen([sys.executable, str(ZOO / "ray_actor_group.py"), "--nproc", "2", "--steps", "400",
                            "--variant", "healthy", "--workdir", str(tmp_path)],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    scanner = ProcessScanner(root_pid=job.pid)
    try:
        deadline, ranks, services = time.monotonic() + 90, {}, set()
        while time.monotonic() < deadline and len(ranks) < 2:
            samples, _ = scanner.sample()
            ranks = {s.job.rank: s for s in samples if s.is_rank and s.job is not None}
            time.sleep(0.5)
        assert sorted(ranks) == [0, 1], (ranks, scanner.unranked, scanner.rankless)
        assert all(ray_node.actor_class(s.cmdline) == "Trainer" for s in ranks.values()), ranks
        import psutil

        for p in psutil.Process(job.pid).children(recursive=True):
            try:
                if ray_node.is_service(p.cmdline()):
                    services.add(p.pid)
            except psutil.Error:
                continue
        assert len(services) >= 4, services  # gcs_server, raylet, log monitor, agents: what was checked
        samples, _ = scanner.sample()
        assert not {s.pid for s in samples} & services
        assert not set(scanner.unranked) & services and not set(scanner.rankless) & services
    finally:
        os.killpg(job.pid, 9)
        job.wait()
