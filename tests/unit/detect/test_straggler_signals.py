"""The straggler's cheap signal (evidence.straggler.signals, detect.stragglers): each rank's main-thread scheduler
clocks and wait channel every tick — real processes here, whose threads really sleep on a futex, a pipe or a timer,
or really run — and, on a GPU, the device's signature (the NVML stand-in, read through the real pynvml). No stack is
taken in these tests: stack sampling is off."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from gpu_samples import one_gpu_per_rank_one_hot
from gpu_watchdog.config.load import config_from_dict
from gpu_watchdog.detect import stragglers
from gpu_watchdog.detect.detector import RUNNING, STALLED
from gpu_watchdog.evidence.straggler.signals import (
    ThreadClock,
    ThreadShares,
    asleep_as,
    interval_states,
    read_clock,
    shares,
)
from gpu_watchdog.model import JobStatus, NodeSample
from nvml_standin import NvmlStandin
from nvml_standin.fixtures import nvml_standin as _nvml_standin_fixture  # noqa: F401
from nvml_standin.fixtures import nvml_standin_lib as _nvml_standin_lib_fixture  # noqa: F401

# A window of 8 ticks in 2 slices (4 ticks each, the least a slice takes); no stack rounds.
CFG = config_from_dict({"straggler": {"signal_window_s": 8.0, "signal_slices": 2}, "stacks": {"enabled": False}})
TICK_S = 0.25  # real time between reads; the samples' own clock advances a second per tick

WAIT_ON_FUTEX = "import threading; threading.Event().wait()"  # a gloo rank waiting for its collective's work
WAIT_ON_PIPE = "import os; r, w = os.pipe(); os.read(r, 1)"  # a rank waiting for its input
BUSY = "while True: pass"  # a rank at its own work
HALF = ("import threading, time\nev = threading.Event()\nwhile True:\n    end = time.monotonic() + 0.05\n"
        "    while time.monotonic() < end: pass\n    ev.wait(0.05)")  # works half the time, waits the other half


@pytest.fixture
def spawn() -> Iterator:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*codes: str) -> dict[int, int]:
        for code in codes:
            procs.append(subprocess.Popen([sys.executable, "-c", code]))
        time.sleep(1.0)  # past the interpreter's start: each main thread in its steady state
        return {rank: p.pid for rank, p in enumerate(procs[-len(codes):])}

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _run(watch: stragglers.StragglerWatch, js: JobStatus, sample: NodeSample, ticks: int, start: float = 0.0,
         state_at=lambda t: RUNNING) -> list:
    found = []
    for i in range(ticks):
        t = start + i
        found += watch.watch({js.job_id: replace(js, state=state_at(t))}, replace(sample, t=t))
        time.sleep(TICK_S)
    return found


def _job(pids: dict[int, int]) -> JobStatus:
    return JobStatus("j", ranks=tuple(sorted(pids)), rank_pids=pids)


BARE = NodeSample(t=0.0, hostname="node-a", backend="proc")


def _clock(state: str, wchan: str) -> ThreadClock:
    return ThreadClock(0.0, 1, state, 0.0, 0.0, wchan)


@pytest.mark.parametrize(("state", "wchan", "expected"), [
    ("S", "futex_wait_queue", "collective"),  # a collective's completion (or a lock): a wait on its peers
    ("S", "futex_do_wait", "collective"),
    ("S", "pipe_read", "data_wait"),  # its input: a loader's pipe, a socket
    ("S", "unix_stream_read_generic", "data_wait"),
    ("S", "poll_schedule_timeout.constprop.0", "data_wait"),  # queue.get(timeout) polls its pipe first
    ("D", "folio_wait_bit_common", "io"),
    ("D", "", "io"),
    ("S", "hrtimer_nanosleep", "sleep"),  # its own sleep
    ("S", "do_epoll_wait", "unknown"),  # nothing a rule reads: not counted
])
def test_an_asleep_thread_counts_as_what_its_wait_channel_says(state: str, wchan: str, expected: str) -> None:
    assert asleep_as(_clock(state, wchan)) == expected
    assert asleep_as(_clock(state, wchan), last="data_wait") == expected  # asleep now: now says


def test_a_thread_found_running_slept_where_it_last_did() -> None:
    assert asleep_as(_clock("R", "0"), last="collective") == "collective"
    assert asleep_as(_clock("R", ""), last="data_wait") == "data_wait"
    assert asleep_as(_clock("R", "0")) == "unknown"  # never seen asleep: not counted


def test_an_interval_is_split_into_work_and_the_wait_its_channel_names_and_a_gpu_decides_for_its_rank() -> None:
    sh = ThreadShares(1.0, running=0.3, queued=0.1)
    assert interval_states(sh, "collective", None) == pytest.approx({"compute": 0.4, "collective": 0.6})
    assert interval_states(sh, "data_wait", "idle_held") == pytest.approx({"compute": 0.4, "data_wait": 0.6})
    # NCCL: a waiting rank spins on its CPU and on its GPU alike; the GPU tells a wait from work
    spinning_cpu = ThreadShares(1.0, running=1.0, queued=0.0)
    assert interval_states(spinning_cpu, "unknown", "spin") == {"collective": 1.0}
    assert interval_states(spinning_cpu, "unknown", "busy") == {"compute": 1.0}


def test_reading_a_real_thread_and_what_it_did_between_two_reads(spawn) -> None:
    pids = spawn(BUSY, WAIT_ON_FUTEX)
    first = {r: read_clock(p, time.monotonic()) for r, p in pids.items()}
    time.sleep(0.5)
    second = {r: read_clock(p, time.monotonic()) for r, p in pids.items()}
    busy, waiting = (shares(first[r], second[r]) for r in (0, 1))
    assert busy is not None and busy.running + busy.queued > 0.8, busy
    assert waiting is not None and waiting.asleep > 0.9 and "futex" in second[1].wchan, (waiting, second[1])
    assert read_clock(2**22 + 7, 0.0) is None  # gone (or never there): None, no exception
    assert shares(second[0], first[0]) is None  # time going back says nothing


def test_the_rank_at_work_while_its_peers_wait_on_their_collective_is_named_from_the_signal(spawn) -> None:
    pids = spawn(WAIT_ON_FUTEX, BUSY, WAIT_ON_FUTEX)
    watch = stragglers.StragglerWatch(lambda: CFG)
    found = _run(watch, _job(pids), BARE, 14)
    assert len(found) == 1, [f.detail for f in found]
    f = found[0]
    assert (f.kind, f.culprit_ranks, f.basis) == ("straggler", (1,), "signals")
    st = f.facts
    assert st["evidence"] == "signals" and st["pid"] == pids[1] and st["window_s"] == 8.0
    assert st["wait_share"] < 0.1 and st["peer_wait_share"] > 0.9, st
    assert st["origin"] == "work" and "slow because of its work" in f.detail, f.detail  # no cause on its node
    assert st["cpu"]["running_share"] > 1.25 * st["cpu"]["peer_running_share"], st["cpu"]
    assert "of their time over the last 8 s" in f.detail
    assert watch.rank_scores()["j"][1][2] is True


def test_even_ranks_and_ranks_waiting_on_their_input_are_no_straggler(spawn) -> None:
    """Three ranks alike (work half the time, wait on a futex the other half): nobody. A rank waiting on its
    input is not at work: with its peers waiting on a futex it is named — and its cause is its input."""
    pids = spawn(HALF, HALF, HALF)
    watch = stragglers.StragglerWatch(lambda: CFG)
    assert _run(watch, _job(pids), BARE, 14) == []
    assert set(watch.rank_scores()["j"]) == {0, 1, 2}  # every rank scored, none named

    pids = spawn(WAIT_ON_FUTEX, WAIT_ON_PIPE, WAIT_ON_FUTEX)
    found = _run(stragglers.StragglerWatch(lambda: CFG), _job(pids), BARE, 14)
    assert [f.culprit_ranks for f in found] == [(1,)]
    causes = {c["kind"] for c in found[0].facts["causes"]}
    assert causes == {"input"} and found[0].facts["origin"] == "node", found[0].facts


def test_a_stall_restarts_the_signal_window(spawn) -> None:
    pids = spawn(WAIT_ON_FUTEX, BUSY, WAIT_ON_FUTEX)
    watch = stragglers.StragglerWatch(lambda: CFG)
    # stalled at tick 6: the window starts again, so 8 more ticks are needed after it
    found = _run(watch, _job(pids), BARE, 14, state_at=lambda t: STALLED if t == 6 else RUNNING)
    assert found == []
    assert len(_run(watch, _job(pids), BARE, 3, start=14)) == 1


def test_a_thermally_throttled_gpu_the_others_spin_wait_on_is_named_from_the_gpus_alone(
        spawn, nvml_standin: NvmlStandin, tmp_path: Path) -> None:
    """An NCCL job as NVML shows it: ranks 0 and 2's GPUs spin in a collective kernel (SMs 100 %, memory
    controller idle, 90 W of 700), rank 1's works (97 %, memory busy, 640 W) held down by thermal slowdown at 1140 of
    1980 MHz. On their CPUs all three look the same (asleep here; NCCL's spin would be running): only the GPUs tell.
    Named from the signal, with "thermal"."""
    pids = spawn(WAIT_ON_FUTEX, WAIT_ON_FUTEX, WAIT_ON_FUTEX)
    spin = {"utilization_gpu": 100, "utilization_memory": 0, "power_mw": 90_000}
    work = {"utilization_gpu": 97, "utilization_memory": 60, "power_mw": 640_000}
    sample = one_gpu_per_rank_one_hot(nvml_standin, tmp_path, pids, [spin, work, spin], hot=1)
    found = _run(stragglers.StragglerWatch(lambda: CFG), _job(pids), sample, 14)
    assert [f.culprit_ranks for f in found] == [(1,)]
    f = found[0]
    assert f.basis == "signals" and f.devices == (sample.devices[1].uuid,)
    assert f.facts["wait_share"] == 0.0 and f.facts["peer_wait_share"] == 1.0
    gpu = [c for c in f.facts["causes"] if c["kind"] == "gpu_clocks"]
    assert len(gpu) == 1 and "thermal" in gpu[0]["detail"] and f.facts["origin"] == "node"
    assert "thermal" in f.detail


# A Ray Train worker's shape: the main thread in Ray's task loop (``ray/_private/worker.py``'s ``main_loop``, blocked
# in C on a futex, as Ray's C++ loop is), the training function on a thread of its own named as Ray Train names it.
RAY_WORKER_LOOP = '''
import _thread, threading

def main_loop(train):
    threading.Thread(target=train, name="TrainingThread(train_func)", daemon=True).start()
    lock = _thread.allocate_lock()
    lock.acquire()
    lock.acquire()
'''
RAY_TRAIN_WORKER = ("import sys; sys.path.insert(0, {root!r})\nfrom ray._private.worker import main_loop\n"
                    "def train():\n{body}\nmain_loop(train)")


def _ray_train_worker(root: Path, train_body: str) -> str:
    body = "\n".join("    " + line for line in train_body.splitlines())
    return RAY_TRAIN_WORKER.format(root=str(root), body=body)


@pytest.fixture
def fake_ray(tmp_path: Path) -> Path:
    loop = tmp_path / "ray" / "_private"
    loop.mkdir(parents=True)
    (tmp_path / "ray" / "__init__.py").write_text("")
    (loop / "__init__.py").write_text("")
    (loop / "worker.py").write_text(RAY_WORKER_LOOP)
    return tmp_path


# The stack rounds on (their first, taken at once, shows each rank's work thread); their own window too long to
# name anything here.
WITH_STACKS = config_from_dict({"straggler": {"signal_window_s": 8.0, "signal_slices": 2, "window_s": 600.0}})


def test_a_ray_train_worker_is_read_on_its_training_thread_the_stacks_showed(spawn, fake_ray: Path) -> None:
    """Every worker's main thread waits the same in Ray's loop; worker 1's training thread works while its peers'
    wait on their collective: read on the main threads nobody differs, read on the threads the first stack round
    showed doing the work (py-spy, real) worker 1 is named. The same workers all waiting alike: nobody."""
    pids = spawn(*(_ray_train_worker(fake_ray, code) for code in (WAIT_ON_FUTEX, BUSY, WAIT_ON_FUTEX)))
    watch = stragglers.StragglerWatch(lambda: WITH_STACKS)
    found = _run(watch, _job(pids), BARE, 24)
    w = watch._jobs["j"]
    assert set(w.work_tids) == {0, 1, 2} and all(tid not in pids.values() for tid in w.work_tids.values()), w.work_tids
    assert [f.culprit_ranks for f in found] == [(1,)], [f.detail for f in found]
    assert found[0].facts["evidence"] == "signals" and found[0].facts["origin"] == "work"

    pids = spawn(*(_ray_train_worker(fake_ray, WAIT_ON_FUTEX) for _ in range(3)))
    watch = stragglers.StragglerWatch(lambda: WITH_STACKS)
    assert _run(watch, _job(pids), BARE, 24) == []
    assert len(watch._jobs["j"].work_tids) == 3


# A gloo rank's shape: its main thread waits on a futex for the collective's work, which threads of its own do.
WAITS_ON_ITS_OWN_THREAD = ("import threading\ndef work():\n    while True: pass\n"
                           "t = threading.Thread(target=work, daemon=True)\nt.start()\nt.join()")


def test_a_rank_held_by_its_quota_waits_on_its_own_threads_not_on_its_peers(spawn) -> None:
    """Three ranks alike: each main thread waits on a futex while a thread of its own works. Unheld, nobody differs.
    Rank 1's process held to 0.05 of a core: its main thread still only waits on a futex — but for its own starved
    thread, so that wait is its own time, up to the share of the time its quota held it: named, cpu_throttled."""
    from cpu_quota import cpu_quota

    pids = spawn(*[WAITS_ON_ITS_OWN_THREAD] * 3)
    assert _run(stragglers.StragglerWatch(lambda: CFG), _job(pids), BARE, 14) == []
    with cpu_quota([pids[1]], cores=0.05):
        found = _run(stragglers.StragglerWatch(lambda: CFG), _job(pids), BARE, 18)
    assert [f.culprit_ranks for f in found] == [(1,)], [f.detail for f in found]
    causes = {c["kind"] for c in found[0].facts["causes"]}
    assert "cpu_throttled" in causes and found[0].facts["origin"] == "node", found[0].facts


def test_a_held_share_moves_only_that_much_of_a_wait_to_own_time() -> None:
    sh = ThreadShares(1.0, running=0.1, queued=0.1)
    assert interval_states(sh, "collective", None, throttled=0.05) == pytest.approx({"compute": 0.25,
                                                                                   "collective": 0.75})
    assert interval_states(sh, "collective", None, throttled=0.9) == pytest.approx({"compute": 1.0,
                                                                                  "collective": 0.0})
    assert interval_states(sh, "data_wait", None, throttled=0.9) == pytest.approx({"compute": 0.2, "data_wait": 0.8})
    assert interval_states(sh, "collective", "idle_held", throttled=0.9) == pytest.approx(
        {"compute": 0.2, "collective": 0.8})  # a GPU rank's collective is the GPU's work
