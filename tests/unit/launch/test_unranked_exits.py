"""A process of the job that died before its rank was known (launch.exits.name_unranked): named by the rank Ray's
records give it after its end, else by its pid and what names it — never by a rank another process holds, and not at
all when nothing shows it was the job's work or when Ray ended it on purpose. Real Ray 2.60 logs
(tests/support/ray_logs.py)."""

from __future__ import annotations

from gpu_watchdog.launch.exits import exit_label, exit_sections, name_unranked
from gpu_watchdog.model import unknown_rank
from gpu_watchdog.sample.unranked import Unranked
from ray_logs import DEAD_AFTER_INIT, DEAD_IN_INIT, KILLED_BY_RAY, SURVIVOR, worker


def _actor(w: tuple[str, int], title: str = "ray::Trainer.train") -> Unranked:
    """As the scanner last saw it alive: a Ray worker whose log was found, nothing of it read yet."""
    return Unranked(w[1], 0.0, (title,), False, worker(w))


def test_an_actor_whose_repr_was_logged_is_named_by_that_rank_after_its_end() -> None:
    named = name_unranked({14236: (100.0, None, _actor(DEAD_AFTER_INIT))}, named=(), live={0: 14237})
    assert list(named) == [1]
    seen, dead = named[1]
    assert seen == (100.0, None) and dead.process.pid == 14236
    assert dead.label() == ("rank 1 (pid 14236, Ray actor Trainer c6c25460… (worker abddfc89…); its rank from its "
                            "actor's __repr__ in Ray's log, read after it died)")


def test_a_rank_another_process_holds_is_never_given() -> None:
    """Rank 1 is held by a live rank (a restarted actor), or its exit was already seen as another process's: the dead
    one is named by its pid and actor."""
    for named, live in (((), {1: 555}), ((1,), {})):
        out = name_unranked({14236: (100.0, None, _actor(DEAD_AFTER_INIT))}, named, live)
        assert list(out) == [unknown_rank(14236)], (named, live)
        assert out[unknown_rank(14236)][1].label() == "rank unknown (pid 14236, Ray actor Trainer c6c25460… (worker " \
                                                      "abddfc89…))"


def test_an_actor_killed_inside_its_init_is_named_by_its_pid_and_actor() -> None:
    out = name_unranked({23524: (100.0, None, _actor(DEAD_IN_INIT, "ray::Trainer.__init__"))}, (), {})
    assert list(out) == [unknown_rank(23524)] and out[unknown_rank(23524)][1].source == ""


def test_what_is_not_known_as_the_jobs_work_or_that_ray_ended_on_purpose_is_left_out() -> None:
    """A helper that joined nothing, a Ray task's worker, the peer Ray ended when the driver exited, an actor the job
    killed with ray.kill: none of their ends is a failure of a rank. A group member with no Ray records is kept."""
    task = Unranked(31, 0.0, ("ray::load_shard",), False, worker(SURVIVOR, pid=31))  # no such log: no actor
    ended = {30: (100.0, None, Unranked(30, 0.0, ("python", "helper.py"), False)), 31: (100.1, None, task),
             SURVIVOR[1]: (100.2, None, _actor(SURVIVOR)), KILLED_BY_RAY[1]: (100.3, None, _actor(KILLED_BY_RAY))}
    assert name_unranked(ended, (), {}) == {}
    member = Unranked(32, 0.0, ("python", "train.py"), True)
    assert list(name_unranked({**ended, 32: (100.4, 9, member)}, (), {})) == [unknown_rank(32)]


def test_the_incident_names_each_by_its_entry() -> None:
    named = name_unranked({14236: (100.0, None, _actor(DEAD_AFTER_INIT)),
                           23524: (100.5, None, _actor(DEAD_IN_INIT, "ray::Trainer.__init__"))}, (), {})
    sections = exit_sections(named, "node-1")
    assert sections["ray_workers"] == {"1": {"pid": 14236, "title": "ray::Trainer.train", "actor_class": "Trainer",
                                             "actor_id": "c6c254608c34a13c1b11b51e01000000",
                                             "worker_id": DEAD_AFTER_INIT[0], "actor_repr": "Trainer(rank=1)"}}
    unknown = sections["unknown_ranks"]
    assert list(unknown) == ["-23524"]
    assert unknown["-23524"]["pid"] == 23524 and unknown["-23524"]["host"] == "node-1"  # type: ignore[index]
    assert unknown["-23524"]["ray"]["actor_id"] == "94c1d9b2c17ae8f7f471022001000000"  # type: ignore[index]
    assert exit_sections({}, "node-1") == {}


def test_a_dead_rank_that_was_a_ray_worker_is_named_by_its_pid_and_actor() -> None:
    """Rank 1's rank was known while it lived (its ``__repr__`` read from Ray's log): the incident names it by its
    rank, its pid and its Ray actor all the same, as it names one whose rank was read after its end."""
    dead = {1: _actor(DEAD_AFTER_INIT).after_exit()}
    assert exit_label(1, {}, dead) == "rank 1 (pid 14236, Ray actor Trainer c6c25460… (worker abddfc89…))"
    assert exit_label(0, {}, dead) == "rank 0"
    sections = exit_sections({}, "node-1", dead)
    assert list(sections) == ["ray_workers"] and sections["ray_workers"]["1"]["pid"] == 14236  # type: ignore[index]
    assert sections["ray_workers"]["1"]["actor_repr"] == "Trainer(rank=1)"  # type: ignore[index]
