"""What Ray says of a node's processes, read from /proc-style command lines and Ray's own logs (recorded from a real
Ray 2.60 Ray Train run in tests/data/ray/session: two RayTrainWorkers, pids 4573 (rank 0) and 4597 (rank 1), and the
TrainController, pid 4480; and in tests/data/ray/killed, from real Ray 2.60 runs of tests/zoo/ray_actor_group.py
``--variant killed --kill-after-s``, the logs of actors that ended: tests/support/ray_logs.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gpu_watchdog.sample import ray_node
from ray_logs import DEAD_AFTER_INIT, DEAD_IN_INIT, EXITED_ACTOR, KILLED, KILLED_BY_RAY, SURVIVOR, worker
from repo_paths import REPO

LOGS = REPO / "tests" / "data" / "ray" / "session" / "logs"
RANK0 = ("207b6ce507e6eb808c99a79bf5b9aeceabdd92db45f3d56caafe8e90", 4573)
RANK1 = ("793ff57c8d228be8624e40802fcee8bc9c7601b5e1d2a71355516deb", 4597)
CONTROLLER = ("6abd43596cd2f00ded980074af95983eb5f6add1743b0b5fbe1dc300", 4480)


def _fds(logs: Path, worker: tuple[str, int], kind: str = "worker") -> list[str]:
    wid, pid = worker
    return ["/dev/null", f"{logs}/worker-{wid}-01000000-{pid}.out", f"{logs}/python-core-{kind}-{wid}_{pid}.log",
            "socket:[1234]"]


@pytest.mark.parametrize("cmdline", [
    ["/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp/ray/x"],
    ["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/ray/s"],
    ["/venv/bin/python", "/venv/lib/python3.11/site-packages/ray/dashboard/dashboard.py", "--host=127.0.0.1"],
    ["/venv/bin/python", "-u", "/venv/lib/python3.11/site-packages/ray/_private/log_monitor.py", "--session-dir=x"],
    ["/venv/bin/python", "-u", "/venv/lib/python3.11/site-packages/ray/autoscaler/_private/monitor.py", "--x"],
    ["/venv/bin/python", "/venv/bin/ray", "start", "--head", "--block"],
    ["ray::IDLE" + " " * 60], ["ray::DashboardAgent"], ["ray::RuntimeEnvAgent"], ["ray::JobSupervisor.run"],
])
def test_rays_own_processes_are_services(cmdline: list[str]) -> None:
    assert ray_node.is_service(cmdline)


@pytest.mark.parametrize("cmdline", [
    ["ray::RayTrainWorker" + " " * 60], ["ray::Trainer.train"], ["ray::TrainController.run"],
    ["/venv/bin/python", "train.py", "--ray"], ["/venv/bin/python", "/venv/bin/ray", "job", "submit", "--"],
    ["/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], [],
])
def test_workers_of_a_job_and_other_programs_are_not(cmdline: list[str]) -> None:
    assert not ray_node.is_service(cmdline)


def test_a_worker_still_starting_is_rays_until_the_raylet_hands_it_work() -> None:
    """Before it sets its title (seconds on a loaded host) a worker is ``python …/default_worker.py``: Ray's, looked at
    again like an idle one."""
    argv = ["/venv/bin/python", "/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py",
            "--node-ip-address=127.0.0.1"]
    assert ray_node.starting(argv) and ray_node.idle(argv) and ray_node.is_service(argv)
    assert not ray_node.starting(["ray::Trainer.__init__"]) and not ray_node.starting(["/venv/bin/python", "x.py"])


def test_the_title_names_the_actor_class_whatever_method_runs() -> None:
    assert ray_node.actor_class(["ray::Trainer.train" + " " * 40]) == "Trainer"
    assert ray_node.actor_class(["/venv/bin/python", "x.py"]) == ""
    assert ray_node.idle(["ray::IDLE"]) and not ray_node.idle(["ray::Trainer"])


def test_a_ray_train_worker_is_read_from_its_own_logs() -> None:
    w = ray_node.core_worker(RANK1[1], _fds(LOGS, RANK1))
    assert w is not None and not w.driver and w.complete
    assert (w.worker_id, w.grpc_port, w.actor_id) == (RANK1[0], 35603, "180ac379dfec6e04ee8dd0c801000000")
    assert w.train == ray_node.TrainRank(world_rank=1, local_rank=1, node_rank=0, world_size=2,
                                         run_name="ray_train_run-2026-11-27_14-30-03")
    w0 = ray_node.core_worker(RANK0[1], _fds(LOGS, RANK0))
    assert w0 is not None and w0.train is not None and w0.train.world_rank == 0 and w0.grpc_port == 38299


def test_an_actor_that_is_no_train_worker_has_no_train_rank() -> None:
    w = ray_node.core_worker(CONTROLLER[1], _fds(LOGS, CONTROLLER))
    assert w is not None and w.train is None and w.grpc_port == 33857 and w.complete


def test_a_log_of_another_pid_or_no_log_is_no_core_worker() -> None:
    assert ray_node.core_worker(RANK1[1] + 1, _fds(LOGS, RANK1)) is None  # a fork holding its parent's fds
    assert ray_node.core_worker(RANK1[1], ["/dev/null", "socket:[1]"]) is None


def test_a_train_record_of_another_pid_names_no_rank(tmp_path: Path) -> None:
    """A worker id's log is only believed for the pid that wrote it."""
    assert ray_node.train_rank(str(LOGS), RANK1[0], RANK0[1]) is None
    assert ray_node.train_rank(str(tmp_path), RANK1[0], RANK1[1]) is None


