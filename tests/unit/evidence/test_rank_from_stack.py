"""A rank handed its rank in code, read from its stack's locals: the real dumps of the tutorial's mp.spawn and of
Lightning's ddp_spawn, the orders of belief, and a real process read through py-spy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from gpu_watchdog.evidence.stacks import spawned_ranks
from gpu_watchdog.evidence.stacks.spawned_ranks import SpawnedRanks, no_rank_warning, rank_from_stack
from repo_paths import REPO

DATA = REPO / "tests" / "data" / "spawned"


def _dump(name: str) -> tuple[list[dict], int]:
    threads = json.loads((DATA / name).read_text())
    main = next(t for t in threads if t["thread_name"] == "MainThread")
    return threads, main["os_thread_id"]


@pytest.mark.parametrize(("name", "rank", "where"), [
    ("mp_spawn_rank0_in_backward.json", 0, "argument rank of demo_basic"),
    ("mp_spawn_rank1_in_lock.json", 1, "argument rank of demo_basic"),
    ("lightning_ddp_spawn_rank0.json", 0, "spawn index i of _wrap"),
    ("lightning_ddp_spawn_rank1.json", 1, "spawn index i of _wrap"),
])
def test_real_dumps_name_their_rank(name: str, rank: int, where: str) -> None:
    threads, pid = _dump(name)
    assert rank_from_stack(threads, pid) == (rank, where)


def _frame(name: str, filename: str = "/job/train.py", **values: tuple[str, bool]) -> dict:
    return {"name": name, "filename": filename, "line": 1,
            "locals": [{"name": k, "repr": r, "arg": a} for k, (r, a) in values.items()]}


def _threads(*frames: dict) -> list[dict]:  # frames innermost first, as py-spy lists them
    return [{"thread_name": "MainThread", "os_thread_id": 7, "frames": list(frames)}]


def test_an_argument_beats_a_variable_and_the_spawn_index_and_the_outermost_one_wins() -> None:
    threads = _threads(
        _frame("inner", rank=("5", True)),  # a helper deeper down: not the entry point's own rank
        _frame("main_worker", local_rank=("1", True), rank=("9", False)),
        _frame("train", global_rank=("3", True)),
        _frame("_wrap", "/site/torch/multiprocessing/spawn.py", i=("1", True)),
    )
    assert rank_from_stack(threads, 7) == (3, "argument global_rank of train")
    # A hand-written multi-node loop: main_worker(local_rank) computes rank = node_rank * nprocs + local_rank.
    threads = _threads(_frame("step"), _frame("main_worker", local_rank=("1", True), rank=("9", False)),
                       _frame("_wrap", "/site/torch/multiprocessing/spawn.py", i=("1", True)))
    assert rank_from_stack(threads, 7) == (9, "variable rank of main_worker")


def test_a_rank_that_is_not_an_int_is_no_rank_and_nothing_is_said_without_one() -> None:
    threads = _threads(_frame("train", rank=("<Tensor at 0x7f00>", True)), _frame("main"))
    rank, why = rank_from_stack(threads, 7)
    assert rank is None and "no frame names a rank" in why
    assert rank_from_stack([], 7) == (None, "no main-thread stack")
    # The spawn index only counts in torch's own _wrap (a user function called _wrap proves nothing).
    assert rank_from_stack(_threads(_frame("_wrap", i=("2", True))), 7)[0] is None


SPAWNED = """
import sys, time
import torch.multiprocessing as mp

def train(rank, world_size):
    print("up", flush=True)
    time.sleep(120)

if __name__ == "__main__":
    mp.spawn(train, args=(2,), nprocs=2)
"""


def test_a_real_spawned_process_is_read_in_the_background(tmp_path: Path) -> None:
    """The finder answers at once (None) while py-spy reads the process, then the rank; one dump per process."""
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    main = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert main.stdout is not None
        main.stdout.readline(), main.stdout.readline()  # both ranks are inside train()
        import psutil

        kids = [c for c in psutil.Process(main.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(kids) == 2
        finder = SpawnedRanks(timeout_s=20.0)
        try:
            found: dict[int, int | None] = {}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len([r for r in found.values() if r is not None]) < 2:
                found = {k.pid: finder(k.pid, k.create_time()) for k in kids}
                time.sleep(0.2)
            assert sorted(found.values()) == [0, 1], (found, [finder.why(k.pid) for k in kids])
        finally:
            finder.close()
    finally:
        os.killpg(main.pid, signal.SIGKILL)  # the spawned ranks are in its session
        main.wait()


def test_the_finder_gives_up_after_its_last_look_names_no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose frames name no rank: unknown while looks remain, then given up (the scanner then watches it
    with its rank unknown); a real py-spy dump each time."""
    monkeypatch.setattr(spawned_ranks, "RETRY_S", 0.2)
    proc = subprocess.Popen([sys.executable, "-c", "import time\ndef serve(port):\n    time.sleep(60)\nserve(1)"])
    finder = SpawnedRanks(timeout_s=20.0)
    try:
        ctime = psutil.Process(proc.pid).create_time()
        assert not finder.gave_up(proc.pid, ctime)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not finder.gave_up(proc.pid, ctime):
            assert finder(proc.pid, ctime) is None
            time.sleep(0.1)
        assert finder.gave_up(proc.pid, ctime), finder.why(proc.pid)
        assert "no frame names a rank" in finder.why(proc.pid)
        assert not finder.gave_up(proc.pid, ctime + 1)  # another process under a reused pid is not
    finally:
        finder.close()
        proc.kill()
        proc.wait()


def test_the_no_rank_warning_says_what_was_seen_and_what_to_do() -> None:
    line = no_rank_warning("j1", 60.4, [101], [100, 102], why=lambda p: "py-spy: permission denied")
    assert line.startswith("WARNING: job j1: no rank found 60 s after it started")
    assert "1 process(es) joined a process group but their rank could not be read (pid 101: py-spy: permission " \
           "denied)" in line
    assert "2 process(es) with no RANK that joined no process group: pid 100" in line
    assert "RANK (torchrun, srun)" in line and "\n" not in line
    assert "Seen: no process at all." in no_rank_warning("j1", 60, [], [])
