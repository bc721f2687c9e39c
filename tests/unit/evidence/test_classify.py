"""gpu_watchdog.evidence.stacks.classify: real py-spy dumps of small processes for the states a CPU box can produce,
and py-spy-shaped frames for those it cannot (CUDA syncs, native C++ frames of NCCL/gloo waits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.evidence.stacks import classify
from gpu_watchdog.evidence.stacks.classify import STATES, classify_thread, classify_threads, main_thread, signature
from gpu_watchdog.evidence.stacks.dump import dump_stacks
from waiting import wait_blocked

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def fr(name: str, filename: str, line: int = 10, short: str | None = None) -> dict[str, Any]:
    """A frame as py-spy's JSON has it."""
    if short is None:
        short = filename.split("site-packages/")[-1] if "site-packages/" in filename else os.path.basename(filename)
    return {"name": name, "filename": filename, "short_filename": short, "line": line, "module": None,
            "locals": None, "is_entry": False, "is_shim_entry": False}


def native(name: str, lib: str) -> dict[str, Any]:
    return {"name": name, "filename": lib, "short_filename": lib, "line": 0}


def thread(*frames: dict[str, Any], active: bool = False, wchan: str | None = None, **kw: Any) -> dict[str, Any]:
    th: dict[str, Any] = {"pid": 100, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": 100,
                          "active": active, "owns_gil": False, "frames": list(frames)}
    if wchan is not None:
        th["wchan"] = wchan
    th.update(kw)
    return th


MAIN = fr("main", "/job/train.py", 107)
MODULE = fr("<module>", "/job/train.py", 115)


# ---- real processes -------------------------------------------------------------------------------