def test_a_worker_not_yet_an_actor_is_incomplete(tmp_path: Path) -> None:
    """Until the raylet hands it an actor, a worker's log names only its port: read again later."""
    logs = tmp_path / "logs"
    logs.mkdir()
    wid, pid = RANK1
    src = (LOGS / f"python-core-worker-{wid}_{pid}.log").read_text().splitlines()
    (logs / f"python-core-worker-{wid}_{pid}.log").write_text(
        "\n".join(ln for ln in src if "actor_id" not in ln) + "\n")
    w = ray_node.core_worker(pid, _fds(logs, RANK1))
    assert w is not None and w.grpc_port == 35603 and not w.actor_id and not w.complete and w.train is None
    shutil.copytree(LOGS / "train", logs / "train")
    assert ray_node.train_rank(str(logs), wid, pid) is not None


def test_an_actor_is_known_from_its_lease_and_complete_once_its_init_returned() -> None:
    leased = ray_node.core_worker(DEAD_IN_INIT[1], _fds(KILLED, DEAD_IN_INIT))
    assert leased is not None and leased.actor_id == "94c1d9b2c17ae8f7f471022001000000"
    assert not leased.actor_created and not leased.complete and leased.rank() is None
    created = ray_node.core_worker(DEAD_AFTER_INIT[1], _fds(KILLED, DEAD_AFTER_INIT))
    assert created is not None and created.complete and created.actor_repr == "Trainer(rank=1)"
    assert created.rank() == (1, "its actor's __repr__ in Ray's log")


def test_a_workers_records_are_read_after_its_end_and_tell_whether_ray_ended_it() -> None:
    """A SIGKILLed worker logs nothing of its end; one Ray ended on purpose (its driver gone, ray.kill, exit_actor())
    logs why."""
    dead = ray_node.reread(worker(DEAD_AFTER_INIT))
    assert dead.rank() == (1, "its actor's __repr__ in Ray's log") and dead.ended_by_ray == ""
    assert ray_node.reread(worker(DEAD_IN_INIT)).ended_by_ray == ""
    ended = {w: ray_node.reread(worker(w)).ended_by_ray for w in (SURVIVOR, KILLED_BY_RAY, EXITED_ACTOR)}
    assert ended[SURVIVOR].startswith("INTENDED_SYSTEM_EXIT: Worker exits because the actor is killed. The actor is "
                                      "dead because its owner has died."), ended
    assert ended[KILLED_BY_RAY] == ("INTENDED_SYSTEM_EXIT: Worker exits because the actor is killed. The actor is "
                                    "dead because it was killed by `ray.kill`.")
    assert ended[EXITED_ACTOR].startswith("INTENDED_USER_EXIT: Worker exits by an user request.")
    assert all(len(why) <= 160 for why in ended.values())
    assert ray_node.reread(worker(SURVIVOR, pid=1)).actor_id == ""  # another pid's log: nothing


FT_RUN = "ray_train_run-2026-11-27_15-02-11"  # tests/data/ray/session/logs/export_events: max_failures=2, 1 attempt


def test_a_train_runs_fault_tolerance_is_read_from_its_export_events(tmp_path: Path) -> None:
    ft = ray_node.train_fault_tolerance(str(LOGS), FT_RUN)
    assert ft == ray_node.TrainFaultTolerance(FT_RUN, 2, 1) and ft.restarts_left
    assert ft.describe() == f"Ray Train run {FT_RUN}: FailureConfig(max_failures=2), 0 used"
    assert ray_node.train_fault_tolerance(str(LOGS), "another-run") is None
    assert ray_node.train_fault_tolerance(str(tmp_path), FT_RUN) is None  # state tracking off: no events


def test_restarts_left_counts_the_worker_groups_started() -> None:
    assert not ray_node.TrainFaultTolerance("r", 2, 3).restarts_left  # two failures used
    assert ray_node.TrainFaultTolerance("r", -1, 50).restarts_left  # unlimited
    assert not ray_node.TrainFaultTolerance("r", 0, 1).restarts_left  # no fault tolerance
