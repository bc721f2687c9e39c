"""Ray jobs under ``launch``: a Ray Train ``TorchTrainer`` DDP job and an actor group that forms its own process group
(the RLHF frameworks' shape), each on a local ``ray.init()`` cluster under the driver. Their ranks come from Ray's own
records (Ray Train's worker logs, the actor's ``__repr__``), never from the environment; Ray's service processes are
never ranks. The rows are asserted the zoo's way (tests/support/zoo_runs.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.model import unknown_rank
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.processes import ProcessScanner
from zoo_runs import RAY, ZOO, Case, Row, assert_row, row_of, run_cases, run_variant

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Row | BaseException]:
    # A restarted Ray job starts a whole Ray cluster again before its steps (20-60 s on a loaded host): a row with a
    # restart was seen running past 240 s in CI with detection and action right.
    return run_cases(tmp_path_factory.mktemp("ray"), RAY, timeout_s=400.0)


@pytest.mark.parametrize("case", RAY, ids=lambda c: c.name)
def test_ray_row(rows: dict[str, Row | BaseException], case: Case) -> None:
    """The Ray Train worker blocked in its own code, the actor group's mismatched collectives and the OpenRLHF-style
    actor blocked on a lock are confirmed ≤10 s after the onset, the culprit named by its Ray rank where one side is
    the odd one, restarted once without an NCCL change, and the job finishes; the slow checkpoint on rank 0 and
    every actor polling for its shard and a 12 s generate-like phase on actor 0 while actor 1 waits run to the end
    untouched."""
    assert_row(case, row_of(rows, case))


def test_an_actor_killed_mid_step_is_named(tmp_path: Path) -> None:
    """SIGKILL of actor 1 (as the OOM killer does): its peer's gloo collective fails, the driver's ray.get raises and
    the job ends; the incident names rank 1, read from Ray (the actor's __repr__), and how it ended."""
    row = run_variant(tmp_path, "ray_actor_group", "killed", nproc=2, spawns=True, timeout_s=150,
                      args=("--steps", "40", "--hang-step", "20", "--rank", "1"))
    assert row.culprit == (1,) and row.detected_after_s is not None and row.detected_after_s <= 10.0, row
    assert row.rc == 1 and row.actions == ("restart",), row  # recovery.restart_on_crash is off by default


@pytest.mark.parametrize("style, when", [("repr", ("--kill-after-s", "1")), ("opaque", ("--kill-after-s", "2")),
                                         ("repr", ("--kill-after-s", "3")), ("repr", ("--hang-step", "0"))],
                         ids=["1s", "2s-opaque", "3s", "first-step"])
def test_an_actor_killed_early_is_named_by_what_is_known_never_its_peer(tmp_path: Path, style: str,
                                                                        when: tuple[str, str]) -> None:
    """Actor 1 SIGKILLed (as the OOM killer does) 1-3 s after its gloo group formed, or as its first step begins (its
    ``__repr__`` logged moments before), mostly before anything had learned its rank: the rank_exited incident names
    the dead process — its pid and its Ray actor — and its rank once Ray's records give one (the ``__repr__``, logged
    when ``__init__`` returned: always so once it began training); never actor 0, the survivor, whose process was
    the only rank the agent may have known."""
    from gpu_watchdog.store.incidents import IncidentStore
    from launch_harness import read_events

    for attempt in range(2):  # on a saturated host Ray's own start-up may give up (30 s): such a run tests nothing
        run = tmp_path / f"run{attempt}"
        row = run_variant(run, "ray_actor_group", "killed", nproc=2, spawns=True, timeout_s=200,
                          args=("--steps", "60", "--rank", "1", "--style", style, *when))
        if (run / "events.jsonl").exists():
            break
    events = read_events(run / "events.jsonl")
    dead = next(e["pid"] for e in events if e["event"] == "hang_onset")
    trained = any(e["event"] == "start" and e["pid"] == dead for e in events)  # its __init__ had returned
    [inc] = [i for i in IncidentStore(run / "state").list() if i["kind"] == "rank_exited"]
    assert row.rc == 1, row
    culprit = inc["culprit_ranks"]
    assert culprit in ([1], [unknown_rank(dead)]), inc  # never rank 0 nor another process
    if culprit == [1]:
        named = inc["ray_workers"]["1"]
    else:
        assert not (trained and style == "repr"), inc  # Ray's log named its rank: the incident must too
        named = inc["unknown_ranks"][str(unknown_rank(dead))]["ray"]
    assert named["pid"] == dead and named["actor_class"] == "Trainer" and named["actor_id"], inc
    assert f"pid {dead}" in inc["finding"], inc


def test_an_actor_whose_rank_no_source_gives_is_watched_and_named_by_its_pid(tmp_path: Path) -> None:
    """The actor group with the rank only in each actor's attribute and the actor's own loop (no environment, no
    ``__repr__``, no frame naming a rank): each actor is watched as rank unknown (pid N); actor 1 blocked on a lock
    is confirmed ≤10 s after the onset and named by its pid, the job restarted once and finished."""
    from launch_harness import read_events

    row = run_variant(tmp_path, "ray_actor_group", "lock", nproc=2, spawns=True, timeout_s=200,
                      args=("--steps", "80", "--hang-step", "60", "--rank", "1", "--style", "opaque"))
    onset = next(e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "hang_onset")
    assert row.culprit == (unknown_rank(onset["pid"]),) and row.collective == "all_reduce", row
    assert row.detected_after_s is not None and row.detected_after_s <= 10.0, row
    assert row.rc == 0 and row.finished and "restart" in row.actions and not row.nccl_change, row


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


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class RayNode:
    """A ``ray start --head --block`` node registered with a daemon (job id ``ray-node``, restart hook: the tests')."""

    base: Path
    daemon: Any
    address: str
    services: dict[int, float]  # Ray's own processes: pid → start time
    node: subprocess.Popen[bytes]
    env: dict[str, str]
    drivers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # killed with the node

    def drive(self, program: str, *args: str) -> tuple[Path, subprocess.Popen[bytes]]:
        """A driver of ``program`` connecting to the node (RAY_ADDRESS); its events file and process."""
        events = self.base / "events.jsonl"
        driver = subprocess.Popen([sys.executable, str(ZOO / f"{program}.py"), *args, "--workdir", str(self.base),
                                   "--events", str(events)], env=dict(self.env, RAY_ADDRESS=self.address),
                                  cwd=self.base, stdout=(self.base / "driver.log").open("w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        return events, driver

    def incident_after_onset(self, events: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The node's first finished incident once the job's fault fired, and the job's events."""
        from daemon_helpers import wait_for
        from gpu_watchdog.store.incidents import IncidentStore
        from launch_harness import read_events

        wait_for(lambda: any(e["event"] == "hang_onset" for e in read_events(events)) if events.exists() else False,
                 120, "the hang", log=lambda: (self.base / "driver.log").read_text()[-3000:])
        store = IncidentStore(self.base / "state")
        incs = wait_for(lambda: [i for i in store.list() if i.get("job_id") == "ray-node" and i.get("outcome")]
                        or None, 60, "the incident")
        return incs[0], read_events(events)

    def services_alive(self) -> bool:
        import psutil

        alive = {pid for pid, ct in self.services.items()
                 if psutil.pid_exists(pid) and psutil.Process(pid).create_time() == ct}
        return alive == set(self.services) and self.node.poll() is None


@contextlib.contextmanager
def ray_node_under_daemon() -> Iterator[RayNode]:
    """The way KubeRay and Slurm run Ray: ``ray start --head --block`` is the pod's (the allocation's) main process,
    registered with the daemon by its pid; jobs are drivers connecting to it. Everything it started is killed after."""
    import socket

    import psutil
    from daemon_helpers import DaemonProc, short_dir, wait_for
    from daemon_helpers import write_config as daemon_config
    from launch_harness import base_env

    base = short_dir()
    d = DaemonProc(base, daemon_config(base))
    env = dict(base_env(), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", HOME=str(base))
    node = None
    ray = RayNode(base, d, "", {}, None, env)  # type: ignore[arg-type]  # the node is set below
    try:
        d.wait_socket()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        node = subprocess.Popen([_ray_cli(), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                                 f"--port={port}", "--num-cpus=3", "--include-dashboard=false",
                                 f"--temp-dir={base}/ray"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        reg = d.cli("hook", "job-start", "--socket", d.socket, "--job-id", "ray-node", "--pid", str(node.pid),
                    "--restart-hook", "requeue")
        assert reg.returncode == 0, reg.stdout + reg.stderr
        wait_for(lambda: any("raylet" in " ".join(p.cmdline()) for p in psutil.Process(node.pid).children()), 60,
                 "the raylet up")
        ray.node, ray.address = node, f"127.0.0.1:{port}"
        ray.services = {p.pid: p.create_time() for p in psutil.Process(node.pid).children(recursive=True)
                        if ray_node.is_service(p.cmdline())}
        yield ray
    finally:
        for proc in (node, *ray.drivers):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        subprocess.run(["pkill", "-9", "-f", f"{base}/ray"], check=False)  # a node's processes outlive ray start's kill
        d.kill()


def test_a_ray_node_registered_with_the_daemon_is_watched_and_its_services_are_left_alone() -> None:
    """A Ray Train job on a registered ``ray start`` node: worker 1 blocked in its own code is named from Ray Train's
    records and handed to the restart hook at level 0; the stop hits the job's workers only: the GCS, the raylet,
    its agents and ``ray start`` itself live on."""
    from daemon_helpers import records

    with ray_node_under_daemon() as ray:
        # The hang after the workers train steadily (step 12): a hang in a job's first second can be confirmed one
        # waiting interval later (docs/detection-latency.md; CI saw 21.5 s for one at step 4 on a loaded host).
        events, driver = ray.drive("ray_train_ddp", "--nproc", "2", "--variant", "event_wait", "--rank", "1",
                                   "--steps", "40", "--hang-step", "12")
        ray.drivers.append(driver)
        inc, evs = ray.incident_after_onset(events)
        onset = min(e["t"] for e in evs if e["event"] == "hang_onset")
        assert inc["culprit_ranks"] == [1] and inc["collective"] == "ddp_all_reduce", inc
        assert inc["detected_at"] - onset <= 10.0, inc
        culprit = inc["ray_workers"]["1"]
        assert culprit["actor_class"] == "RayTrainWorker" and culprit["world_rank"] == 1, culprit
        assert culprit["actor_id"] and culprit["train_run"].startswith("ray_train_run"), culprit
        assert [h["argv"][2] for h in records(ray.base) if "argv" in h] == ["--level=0"], records(ray.base)
        assert ray.services_alive(), ray.services


def test_an_actor_group_on_a_registered_ray_node_with_mismatched_collectives_is_named_by_its_actors() -> None:
    """The RLHF frameworks' actor group on a registered ``ray start`` node, the rank only in each actor's attribute
    (no source outside the job can tell it): actor 1 calls all_gather where actor 0 broadcasts. Both members are
    watched, the desync is confirmed ≤10 s after the onset, each side is named — by its pid and Ray actor as rank
    unknown, or by its true rank where a stack look caught it still inside ``init_process_group(rank=…)`` (waiting
    for its peer at the rendezvous: on a loaded host CI saw it for actor 0) — the restart hook gets level 0 (no NCCL
    change for a desync) and Ray's services live on."""
    from daemon_helpers import records

    with ray_node_under_daemon() as ray:
        events, driver = ray.drive("ray_actor_group", "--nproc", "2", "--variant", "desync", "--rank", "1",
                                   "--style", "opaque", "--steps", "120", "--hang-step", "60")
        ray.drivers.append(driver)
        inc, evs = ray.incident_after_onset(events)
        onset = min(e["t"] for e in evs if e["event"] == "hang_onset")
        true_rank = {e["pid"]: e["rank"] for e in evs if e["event"] == "start"}
        actors = set(true_rank)
        assert inc["desync"] and inc["detected_at"] - onset <= 10.0, inc
        ranks = set(inc["ranks"])
        assert len(ranks) == 2 and all(unknown_rank(p) in ranks or true_rank[p] in ranks for p in actors), (
            inc["ranks"], true_rank)  # never a guessed number: its own, or unknown
        unknown = {p for p in actors if unknown_rank(p) in ranks}
        named = inc.get("unknown_ranks") or {}
        assert {v["pid"] for v in named.values()} == unknown, named
        assert all(v["ray"]["actor_class"] == "Trainer" and v["ray"]["actor_id"] for v in named.values()), named
        assert all(f"pid {p}" in inc["reason"] for p in unknown), inc["reason"]
        assert [h["argv"][2] for h in records(ray.base) if "argv" in h] == ["--level=0"], records(ray.base)
        assert ray.services_alive(), ray.services


def test_the_runs_fallback_settings_reach_the_ray_train_workers(tmp_path: Path) -> None:
    """A run at fallback level 1 (the record an earlier hang left for this job id): launch starts the driver with the
    level's NCCL settings, the local cluster's raylet inherits them and so does every worker it starts — the
    training function sees them in its own environment."""
    import json

    from launch_harness import read_events

    level1 = {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    jobs = tmp_path / "state" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / "zoo-ray_train_ddp-healthy.json").write_text(json.dumps(
        {"job_id": "zoo-ray_train_ddp-healthy", "level": 1, "name": "p2p_off", "env": level1, "updated_at": 1.0}))
    row = run_variant(tmp_path, "ray_train_ddp", "healthy", nproc=2, spawns=True, args=("--steps", "3"),
                      timeout_s=150)
    assert row.rc == 0 and row.finished and row.incidents == 0, row
    seen = {e["rank"]: e["env"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "nccl_env"}
    assert sorted(seen) == [0, 1], seen
    assert all({k: env.get(k) for k in level1} == level1 for env in seen.values()), seen


def test_a_ray_train_job_with_a_failure_config_is_restarted_by_ray_train(tmp_path: Path) -> None:
    """``FailureConfig(max_failures=2)``: the hung workers alone are ended (after the checkpoint step) and Ray Train
    restarts its worker group from the latest checkpoint; the driver and its cluster run on — launch never restarts
    the driver — and the job finishes. The incident says who restarted it."""
    from launch_harness import read_events

    row = run_variant(tmp_path, "ray_train_ddp", "event_wait", nproc=2, spawns=True, timeout_s=200,
                      args=("--steps", "12", "--rank", "1", "--max-failures", "2"))
    assert row.culprit == (1,) and row.detected_after_s is not None and row.detected_after_s <= 10.0, row
    assert row.rc == 0 and row.finished and row.incidents == 1 and not row.nccl_change, row
    events = read_events(tmp_path / "events.jsonl")
    assert sum(e["event"] == "driver_start" for e in events) == 1, events  # one driver, one launch run
    assert sum(e["event"] == "start" for e in events) == 4, events  # two worker groups of two
    from gpu_watchdog.store.incidents import IncidentStore

    (inc,) = IncidentStore(tmp_path / "state").list()
    assert inc["outcome"].startswith("restarted by the job's engine (Ray Train run"), inc["outcome"]
    restart = [a for a in inc["actions"] if a["action"] == "restart"]
    assert len(restart) == 1 and "FailureConfig(max_failures=2), 0 used" in restart[0]["detail"], restart
    stop = [a for a in inc["actions"] if a["action"] == "stop"]
    assert len(stop) == 1 and stop[0]["ok"] and "the hung ranks" not in inc["outcome"], stop


def test_a_ray_train_worker_held_to_a_cpu_quota_is_named_the_straggler_from_its_training_thread(
        tmp_path: Path) -> None:
    """A Ray Train DDP job under ``launch`` with the shipped defaults, 3 workers whose step is ~15 ms of compute (a
    batch of 4096) and a 0.2 s pause: worker 1's process held to 0.04 of a core by a cgroup quota. Every worker's main
    thread idles alike in Ray's task loop; the cheap signal reads the training thread the first stack round showed,
    and names worker 1 within 3 minutes, with its cause; nothing is stopped. (On the default batch of 16 a step needs
    so little CPU that the quota barely slowed the job — 13 steps/s before and after on a loaded host: no straggler,
    and none was named. Flat out, the job starved the suite's other straggler tests of the CPU they measure by.)"""
    from cpu_quota import cpu_quota
    from launch_harness import base_env, read_events, start_launch, write_config

    events = tmp_path / "events.jsonl"
    # A step of ~15 ms of compute and a 0.2 s pause: light beside the suite's other tests, yet worker 1 needs more
    # CPU per step than its quota gives it in the step's time (Ray's own threads in its process use some too).
    job = ["nice", "-n", "10", sys.executable, str(ZOO / "ray_train_ddp.py"), "--nproc", "3", "--workdir",
           str(tmp_path / "work"), "--events", str(events), "--steps", "1000000", "--ckpt-every", "10000000",
           "--step-s", "0.2", "--batch", "4096"]
    (tmp_path / "work").mkdir()
    run = start_launch(["--backend", "proc", "--config", str(write_config(tmp_path / "gw.toml", {}))], job,
                       env=base_env(), tmp_path=tmp_path, job_id="t-ray-straggler", max_lifetime_s=600)
    try:
        pids = run.wait_for("three workers training", lambda: (lambda p: p if len(p) == 3 else None)(
            {e["rank"]: e["pid"] for e in read_events(events) if e["event"] == "start"}), 240)
        run.wait_for("a step", lambda: any(e["event"] == "step" for e in read_events(events)) or None, 60)
        with cpu_quota([pids[1]], cores=0.04):
            throttled_at = time.time()
            inc = run.wait_for("a straggler incident", lambda: next(
                (i for i in run.incidents() if i["kind"] == "straggler" and "outcome" in i), None), 200)
            named_after = time.time() - throttled_at
        print(f"Ray Train worker 1 held to 0.04 of a core: named the straggler {named_after:.0f} s later")
        assert [i["kind"] for i in run.incidents()] == ["straggler"], run.output()[-3000:]
        assert inc["actions"] == [] and inc["outcome"] == "recorded" and run.poll() is None
        st = inc["straggler"]
        assert inc["culprit_ranks"] == [1] and st["pid"] == pids[1], inc["reason"]
        assert st["evidence"] == "signals" and st["tid"] != pids[1], st  # its training thread, not Ray's loop
        assert "cpu_throttled" in {c["kind"] for c in st["causes"]} and st["origin"] == "node", st["causes"]
        assert named_after <= 180.0, named_after
    finally:
        run.kill()
