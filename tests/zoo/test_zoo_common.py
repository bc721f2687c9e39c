"""The zoo's shared plumbing (zoo_common, data_service): faults fire only in the runs asked for, events are
written where the rows read them, the slow data service trickles and the stalling one never answers, the shared
training loop keeps the order the programs had (batch, slow phase, step, straggler, checkpoint, "step")."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from zoo_runs import ZOO, data_service

sys.path.insert(0, str(ZOO))
import zoo_common as zc  # noqa: E402  (beside the programs, as they import it)


def _args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    base = {"variant": "healthy", "rank": 2, "hang_step": 4, "hang_runs": 1, "pause_s": 1.0, "workdir": str(tmp_path),
            "events": str(tmp_path / "events.jsonl"), "data_addr": ""}
    return argparse.Namespace(**{**base, **kw})


def test_a_fault_fires_only_in_the_runs_asked_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = _args(tmp_path, hang_runs=2)
    for run, armed in (("0", True), ("1", True), ("2", False)):
        monkeypatch.setenv("GPU_WATCHDOG_RESTART_COUNT", run)
        assert zc.fault_armed(args) is armed


def test_events_carry_the_rank_and_the_onset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.delenv("GPU_WATCHDOG_RESTART_COUNT", raising=False)
    args = _args(tmp_path, variant="subprocess_wait", rank=1)  # a fault aimed at another rank: nothing here
    zc.slow_phase(args, 4, 2)
    zc.slow_phase(args, 3, 1)  # not the hang step
    zc.event(args, "hang_onset", step=4)
    (ev,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ev["rank"] == 2 and ev["event"] == "hang_onset" and ev["step"] == 4 and ev["t"] <= time.time()


def test_the_slow_service_trickles_and_the_stalling_one_never_answers(tmp_path: Path) -> None:
    with data_service(every_s=0.2, chunks=3) as addr:
        t0 = time.monotonic()
        assert zc.read_shard(_args(tmp_path, data_addr=addr), "slow") == b"x" * 3072
        assert time.monotonic() - t0 >= 0.6
        host, port = addr.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"stall 0\n")
            s.settimeout(1.0)
            with pytest.raises(socket.timeout):
                s.recv(1)


def _events(tmp_path: Path) -> list[tuple[str, int | None]]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [(ev["event"], ev.get("step")) for ev in map(json.loads, lines)]


def _loop_args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    return _args(tmp_path, **{"steps": 5, "ckpt_every": 2, "step_s": 0.0, **kw})


def test_the_loop_resumes_from_its_checkpoint_and_saves_every_few_steps(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "0")
    model = zc.small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ran: list[int] = []
    saved: list[int] = []
    zc.train_loop(_loop_args(tmp_path), 0, ran.append, checkpoint=(model, opt), save=saved.append)
    assert ran == [0, 1, 2, 3, 4] and saved == [0, 2, 4]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 4
    assert _events(tmp_path) == [("start", 0), *(("step", s) for s in range(5)), ("done", None)]
    (tmp_path / "events.jsonl").unlink()
    zc.train_loop(_loop_args(tmp_path, steps=7), 0, ran.append, checkpoint=(model, opt))  # the next run resumes
    assert ran[5:] == [5, 6] and _events(tmp_path)[:2] == [("start", 5), ("step", 5)]


def test_the_loop_draws_each_batch_before_the_slow_phase(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As ``for x, y in loader`` does: a rank whose batch never comes never reaches its step's slow phase."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("GPU_WATCHDOG_RESTART_COUNT", raising=False)
    log: list[str] = []

    def loader() -> Iterator[int]:
        for i in range(9):
            log.append(f"draw {i}")
            yield i * 10

    with pytest.raises(RuntimeError, match="injected crash at step 1"):
        zc.train_loop(_loop_args(tmp_path, variant="crash", rank=0, hang_step=1), 0,
                      lambda step, batch: log.append(f"step {step}: {batch}"), batches=loader())
    assert log == ["draw 0", "step 0: 0", "draw 1"]
    assert _events(tmp_path) == [("start", 0), ("step", 0), ("hang_onset", 1)]  # no "done" after a crash


def test_the_loop_ends_with_the_shorter_of_steps_and_batches_and_done_comes_after_its_context(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "0")
    args = _loop_args(tmp_path)

    @contextlib.contextmanager
    def joined() -> Iterator[None]:
        yield
        zc.event(args, "joined")

    drawn: list[object] = []
    zc.train_loop(args, 0, lambda step, batch: drawn.append(batch), batches="abc", within=joined())
    zc.train_loop(args, 0, lambda step, batch: drawn.append(batch), batches="abcdefgh", steps=2)
    assert drawn == ["a", "b", "c", "a", "b"]
    assert [name for name, _ in _events(tmp_path)] == ["start", "step", "step", "step", "joined", "done",
                                                       "start", "step", "step", "done"]


def test_a_straggler_sleeps_after_each_step_unless_the_program_has_none(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "1")
    slept: list[float] = []
    monkeypatch.setattr(zc.time, "sleep", slept.append)
    args = _loop_args(tmp_path, variant="straggler", steps=3, step_s=0.5)
    zc.train_loop(args, 1, lambda step: None)
    assert slept == [0.5, 0.5] * 3  # the straggler's, then step_done's
    slept.clear()
    zc.train_loop(args, 1, lambda step: None, straggler=False)
    assert slept == [0.5] * 3


@pytest.mark.parametrize("zero_grad_last", [False, True])
def test_the_plain_step_trains_and_zeroes_the_gradients_where_asked(zero_grad_last: bool) -> None:
    model = zc.small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    train = zc.plain_step(model, opt, zero_grad_last=zero_grad_last)
    train(0)
    train(1, zc.batch(4))  # a batch the loop hands over
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all((p.grad is None) == zero_grad_last for p in model.parameters())


def test_the_process_group_is_up_in_the_body_and_gone_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    with zc.process_group() as rank:
        assert rank == 0 and dist.is_initialized() and zc.rank() == 0
    assert not dist.is_initialized()
