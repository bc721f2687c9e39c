"""Each way a job's ranks are found (sample.ranks), alone: the environment a process started with, and the sources of
a group member's number — Ray Train's record (real Ray 2.60 logs, tests/data/ray), NCCL's dump pipe (a real FIFO), the
live environment (this process, setting RANK in code), a Ray actor's ``__repr__``, the stack — each with what it
claims, from what, and when it is done; and the registry's order."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from gpu_watchdog.model import JobIdentity
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.ranks import MEMBER_SOURCES, Claim, first_claim, none_will_name
from gpu_watchdog.sample.ranks.actor_repr import ActorRepr
from gpu_watchdog.sample.ranks.environment import identity_from_env, rank_from_env
from gpu_watchdog.sample.ranks.live_environment import LiveEnvironment
from gpu_watchdog.sample.ranks.nccl_pipe import NcclDumpPipe
from gpu_watchdog.sample.ranks.ray_train import RayTrainRecord
from gpu_watchdog.sample.ranks.stacks import NoRankFinder, Stacks
from repo_paths import REPO

SESSION = REPO / "tests" / "data" / "ray" / "session" / "logs"
TRAIN_RANK1 = ("793ff57c8d228be8624e40802fcee8bc9c7601b5e1d2a71355516deb", 4597)


class Finder:
    def __init__(self, rank: int | None = None, gives_up: bool = False) -> None:
        self.rank, self.gives_up = rank, gives_up

    def __call__(self, pid: int, create_time: float) -> int | None:
        return self.rank

    def gave_up(self, pid: int, create_time: float) -> bool:
        return self.gives_up

    def why(self, pid: int) -> str:
        return "fixed"


@dataclass
class FakeMember:
    """A member as the sources see it (sample.ranks.member.Member), with its facts given."""

    pid: int = 4242
    create_time: float = 0.0
    pipe_stem: str = ""
    env_read_at: float = 0.0
    rank_finder: Finder = field(default_factory=Finder)
    ray: ray_node.CoreWorker | None = None
    ray_final: bool = True
    title: str = "/venv/bin/python"
    reads: int = 0

    def read_ray(self) -> ray_node.CoreWorker | None:
        self.reads += 1
        return self.ray

    def keep_ray(self, worker: ray_node.CoreWorker) -> None:
        self.ray = worker

    def command(self) -> tuple[str, ...]:
        return (self.title,)


def test_the_environment_names_the_rank_and_the_job() -> None:
    assert rank_from_env({"RANK": "2"}) == 2 and rank_from_env({"SLURM_PROCID": "1"}) is None  # a batch shell's
    assert rank_from_env({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}) == 1
    assert identity_from_env({"GPU_WATCHDOG_JOB_ID": "j", "RANK": "0", "WORLD_SIZE": "2"}) == JobIdentity("j", 0, None,
                                                                                                         2)


def test_ray_trains_record_names_a_train_worker_and_is_awaited_while_missing(tmp_path: Path) -> None:
    wid, pid = TRAIN_RANK1
    worker = ray_node.CoreWorker(pid, wid, False, str(SESSION), grpc_port=1, actor_id="a", actor_created=True)
    member = FakeMember(pid=pid, ray=worker, title="ray::RayTrainWorker")
    assert RayTrainRecord().rank(member) == Claim(1, "Ray Train's record of its worker")
    assert member.ray is not None and member.ray.train is not None  # kept for the incident and the next looks
    missing = FakeMember(pid=pid, ray=replace(worker, logs_dir=str(tmp_path)), title="ray::RayTrainWorker")
    assert RayTrainRecord().rank(missing) is None and not RayTrainRecord().done(missing)  # Ray Train logs it later
    actor = FakeMember(pid=pid, ray=replace(worker, logs_dir=str(tmp_path)), title="ray::Trainer")
    assert RayTrainRecord().rank(actor) is None and RayTrainRecord().done(actor)
    assert not RayTrainRecord().done(replace(actor, ray_final=False))
    assert RayTrainRecord().rank(FakeMember()) is None  # no Ray worker


def test_an_nccl_rank_is_named_by_its_dump_pipe(tmp_path: Path) -> None:
    stem = str(tmp_path / "fr-pipe-")
    os.mkfifo(stem + "5.pipe")
    fd = os.open(stem + "5.pipe", os.O_RDONLY | os.O_NONBLOCK)  # this process holds it, as an NCCL rank does
    try:
        me = FakeMember(pid=os.getpid(), pipe_stem=stem)
        assert NcclDumpPipe().rank(me) == Claim(5, "the NCCL dump pipe it holds open")
        assert NcclDumpPipe().rank(FakeMember(pid=os.getpid(), pipe_stem=str(tmp_path / "other-"))) is None
        assert NcclDumpPipe().done(me)  # a gloo rank never opens one
    finally:
        os.close(fd)


def test_the_live_environment_names_a_rank_set_in_code_read_every_few_seconds(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """This process sets RANK in code, as OpenRLHF's actors do (its /proc environ never shows it)."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    member = FakeMember(pid=os.getpid())
    assert not LiveEnvironment().done(member)
    assert LiveEnvironment().rank(member) == Claim(3, "RANK in its live environment", {"RANK": "3", "WORLD_SIZE": "4"})
    assert LiveEnvironment().done(member) and member.env_read_at > 0
    assert LiveEnvironment().rank(member) is None  # not read again before env_read_at
    monkeypatch.delenv("RANK")
    assert LiveEnvironment().rank(FakeMember(pid=os.getpid())) is None


