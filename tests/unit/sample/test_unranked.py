"""A process that may be a rank of its job but whose rank no source gave yet (sample.unranked): what names it while it
lives and after it died, read from real Ray 2.60 logs of killed actors (tests/support/ray_logs.py)."""

from __future__ import annotations

from dataclasses import replace

from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.unranked import Unranked, command_text
from ray_logs import DEAD_AFTER_INIT, DEAD_IN_INIT, worker


def test_what_joined_the_group_or_hosts_an_actor_may_be_a_rank_and_nothing_else() -> None:
    helper = Unranked(pid=7, create_time=0.0, command=("python", "helper.py"), joined=False)
    assert not helper.may_be_rank
    assert replace(helper, joined=True).may_be_rank
    task = Unranked(8, 0.0, ("ray::load_shard",), False, ray_node.CoreWorker(8, "ab", False, "/none", grpc_port=1))
    assert not task.may_be_rank and not task.ray_actor  # a Ray task's worker: no actor of the job
    actor = replace(task, ray=replace(task.ray, actor_id="cd"))  # type: ignore[arg-type]
    assert actor.may_be_rank and actor.ray_actor


def test_an_actor_killed_after_its_init_is_named_by_rays_records_read_after_its_end() -> None:
    """As last seen alive its log had told only the worker; read again after its end, the log names its actor and the
    rank its ``__repr__`` declares."""
    last_seen = Unranked(DEAD_AFTER_INIT[1], 0.0, ("ray::Trainer.train" + " " * 40,), False,
                         worker(DEAD_AFTER_INIT))
    assert not last_seen.may_be_rank and last_seen.rank() is None
    after = last_seen.after_exit()
    assert after.may_be_rank and after.rank() == (1, "its actor's __repr__ in Ray's log")
    assert after.what() == "Ray actor Trainer c6c25460… (worker abddfc89…)"
    entry = after.describe("node-1")
    assert (entry["host"], entry["pid"], entry["command"]) == ("node-1", 14236, "ray::Trainer.train")
    assert entry["ray"] == {"pid": 14236, "title": "ray::Trainer.train", "actor_class": "Trainer",
                            "actor_id": "c6c254608c34a13c1b11b51e01000000", "worker_id": DEAD_AFTER_INIT[0],
                            "actor_repr": "Trainer(rank=1)"}


def test_an_actor_killed_inside_its_init_has_no_rank_but_its_actor() -> None:
    after = Unranked(DEAD_IN_INIT[1], 0.0, ("ray::Trainer.__init__",), False, worker(DEAD_IN_INIT)).after_exit()
    assert after.may_be_rank and after.rank() is None
    assert after.what() == "Ray actor Trainer 94c1d9b2… (worker a4aa9820…)"


def test_a_process_without_ray_records_is_named_by_its_command() -> None:
    member = Unranked(9, 0.0, ("python", "-u", "train.py", "--lr", "0.1"), True)
    assert member.after_exit() == member and member.rank() is None
    assert member.what() == "python -u train.py --lr 0.1"
    assert member.describe("n") == {"host": "n", "pid": 9, "command": "python -u train.py --lr 0.1"}
    assert command_text(["ray::Trainer" + " " * 300, "x" * 300], 20) == "ray::Trainer xxxx..."
