"""A rank that waits on its GPU is not computing (evidence.stacks.collect's native re-dump, classify's ``gpu_line``).

Measured on an H200 (tests/data/real-gpu/, copied from the shared captures): a rank waiting in NCCL spins in
``cudaStreamSynchronize`` under ``loss.item()``; py-spy without ``--native`` shows it *active* at that line (read as
compute), with ``--native`` ``cuStreamSynchronize`` (device_sync) at 1.3 s a dump. The captures are replayed here by a
stand-in py-spy (the way test_stacks injects one: ``StacksConfig.py_spy``) against a real process; the rest runs the
real py-spy against real processes parked in C at a ``loss.item()`` line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.config.schema import Config, StacksConfig
from gpu_watchdog.detect.detector import SUSPECT, DetectorState
from gpu_watchdog.engine.loop import Engine
from gpu_watchdog.evidence.stacks import source_lines as source
from gpu_watchdog.evidence.stacks.classify import GPU_LINE, classify_threads, device_sync_call
from gpu_watchdog.evidence.stacks.collect import (
    classify_results,
    collect_stack_evidence,
    dump_job,
    merge_native,
    pids_on_gpu,
)
from gpu_watchdog.evidence.stacks.diagnosis import RankContext, communication_evidence, diagnose, rank_moved
from gpu_watchdog.evidence.stacks.dump import DumpResult, dump_stacks, find_py_spy
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.model import DeviceSample, GpuProcess, JobStatus, NodeSample
from gpu_watchdog.store.fallback_levels import FallbackStore
from waiting import wait_blocked

DATA = Path(__file__).resolve().parents[2] / "data" / "real-gpu"
HANG = DATA / "nccl-hang"
# The capture's own verdicts (the headers of stacks.txt): what each fixture must classify as.
CAPTURED = {
    "nccl-hang/pid-1180.json": ("compute", True), "nccl-hang/pid-1180-native.json": ("device_sync", True),
    "nccl-hang/pid-1182.json": ("unknown", False), "nccl-hang/pid-1182-native.json": ("unknown", False),
    "slow-save/pid-475-native.json": ("sleep", False), "slow-save/pid-476-native.json": ("device_sync", True),
}
# Line 117 of the job's train.py is where rank 0 sat (the capture keeps no source: this is the line it names).
TRAIN_PY = "\n" * 116 + "        loss_value = loss.item()  # blocks behind DDP's all-reduce\n"


def load(name: str) -> list[dict[str, Any]]:
    threads: list[dict[str, Any]] = json.loads((DATA / name).read_text())
    return threads


# ---- the captures ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_the_fixtures_classify_as_the_capture_did(name: str) -> None:
    th = load(name)
    rs = classify_threads(th, 0, th[0]["pid"])
    assert rs is not None and (rs.state, rs.active) == CAPTURED[name]


def test_the_fixtures_are_the_capture_unchanged() -> None:
    for case in ("nccl-hang", "slow-save"):
        text = (DATA / case / "stacks.txt").read_text()
        assert text.startswith("pid ") and "cuStreamSynchronize (libcuda.so.580.159.04)" in text
    # every frame of the native capture of rank 0 is in its fixture, innermost first
    frames = [f["name"] for f in load("nccl-hang/pid-1180-native.json")[0]["frames"]]
    assert frames[9:12] == ["cuStreamSynchronize", "0x7fbbdae12003", "cudaStreamSynchronize"]
    assert frames[-2:] == ["<module>", "0x7fbbdbc2a1ca"] and len(frames) == 24


def test_diagnosis_counts_a_device_sync_rank_among_the_waiting() -> None:
    """Rank 0 waits on the GPU behind the all-reduce rank 1 never joined: read as compute, nobody is named; read
    as device_sync, it waits in communication and rank 1 (in its own Event.wait) is the culprit."""
    r1 = classify_threads(load("nccl-hang/pid-1182.json"), 1, 1182)
    compute = classify_threads(load("nccl-hang/pid-1180.json"), 0, 1180)
    sync = classify_threads(load("nccl-hang/pid-1180-native.json"), 0, 1180)
    assert r1 is not None and compute is not None and sync is not None
    assert diagnose([compute, r1]).culprit_ranks == ()
    d = diagnose([sync, r1])
    assert d.culprit_ranks == (1,) and "rank 0 waits in device_sync" in d.reason
    assert communication_evidence(d, [sync, r1]) == "stacks: rank 0 waits in device_sync"
    # never alive by its CPU: an active compute rank "moved", a device_sync one only if it woke or moved bytes
    assert rank_moved(compute, compute) and not rank_moved(sync, sync)
    assert not rank_moved(sync, replace(sync, wakeups_before=5), RankContext())  # a's wakeups_after unknown
    # slow-save: rank 1 waits on the GPU while rank 0 sleeps between writes: the sleeper is the one behind
    r475 = classify_threads(load("slow-save/pid-475-native.json"), 0, 475)
    r476 = classify_threads(load("slow-save/pid-476-native.json"), 1, 476)
    assert r475 is not None and r476 is not None
    assert diagnose([r475, r476]).culprit_ranks == (0,)


# ---- the captures replayed by a stand-in py-spy against a real process -------------------------------------------

def _spawn(code: str, cwd: Path, *, busy: bool = False) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, cwd=cwd,
                         start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    if busy:
        time.sleep(0.1)
    else:
        wait_blocked(p.pid)
    return p


def _kill(p: subprocess.Popen[str]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[dict[int, int]]:
    """Two real sleeping processes standing in for ranks 0 and 1, in a directory holding train.py."""
    (tmp_path / "train.py").write_text(TRAIN_PY)
    procs = [_spawn("import time\nprint('ready', flush=True)\ntime.sleep(120)\n", tmp_path) for _ in range(2)]
    try:
        yield {0: procs[0].pid, 1: procs[1].pid}
    finally:
        for p in procs:
            _kill(p)


def stand_in(tmp_path: Path, replies: dict[int, tuple[str, str | None]]) -> tuple[str, Path]:
    """A py-spy that prints the capture of a pid (pid → (plain fixture, native fixture or None: --native is refused
    with py-spy's own permission error)) and logs its arguments, one line per call."""
    log = tmp_path / "calls.log"
    path = tmp_path / "py-spy"
    table = {str(pid): [str(DATA / plain), str(DATA / nat) if nat else None] for pid, (plain, nat) in replies.items()}
    path.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
plain, native = {table!r}[args[args.index("--pid") + 1]]
if "--native" in args and native is None:
    sys.stderr.write("Permission Denied: Try running again with elevated permissions\\n")
    sys.exit(1)
sys.stdout.write(open(native if "--native" in args else plain).read())
""")
    path.chmod(0o755)
    return str(path), log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_gpu_rank_read_as_compute_gets_a_native_dump_that_says_device_sync(tmp_path: Path,
                                                                             ranks: dict[int, int]) -> None:
    exe, log = stand_in(tmp_path, {ranks[0]: ("nccl-hang/pid-1180.json", "nccl-hang/pid-1180-native.json"),
                                   ranks[1]: ("nccl-hang/pid-1182.json", "nccl-hang/pid-1182-native.json")})
    cfg = StacksConfig(py_spy=exe)
    results = dump_job(ranks, cfg, gpu_pids={ranks[0], ranks[1]})
    # one plain dump of each rank, then --native only for rank 0 (rank 1 waits in Python: nothing to look closer at)
    native = [c for c in calls(log) if "--native" in c]
    assert len(calls(log)) == 3 and native == [f"dump --pid {ranks[0]} --json --native"]
    assert all("--nonblocking" in c for c in calls(log) if "--native" not in c)
    r0 = results[0]
    assert r0.ok and "native re-dump used" in r0.detail and "--- py-spy dump --native (ok) ---" in r0.raw
    assert any(f["name"] == "cuStreamSynchronize" for f in r0.threads[0]["frames"])  # the incident keeps these
    stacks = {rs.rank: rs for rs in classify_results(results)}
    assert (stacks[0].state, stacks[0].where) == ("device_sync", "<module> (train.py:117)")
    assert stacks[1].state == "unknown"
    assert diagnose(list(stacks.values())).culprit_ranks == (1,)


def test_the_engine_path_stamps_the_tick_and_redumps(tmp_path: Path, ranks: dict[int, int]) -> None:
    exe, log = stand_in(tmp_path, {ranks[0]: ("nccl-hang/pid-1180.json", "nccl-hang/pid-1180-native.json"),
                                   ranks[1]: ("nccl-hang/pid-1182.json", None)})
    (ev,) = collect_stack_evidence("job", ranks, StacksConfig(py_spy=exe), 123.0, frozenset({ranks[0]}))
    assert ev.t == 123.0 and [rs.state for rs in ev.ranks] == ["device_sync", "unknown"]


def test_a_cpu_rank_is_never_redumped(tmp_path: Path, ranks: dict[int, int]) -> None:
    """gloo on CPUs: an active rank at ``loss.item()`` computes (``.item()`` of a CPU tensor returns at once)."""
    exe, log = stand_in(tmp_path, {ranks[0]: ("nccl-hang/pid-1180.json", "nccl-hang/pid-1180-native.json"),
                                   ranks[1]: ("nccl-hang/pid-1182.json", None)})
    stacks = classify_results(dump_job(ranks, StacksConfig(py_spy=exe)))
    assert [c for c in calls(log) if "--native" in c] == []
    assert stacks[0].state == "compute" and stacks[0].active
    assert all(GPU_LINE not in th for res in dump_job(ranks, StacksConfig(py_spy=exe)).values() for th in res.threads)


def test_with_native_configured_nothing_changes(tmp_path: Path, ranks: dict[int, int]) -> None:
    exe, log = stand_in(tmp_path, {ranks[0]: ("nccl-hang/pid-1180.json", "nccl-hang/pid-1180-native.json"),
                                   ranks[1]: ("nccl-hang/pid-1182.json", "nccl-hang/pid-1182-native.json")})
    results = dump_job(ranks, StacksConfig(py_spy=exe, native=True), gpu_pids=set(ranks.values()))
    assert len(calls(log)) == 2 and all("--native" in c for c in calls(log))
    assert "native re-dump" not in results[0].detail
    assert [rs.state for rs in classify_results(results)] == ["device_sync", "unknown"]


def test_a_failed_native_dump_keeps_the_first_and_reads_the_line(tmp_path: Path, ranks: dict[int, int]) -> None:
    """--native refused (ptrace limits): the first dump stays; its line, read through the rank's own cwd (the
    capture names ``train.py``, relative), calls ``loss.item()``: on a GPU that is a device sync."""
    exe, log = stand_in(tmp_path, {ranks[0]: ("nccl-hang/pid-1180.json", None),
                                   ranks[1]: ("nccl-hang/pid-1182.json", None)})
    results = dump_job(ranks, StacksConfig(py_spy=exe), gpu_pids={ranks[0]})
    assert [c for c in calls(log) if "--native" in c] == [f"dump --pid {ranks[0]} --json --native"]
    r0 = results[0]
    first = load("nccl-hang/pid-1180.json")[0]
    assert r0.ok and "native re-dump permission_denied" in r0.detail
    assert r0.threads[0]["frames"] == first["frames"]  # the first dump's threads, ...
    assert r0.threads[0][GPU_LINE] == "loss_value = loss.item()  # blocks behind DDP's all-reduce"  # ... + its line
    assert r0.wakeups_before is not None and r0.wakeups_after is not None  # read around both attempts
    stacks = classify_results(results)
    assert (stacks[0].state, stacks[0].active, stacks[0].where) == ("device_sync", True, "<module> (train.py:117)")
    # the same rank without a GPU: compute
    os.unlink(log)
    assert classify_results(dump_job(ranks, StacksConfig(py_spy=exe)))[0].state == "compute"
    assert calls(log) and not [c for c in calls(log) if "--native" in c]


def test_a_failed_native_dump_with_an_unreadable_line_stays_compute(tmp_path: Path, ranks: dict[int, int]) -> None:
    (tmp_path / "train.py").unlink()
    exe, _ = stand_in(tmp_path, {ranks[0]: ("nccl-hang/pid-1180.json", None),
                                 ranks[1]: ("nccl-hang/pid-1182.json", None)})
    results = dump_job(ranks, StacksConfig(py_spy=exe), gpu_pids={ranks[0]})
    assert GPU_LINE not in results[0].threads[0]
    assert classify_results(results)[0].state == "compute"


def test_merge_spans_both_dumps() -> None:
    first = DumpResult(7, "ok", "1 threads", tuple(load("nccl-hang/pid-1180.json")), "a", 0.01, 10, 10, 100, 100)
    nat = DumpResult(7, "ok", "1 threads", tuple(load("nccl-hang/pid-1180-native.json")), "b", 1.3, 10, 11, 100, 101)
    m = merge_native(first, nat)
    assert (m.wakeups_before, m.wakeups_after, m.io_before, m.io_after) == (10, 11, 100, 101)
    assert m.threads == nat.threads and m.elapsed_s == 1.31 and m.outcome == "ok"
    told_nothing = replace(nat, threads=first.threads)
    m = merge_native(first, told_nothing)
    assert m.threads == first.threads and (m.wakeups_after, m.io_after) == (11, 101)
    failed = DumpResult(7, "timeout", "py-spy did not finish", (), "", 5.0, 10, 12, 100, 100)
    m = merge_native(first, failed)
    assert m.ok and m.threads[0]["frames"] == first.threads[0]["frames"] and m.wakeups_after == 12
    assert "native re-dump timeout" in m.detail


# ---- the real py-spy against a real process parked in C at `loss.item()` -----------------------------------------

# ``loss.item()`` that does not return: a C call (sum over a huge range) with no Python frame of its own, the way
# CUDA's spin in cudaStreamSynchronize looks to py-spy without --native.
SPIN_AT_ITEM = """\
import functools, types
loss = types.SimpleNamespace(item=functools.partial(sum, range(10 ** 18)))
print('ready', flush=True)
loss_value = loss.item()
"""


def _first_state(rank_pids: dict[int, int], cfg: StacksConfig, gpu: set[int], want: str) -> Any:
    """Dump until the spinner is seen on CPU (a busy 2-core box may deschedule it at the sampled instant)."""
    for _ in range(5):
        results = dump_job(rank_pids, cfg, gpu)
        stacks = classify_results(results)
        if stacks and stacks[0].state == want:
            return results, stacks[0]
    return results, stacks[0]


def real_py_spy_without_native(tmp_path: Path) -> str:
    """The real py-spy, except that --native is refused as under a ptrace limit."""
    real = find_py_spy()
    assert real is not None
    path = tmp_path / "py-spy-no-native"
    path.write_text(f"""#!{sys.executable}
import os, sys
if "--native" in sys.argv:
    sys.stderr.write("Error: Failed to suspend process (Operation not permitted (os error 1))\\n")
    sys.exit(1)
os.execv({real!r}, [{real!r}] + sys.argv[1:])
""")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def spinner(tmp_path: Path) -> Iterator[int]:
    (tmp_path / "train.py").write_text(SPIN_AT_ITEM)
    p = subprocess.Popen([sys.executable, "train.py"], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                         start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        yield p.pid
    finally:
        _kill(p)


def test_real_native_redump_that_tells_nothing_more_keeps_the_first(spinner: int) -> None:
    cfg = StacksConfig(timeout_s=20)
    results, rs = _first_state({0: spinner}, cfg, {spinner}, "compute")
    assert rs.state == "compute" and rs.where == "<module> (train.py:4)"
    res = results[0]
    assert "native re-dump told nothing more" in res.detail, res.detail  # it ran: builtin sum, no device sync
    assert "--- py-spy dump --native (ok) ---" in res.raw and GPU_LINE not in res.threads[0]


def test_real_failed_native_dump_reads_the_item_line(tmp_path: Path, spinner: int) -> None:
    cfg = StacksConfig(py_spy=real_py_spy_without_native(tmp_path))
    results, rs = _first_state({0: spinner}, cfg, {spinner}, "device_sync")
    assert (rs.state, rs.active, rs.where) == ("device_sync", True, "<module> (train.py:4)")
    assert "native re-dump permission_denied" in results[0].detail  # Yama's words
    # gloo/CPU: the same rank at the same line computes
    _, rs = _first_state({0: spinner}, cfg, set(), "compute")
    assert (rs.state, rs.active) == ("compute", True)


# ---- the parts -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "call"), [
    ("loss.item()", "item"), ('print(f"step {step} loss {loss.item():.4f}")', "item"),
    ("xs = logits.argmax(-1).tolist()", "tolist"), ("arr = t.cpu().numpy()", "cpu"), ("a = t.numpy()", "numpy"),
    ("torch.cuda.synchronize()", "synchronize"), ("synchronize()", "synchronize"),
    ("torch.cuda.current_stream().synchronize()", "synchronize"), ("work.wait()", "wait"),
    ("dist.all_reduce(t, async_op=True).wait()", "wait"),
    ("for k, v in d.items():", None), ("n = os.cpu_count()", None), ("resynchronize()", None),
    ("x = y @ w  # then loss.item()", None), ('log("call .item() later")', None), ("", None),
])
def test_device_sync_calls(code: str, call: str | None) -> None:
    assert device_sync_call(code) == call


def test_the_line_hint_is_for_active_threads_only() -> None:
    th = load("nccl-hang/pid-1180.json")[0] | {GPU_LINE: "loss.item()"}

    def state(t: dict[str, Any]) -> str | None:
        rs = classify_threads([t], 0, 1)
        return rs.state if rs is not None else None

    assert state(th) == "device_sync"
    assert state(th | {"active": False}) == "unknown"  # off CPU: the hint decides nothing
    assert state(th | {GPU_LINE: "y = model(x)"}) == "compute"


def test_source_line_cache_follows_the_file(tmp_path: Path) -> None:
    f = tmp_path / "train.py"
    f.write_text("a = 1\n    loss.item()\n")
    assert source.source_line(str(f), 2) == "loss.item()"
    assert source.source_line(str(f), 3) is None and source.source_line(str(f), 0) is None
    f.write_text("a = 1\n    y = model(x)\n")
    os.utime(f, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # a new version, whatever the clock's grain
    assert source.source_line(str(f), 2) == "y = model(x)"
    assert source.source_line("<string>", 1) is None and source.source_line(str(tmp_path / "gone.py"), 1) is None
    # a relative name is the process's own: read through /proc/PID/cwd
    p = _spawn("import time\nprint('ready', flush=True)\ntime.sleep(60)\n", tmp_path)
    try:
        assert source.source_line("train.py", 2, p.pid) == "y = model(x)"
    finally:
        _kill(p)


def test_pids_on_gpu_ignores_virtual_devices() -> None:
    real = DeviceSample(0, "GPU-0", "H200", processes=(GpuProcess(11, None), GpuProcess(99, None)))
    virtual = DeviceSample(1, "proc-12", "proc", processes=(GpuProcess(12, None),), virtual=True)
    sample = NodeSample(0.0, "h", "nvml", devices=(real, virtual))
    assert pids_on_gpu(sample, [11, 12, 13]) == frozenset({11})
    assert pids_on_gpu(None, [11]) == frozenset()


class _Pool:
    def __init__(self) -> None:
        self.args: list[tuple[Any, ...]] = []

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        self.args.append(args)
        return Future()


def test_the_engine_names_the_ranks_on_a_gpu(tmp_path: Path) -> None:
    pool = _Pool()
    e = Engine(Config(), backend=None, fallback=FallbackStore(tmp_path), pool=pool,  # type: ignore[arg-type]
               health=LoopHealth.for_interval(1.0))
    e.state = DetectorState(jobs={"j": JobStatus("j", SUSPECT, rank_pids={0: 11, 1: 12}, needs_stacks=True)})
    e.last_sample = NodeSample(0.0, "h", "nvml", devices=(DeviceSample(0, "GPU-0", "H200",
                                                                      processes=(GpuProcess(11, None),)),))
    e._schedule_dumps(5.0)
    assert pool.args == [("j", {0: 11, 1: 12}, 5.0, frozenset({11}))]


def test_a_timed_out_dump_still_reads_the_counters_after(tmp_path: Path, ranks: dict[int, int]) -> None:
    slow = tmp_path / "py-spy-slow"
    slow.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    slow.chmod(0o755)
    (r,) = dump_stacks([ranks[0]], timeout_s=0.5, native=True, py_spy=str(slow))
    assert r.outcome == "timeout" and r.wakeups_after is not None and r.io_after is not None