def test_an_actors_repr_names_its_rank_once_logged() -> None:
    worker = ray_node.CoreWorker(7, "ab", False, "/none", grpc_port=1, actor_id="cd")
    assert ActorRepr().rank(FakeMember(ray=worker)) is None  # __init__ still running: no __repr__ logged
    logged = replace(worker, actor_repr="Trainer(rank=2)", actor_created=True)
    assert ActorRepr().rank(FakeMember(ray=logged)) == Claim(2, "its actor's __repr__ in Ray's log")
    assert ActorRepr().rank(FakeMember(ray=replace(logged, actor_repr="Trainer()"))) is None
    assert not ActorRepr().done(FakeMember(ray=worker, ray_final=False))


def test_the_stack_names_a_rank_and_is_done_when_its_reader_gave_up() -> None:
    assert Stacks().rank(FakeMember(rank_finder=Finder(4))) == Claim(4, "a frame of its stack")
    assert Stacks().rank(FakeMember()) is None and not Stacks().done(FakeMember())
    assert Stacks().done(FakeMember(rank_finder=Finder(gives_up=True)))
    assert NoRankFinder()(1, 0.0) is None and NoRankFinder().gave_up(1, 0.0)


def test_the_first_source_in_the_registrys_order_names_the_member_and_none_will_once_all_are_done() -> None:
    """Ray Train's record before the stack (a Train worker's stack may name a local variable ``rank``); the Ray facts
    are read once per look, by the first source."""
    wid, pid = TRAIN_RANK1
    worker = ray_node.CoreWorker(pid, wid, False, str(SESSION), grpc_port=1, actor_id="a", actor_created=True)
    member = FakeMember(pid=pid, ray=worker, title="ray::RayTrainWorker", rank_finder=Finder(0))
    assert first_claim(member) == Claim(1, "Ray Train's record of its worker") and member.reads == 1
    assert [type(s).__name__ for s in MEMBER_SOURCES] == ["RayTrainRecord", "NcclDumpPipe", "LiveEnvironment",
                                                           "ActorRepr", "Stacks"]
    nobody = FakeMember(pid=1 << 30, rank_finder=Finder(gives_up=True))  # no such process: nothing to read
    assert first_claim(nobody) is None and none_will_name(nobody)
    assert not none_will_name(FakeMember(pid=1 << 30, env_read_at=1.0))  # the stack reader still looks
    assert not none_will_name(FakeMember(pid=1 << 30, rank_finder=Finder(gives_up=True), ray_final=False))