@pytest.fixture
def proc_dump(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[str]] = []

    def run(code: str, *, busy: bool = False) -> dict[str, Any]:
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                             cwd=tmp_path, start_new_session=True)
        started.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        if busy:
            time.sleep(0.1)  # into the loop after the print
        else:
            wait_blocked(p.pid)  # in the blocking call after the print
        (r,) = dump_stacks([p.pid])
        assert r.ok, r.raw
        mt = main_thread(r.threads, p.pid)
        assert mt is not None
        return mt | {"_pid": p.pid}

    try:
        yield run
    finally:
        for p in started:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def test_real_sleep(proc_dump: Any) -> None:
    th = proc_dump("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    rs = classify_thread(th, rank=0, pid=th["_pid"])
    # py-spy shows no `sleep` frame, only <module>; the kernel wait channel tells it is a sleep.
    assert rs.state == ("sleep" if th.get("wchan") else "unknown")
    assert rs.where == "<module> (<string>:3)" and not rs.active and rs.op is None


def test_real_queue_get(proc_dump: Any) -> None:
    th = proc_dump("import queue\nq = queue.Queue()\nprint('ready', flush=True)\nq.get()\n")
    rs = classify_thread(th, rank=3, pid=th["_pid"])
    assert rs.state == "data_wait"
    assert rs.where.startswith("Queue.get (queue.py:")
    assert rs.signature.startswith("Condition.wait (threading.py:")
    assert " <- Queue.get (queue.py:" in rs.signature and rs.signature.endswith("<module> (<string>:4)")


def test_real_compute(proc_dump: Any) -> None:
    th = proc_dump("""
        def spin():
            x = 0
            while True:
                x = (x * 31 + 7) % 1000003
        print('ready', flush=True)
        spin()
    """, busy=True)
    for _ in range(5):  # on a busy 2-core box the spinner may be descheduled at the sampled instant
        if th["active"]:
            break
        (r,) = dump_stacks([th["_pid"]])
        again = main_thread(r.threads, th["_pid"])
        assert again is not None
        th = again | {"_pid": th["_pid"]}
    rs = classify_thread(th, rank=0, pid=th["_pid"])
    assert rs.state == "compute" and rs.active
    assert rs.where.startswith("spin (<string>:")


def test_real_io_in_save_checkpoint(proc_dump: Any) -> None:
    th = proc_dump("""
        import os
        def save_checkpoint(path):
            with open(path, "wb") as f:
                while True:
                    f.write(os.urandom(1 << 16)); f.flush(); f.seek(0)
        print('ready', flush=True)
        save_checkpoint("ckpt.bin")
    """, busy=True)
    rs = classify_thread(th, rank=0, pid=th["_pid"])
    assert rs.state == "io" and rs.where.startswith("save_checkpoint (<string>:")


# ---- rules on py-spy-shaped frames ------------------------------------------------------------------

def test_collective_from_c10d_frames() -> None:
    logger = "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"
    wrapper = fr("_exception_logger.<locals>.wrapper", logger, 83)
    rs = classify_thread(thread(fr("all_reduce", C10D, 3252), wrapper, MAIN, MODULE), rank=2, pid=100)
    assert (rs.state, rs.op) == ("collective", "all_reduce")
    assert rs.where == "all_reduce (torch/distributed/distributed_c10d.py:3252)"
    assert rs.signature == (
        "all_reduce (torch/distributed/distributed_c10d.py:3252) <- _exception_logger.<locals>.wrapper "
        "(torch/distributed/c10d_logger.py:83) <- main (train.py:107) <- <module> (train.py:115)"
    )
    assert (rs.rank, rs.pid, rs.active) == (2, 100, False)


@pytest.mark.parametrize("op", ["all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor",
                                "broadcast", "barrier", "send", "recv", "all_to_all", "monitored_barrier",
                                "gather", "scatter", "reduce", "all_gather", "reduce_scatter"])
def test_collective_ops(op: str) -> None:
    rs = classify_thread(thread(fr(op, C10D), MAIN), 0, 100)
    assert (rs.state, rs.op) == ("collective", op)


def _installed_collectives() -> list[tuple[str, str]]:
    """(file, function) of every collective the installed torch has: c10d functions that take ``async_op``
    (every collective does, no getter does) and the public functional collectives."""
    import inspect

    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    found = []
    with warnings.catch_warnings():  # looking at every member touches deprecated aliases (reduce_op)
        warnings.simplefilter("ignore", FutureWarning)
        for mod, needs_async in ((c10d, True), (funcol, False)):
            path = str(mod.__file__).replace(os.sep, "/")
            for name, fn in vars(mod).items():
                if not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                    continue
                if needs_async and "async_op" not in inspect.signature(fn).parameters:
                    continue
                if not needs_async and (name.startswith("_") or not classify.COLLECTIVE_WORDS.search(name)):
                    continue
                found.append((path, name))
    return found


def test_every_collective_of_the_installed_torch_is_recognised() -> None:
    """No hand-kept list: torch 2.13's all_gather_single / reduce_scatter_single (FSDP2) and whatever a later
    torch adds are collectives because of where they live, each in a known family."""
    found = _installed_collectives()
    names = {n for _, n in found}
    assert {"all_gather_single", "reduce_scatter_single", "_all_gather_base", "barrier", "all_reduce"} <= names
    assert len(found) >= 25
    for path, name in found:
        rs = classify_thread(thread(fr(name, path), MAIN), 0, 100)
        assert (rs.state, rs.op) == ("collective", name), (path, name)
        assert classify.collective_family(name) in classify.COLLECTIVE_FAMILIES + ("wait",), name


@pytest.mark.parametrize("name, file, family", [
    ("foreach_all_gather", "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "all_gather"),
    ("wait_for_unshard", "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "all_gather"),
    ("foreach_reduce", "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "reduce"),
    ("redistribute", "torch/distributed/tensor/_redistribute.py", None),
    ("all_reduce", "deepspeed/comm/comm.py", "all_reduce"),
    ("wait_tensor", "torch/distributed/_functional_collectives.py", "wait"),
])
def test_library_collective_helpers(name: str, file: str, family: str | None) -> None:
    rs = classify_thread(thread(fr(name, f"/venv/lib/python3.11/site-packages/{file}"), MAIN), 0, 100)
    if family is None:  # a library frame whose name says nothing of communication is not a collective
        assert rs.state != "collective"
    else:
        assert rs.state == "collective" and classify.collective_family(rs.op or "") == family


@pytest.mark.parametrize("native_name", ["c10d::ProcessGroupNCCL::WorkNCCL::wait", "ncclAllReduce",
                                         "gloo::AllreduceRing<float>::run", "c10d::ProcessGroupGloo::AsyncWork::wait"])
def test_native_collective_frames(native_name: str) -> None:
    rs = classify_thread(thread(native(native_name, "libtorch_cpu.so"), MAIN), 0, 100)
    assert rs.state == "collective"


@pytest.mark.parametrize("wchan, status, want", [("pipe_write", "sleeping", "io"), ("nfs_wait_bit_killable", "", "io"),
                                                 ("balance_dirty_pages", "", "io"), ("0", "disk-sleep", "io"),
                                                 ("pipe_read", "", "data_wait"), ("futex_wait_queue", "", None),
                                                 ("hrtimer_nanosleep", "", None), ("", "", None)])
def test_kernel_waits(wchan: str, status: str, want: str | None) -> None:
    assert classify.kernel_wait(wchan, status) == want
    if wchan not in ("", "0") and want is not None:  # the same wait seen in a dump's wait channel
        rs = classify_thread(thread(fr("persist", "/job/ckpt.py"), MAIN, wchan=wchan), 0, 100)
        assert rs.state == want and rs.where == "persist (ckpt.py:10)"


def test_c10d_helper_frame_walks_out_to_the_collective() -> None:
    # Innermost frame is a c10d helper, not a collective: keep walking outward.
    rs = classify_thread(thread(fr("_check_single_tensor", C10D, 900, ), fr("broadcast", C10D, 2800), MAIN,
                                active=True), 0, 100)
    assert (rs.state, rs.op) == ("collective", "broadcast")


def test_collective_inside_save_is_a_collective() -> None:
    rs = classify_thread(thread(fr("barrier", C10D, 5356), fr("save_checkpoint", "/job/train.py", 51), MAIN), 0, 1)
    assert (rs.state, rs.op) == ("collective", "barrier")


def test_torch_save_is_io() -> None:
    ser = "/venv/lib/python3.11/site-packages/torch/serialization.py"
    rs = classify_thread(thread(fr("_save", ser, 1100), fr("save", ser, 960), MAIN, active=True), 0, 1)
    assert rs.state == "io" and rs.where == "_save (torch/serialization.py:1100)"
    st = "/venv/lib/python3.11/site-packages/safetensors/torch.py"
    assert classify_thread(thread(fr("save_file", st), MAIN), 0, 1).state == "io"


def test_native_sleep_under_dataloader_stays_data_wait() -> None:
    dl = "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py"
    th = thread(native("clock_nanosleep", "libc.so.6"), native("time_sleep", "libpython3.11.so.1.0"),
                fr("_MultiProcessingDataLoaderIter._try_get_data", dl, 1100), fr("_next_data", dl, 1300), MAIN)
    rs = classify_thread(th, 0, 1)
    assert rs.state == "data_wait" and rs.where.startswith("_MultiProcessingDataLoaderIter._try_get_data")


def test_multiprocessing_queue_read_is_data_wait_not_io() -> None:
    mp = "/usr/lib/python3.11/multiprocessing/connection.py"
    th = thread(fr("read", mp, 384), fr("Connection._recv_bytes", mp, 400),
                fr("Queue.get", "/usr/lib/python3.11/multiprocessing/queues.py", 103), MAIN)
    assert classify_thread(th, 0, 1).state == "data_wait"


def test_native_sleep_reports_the_python_caller() -> None:
    th = thread(native("clock_nanosleep", "libc.so.6"), native("time_sleep", "libpython3.11.so.1.0"),
                fr("main", "/job/train.py", 94), MODULE)
    rs = classify_thread(th, 1, 1)
    assert rs.state == "sleep" and rs.where == "main (train.py:94)"
    assert rs.signature == "main (train.py:94) <- <module> (train.py:115)"  # native frames left out


def test_kernel_wchan_decides_only_when_python_frames_do_not() -> None:
    assert classify_thread(thread(MAIN, wchan="hrtimer_nanosleep"), 0, 1).state == "sleep"
    assert classify_thread(thread(MAIN, wchan="futex_wait_queue"), 0, 1).state == "unknown"
    rs = classify_thread(thread(fr("all_reduce", C10D), MAIN, wchan="hrtimer_nanosleep"), 0, 1)
    assert rs.state == "collective"


def test_a_thread_in_uninterruptible_sleep_is_an_io_wait() -> None:
    """State D (a hung NFS mount, a vfork parent) is an I/O wait whatever the wait channel is called; Python
    frames that say more still win."""
    rs = classify_thread(thread(MAIN, wchan="kernel_clone", kstate="D"), 0, 1)
    assert (rs.state, rs.where) == ("io", "main (train.py:107)")
    assert classify_thread(thread(MAIN, wchan="0", kstate="D"), 0, 1).state == "io"
    assert classify_thread(thread(MAIN, wchan="kernel_clone", kstate="S"), 0, 1).state == "unknown"
    assert classify_thread(thread(fr("all_reduce", C10D), MAIN, kstate="D"), 0, 1).state == "collective"


def test_native_work_wait_is_a_collective_wait() -> None:
    th = thread(native("pthread_cond_wait", "libc.so.6"), native("c10d::Work::wait", "libtorch_cpu.so"),
                native("pybind11::cpp_function::dispatcher", "libtorch_python.so"), fr("main", "/job/train.py", 60))
    rs = classify_thread(th, 0, 1)
    assert (rs.state, rs.op, rs.where) == ("collective", "wait", "main (train.py:60)")


def test_device_sync() -> None:
    cuda = "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py"
    assert classify_thread(thread(fr("synchronize", cuda, 1000), MAIN), 0, 1).state == "device_sync"
    th = thread(native("cuStreamSynchronize", "libcuda.so.1"), native("cudaStreamSynchronize", "libcudart.so.12"),
                native("at::native::_local_scalar_dense_cuda", "libtorch_cuda.so"), fr("main", "/job/train.py", 70))
    rs = classify_thread(th, 0, 1)
    assert rs.state == "device_sync" and rs.where == "main (train.py:70)"


def test_compute_unknown_and_empty() -> None:
    assert classify_thread(thread(MAIN, active=True), 0, 1).state == "compute"
    rs = classify_thread(thread(MAIN), 0, 1)
    assert (rs.state, rs.where) == ("unknown", "main (train.py:107)")
    rs = classify_thread(thread(), 0, 1)
    assert (rs.state, rs.where, rs.signature) == ("unknown", "", "")


def test_every_rule_state_is_known_and_table_is_extendable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {state for state, _ in classify.RULES} <= set(STATES)
    th = thread(fr("upload_shard", "/job/ckpt.py", 5), MAIN)
    assert classify_thread(th, 0, 1).state == "unknown"
    monkeypatch.setattr(classify, "RULES", [("io", lambda f: "" if f["name"] == "upload_shard" else None),
                                            *classify.RULES])
    assert classify_thread(th, 0, 1).state == "io"


def test_main_thread_selection() -> None:
    worker = thread(MAIN, thread_name="producer", os_thread_id=101)
    by_name = thread(MAIN, thread_name="MainThread", os_thread_id=100)
    unnamed = thread(MAIN, thread_name=None, os_thread_id=100)
    assert (main_thread([worker, by_name]) or {}).get("thread_name") == "MainThread"
    assert (main_thread([worker, unnamed], pid=100) or {}).get("os_thread_id") == 100
    assert main_thread([worker], pid=100) is None
    assert classify_threads([worker], 0, 100) is None
    assert signature(thread(native("x", "libc.so.6"))) == "x (libc.so.6)"


# Dumps of a real Ray Train job (Ray 2.60, gloo DDP): each worker's main thread idles in Ray's task loop while Ray
# Train runs the training function on "TrainingThread(…)"; rank 1 blocked in Event.wait, rank 0 in DDP's all-reduce.
RAY_STACKS = Path(__file__).resolve().parents[2] / "data" / "ray" / "stacks"


def _ray_dump(name: str) -> dict[str, Any]:
    import json

    return json.loads((RAY_STACKS / name).read_text())


def test_a_ray_train_worker_is_judged_by_its_training_thread_and_its_counters() -> None:
    d1 = _ray_dump("ray_train_rank1_in_event_wait.json")
    rs = classify_threads(d1["threads"], 1, d1["pid"])
    assert rs is not None and rs.state == "unknown", rs
    assert "[thread TrainingThread(" in rs.where and rs.where.startswith("Condition.wait"), rs.where
    train = next(t for t in d1["threads"] if str(t["thread_name"]).startswith("TrainingThread"))
    main = next(t for t in d1["threads"] if t["thread_name"] == "MainThread")
    assert main["wakeups_after"] > train["wakeups_after"]  # Ray's task loop wakes all the time; training does not
    assert (rs.wakeups_before, rs.wakeups_after) == (train["wakeups_before"], train["wakeups_after"])
    d0 = _ray_dump("ray_train_rank0_in_backward.json")
    rs0 = classify_threads(d0["threads"], 0, d0["pid"])
    assert rs0 is not None and (rs0.state, rs0.op) == ("collective", "ddp_all_reduce"), rs0


def test_a_ray_train_worker_whose_task_loop_is_caught_running_is_still_judged_by_its_training_thread() -> None:
    """py-spy shows Ray's main thread active when its C++ loop runs at the dump (CI, a saturated host: one dump of a
    confirming pair judged ``Worker.main_loop`` as compute, the other the training thread's ``Event.wait``)."""
    for name, state in (("ray_train_rank1_in_event_wait.json", "unknown"), ("ray_train_rank0_in_backward.json",
                                                                          "collective")):
        d = _ray_dump(name)
        threads = [dict(t, active=True) if t["thread_name"] == "MainThread" else t for t in d["threads"]]
        rs = classify_threads(threads, 0, d["pid"])
        assert rs is not None and rs.state == state and "[thread TrainingThread(" in rs.where, rs


def test_a_main_thread_in_rays_task_loop_with_no_work_thread_is_the_ranks_state() -> None:
    """An actor between two calls: nothing but Ray's own threads, so the main thread (waiting for work) is judged."""
    d1 = _ray_dump("ray_train_rank1_in_event_wait.json")
    ray_only = [t for t in d1["threads"] if not str(t["thread_name"]).startswith("TrainingThread")]
    rs = classify_threads(ray_only, 1, d1["pid"])
    assert rs is not None and rs.where.startswith("Worker.main_loop") and "[thread" not in rs.where, rs
