"""Classify a rank's main thread from its py-spy frames: which kind of wait (or work) is it in?

All rules live in ``RULES``: an ordered table of (state, matcher). A matcher looks at one frame and
returns ``None`` (no match) or the op name (``""`` when the state has no op). Frames are examined
innermost first, Python frames before native ones; the first frame that any rule matches decides,
and when several rules match that frame the earlier row wins. Innermost-first is what makes "a
collective called inside save_checkpoint" a *collective* (the rank is blocked there) while
"``time_sleep`` inside a DataLoader retry" stays a *data_wait* (Python frames are seen first).

Frames that py-spy never shows in its default (Python-only) mode, and how we still see them:
  * ``time.sleep`` and other C functions (``Tensor.item``, ``Work.wait``) have no Python frame; the
    caller's line is the innermost frame. ``dump_stacks`` adds the kernel wait channel as
    ``thread["wchan"]``, which we treat as the innermost native frame (file ``[kernel]``), so
    ``hrtimer_nanosleep`` still reads as sleep. With ``--native`` the C frames (``time_sleep``,
    ``c10d::Work::wait``, ``cudaStreamSynchronize``) are matched directly.
  * A rank waiting on its GPU spins on the CPU inside a C call (CUDA's default ``cudaStreamSynchronize`` under
    ``loss.item()``, measured on an H200): without ``--native`` py-spy shows only the caller's line, *active*.
    For a rank on a real GPU whose native frames could not be had, evidence.stacks.collect adds that line's source text
    as ``thread["gpu_line"]``; an active thread whose line calls a device sync (``DEVICE_SYNC_CALL``) is then a
    ``device_sync``, not ``compute``. Only GPU ranks get it: on a CPU (gloo) job ``.item()`` returns at once.
No rule matched: ``compute`` when py-spy saw the thread on CPU (``active``), else ``unknown``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpu_watchdog.evidence.stacks.syscalls import timed_wait
from gpu_watchdog.model import RankStack

STATES = ("collective", "device_sync", "io", "data_wait", "sleep", "compute", "stopped", "unknown")

# Collectives are recognised by where the frame lives, not by a hand-kept list of names (torch keeps adding
# entry points: all_gather_single and reduce_scatter_single in 2.13, FSDP2's helpers, ...):
#   * any function of torch.distributed's c10d Python API (distributed_c10d.py) or of functional collectives,
#     except the non-blocking getters and argument checks below;
#   * in libraries built on them (FSDP, DTensor, composable APIs, DeepSpeed's comm layer), a function whose
#     name says it communicates or waits for communication (COLLECTIVE_WORDS);
#   * native frames of c10d work objects, ProcessGroup{NCCL,Gloo}, NCCL's API and gloo's algorithms.
C10D_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py",
              "torch/distributed/_functional_collectives_impl.py")
COLLECTIVE_LIBRARY_FILES = ("torch/distributed/fsdp/", "torch/distributed/tensor/", "torch/distributed/_tensor/",
                            "torch/distributed/_composable/", "torch/distributed/pipelining/", "deepspeed/comm/")
COLLECTIVE_WORDS = re.compile(r"all_?gather|reduce_?scatter|all_?reduce|broadcast|all_?to_?all|barrier|unshard|"
                              r"(^|_)(wait|reduce|gather|scatter)(_|$)|isend|irecv|p2p")
_C10D_NOT_BLOCKING = re.compile(r"^_*(get_|is_|check|warn|canonicalize|validate|rank_not_in_group|coalescing_manager$)")
_NATIVE_COLLECTIVE = re.compile(r"c10d::\w*Work\w*::wait|c10d::ProcessGroup(NCCL|Gloo)|^nccl[A-Z]\w*|gloo::|"
                                r"c10d::Reducer::")
# DDP's gradient all-reduce: its Reducer is C++ hooked into the autograd engine, so a rank waiting on a bucket
# all-reduce shows no Python frame below the engine call (``_engine_run_backward``), idle; natively it shows
# ``c10d::Reducer::finalize_backward`` → ``Work::wait``. FSDP's and DeepSpeed's backward hooks are Python and
# show their own frames (COLLECTIVE_LIBRARY_FILES). Nothing else blocks the backward pass on the host: a GPU
# backward runs on the engine's device threads (the GPU is then busy, and there is no stall to judge).
DDP_OP = "ddp_all_reduce"
DDP_FILE = "torch/nn/parallel/distributed.py"  # an idle innermost frame there waits in one of DDP's collectives
_AUTOGRAD_ENGINE_CALLS = frozenset({"_engine_run_backward", "run_backward", "backward", "grad"})
# Families, for telling "the same collective through another entry point" from a desync.
COLLECTIVE_FAMILIES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "barrier", "gather",
                       "scatter", "reduce", "send", "recv", "p2p", "init", "new_group")
_FAMILY_ALIASES = {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce",
                   "alltoall": "all_to_all", "batch_isend_irecv": "p2p", "batch_p2p": "p2p", "isend": "send",
                   "irecv": "recv", "monitored_barrier": "barrier",
                   "store_based_barrier": "barrier", "init_process_group": "init", "unshard": "all_gather"}
P2P_FAMILIES = frozenset({"send", "recv", "p2p"})
# Collectives some members can leave before every member arrived (gloo's broadcast root hands each peer its bytes;
# a gather's or reduce's non-root only sends): a rank seen past the point may have passed one of these. Every other
# collective (all_reduce, all_gather, reduce_scatter, all_to_all, barrier) needs every member's part first.
PASSABLE_FAMILIES = frozenset({"broadcast", "scatter", "gather", "reduce"})
WAIT_FAMILY = "wait"  # Work.wait()/wait_tensor: which collective it waits for is not in the frame


def is_ddp_op(op: str | None) -> bool:
    """One of DDP's own collectives (its gradient all-reduce, its forward's broadcasts): every rank's regular flow."""
    return op is not None and op.startswith("ddp_")


def collective_family(op: str) -> str:
    """``all_gather_single`` → ``all_gather``; ``_reduce_scatter_base`` → ``reduce_scatter``; ``wait_tensor`` →
    ``wait``. Unknown names come back without their leading underscores."""
    name = op.lstrip("_")
    for alias, family in _FAMILY_ALIASES.items():
        if name.startswith(alias) or alias in name:
            return family
    if re.search(r"(^|_)wait(_|$)", name):
        return WAIT_FAMILY
    return next((f for f in COLLECTIVE_FAMILIES if f in name), name)


IO_NAMES = frozenset({
    "write", "writelines", "read", "readinto", "readline", "readlines", "flush", "fsync", "fdatasync",
    "save_checkpoint", "load_checkpoint", "save_pretrained", "save_model", "save_state_dict",
    "save_file", "load_file", "copyfile", "copyfileobj", "copytree",
})
IO_FILES = ("torch/serialization.py", "safetensors/", "torch/distributed/checkpoint/", "shutil.py")
DATA_FILES = ("multiprocessing/queues.py", "multiprocessing/connection.py")
# A read or write on a socket through Python's socket/ssl layers (urllib, http.client, requests, a hand-written
# client): bytes from or to another process, not storage. Its op is SOCKET_OP.
SOCKET_FILES = ("socket.py", "ssl.py")
SOCKET_OP = "socket"
DATALOADER_WAITS = frozenset({"_next_data", "_get_data", "_try_get_data"})
SLEEP_NAMES = frozenset({"sleep", "time_sleep", "pysleep", "clock_nanosleep", "nanosleep", "usleep"})
# Native symbols of a host↔device sync (CUDA runtime/driver, and the item()/tolist() bindings).
_DEVICE_SYNC_NATIVE = re.compile(
    r"(cuda|cu)(Device|Stream|Event|Ctx)Synchronize|_local_scalar_dense_cuda|cudaMemcpy(?!Async)"
)
# Python calls that wait for the device when their tensor lives on a GPU (the C call under them has no Python frame):
# a scalar or a copy to the host, an explicit synchronize (torch.cuda's, a stream's or an event's), a Work's wait().
DEVICE_SYNC_CALL = re.compile(r"\.(item|cpu|tolist|numpy|synchronize|wait)\s*\(|(?<![\w.])(synchronize)\s*\(")
_STRING_OR_COMMENT = re.compile(r"""(?<!\w)([rRbBuUfF]{0,2})('(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*")|#.*$""")
GPU_LINE = "gpu_line"  # thread key: the innermost Python frame's source line, set only for a rank on a real GPU

# Kernel wait channels (/proc/PID/wchan) of a thread waiting on storage — block devices, page-cache writeback,
# NFS/RPC, FUSE, Lustre, Ceph, journaling — or writing into a pipe: slow I/O, which ends on its own.
_KERNEL_IO = re.compile(
    r"pipe_write|pipe_wait_writable|nfs|rpc_|io_schedule|folio_wait|wait_on_page|__lock_page|balance_dirty_pages|"
    r"jbd2|blk_|wait_for_completion_io|ext4|xfs|btrfs|fuse|request_wait_answer|ceph|cl_sync_io|lustre|filemap|"
    r"fsync|writeback|wb_wait"
)
# ... and of a thread waiting for bytes from a pipe or a socket: a consumer waiting on its producer.
# (Linux: pipe_read — anon_pipe_read on newer kernels, this project's test box among them — and pipe_wait_readable
# for pipes, unix_stream_read_generic for Unix sockets, sk_wait_data and wait_woken — which sk_wait_data sleeps in —
# for TCP/UDP reads, inet_csk_accept for a server awaiting a client.)
_KERNEL_DATA = re.compile(r"^(anon_)?pipe_read$|^pipe_wait_readable$|unix_stream_read|sk_wait_data|^wait_woken$|"
                          r"inet_csk_accept|unix_wait_for_peer")


def kernel_wait(wchan: str | None, status: str = "") -> str | None:
    """"io" or "data_wait" for a thread the kernel shows waiting on I/O or on a producer, else None.
    ``status`` is psutil's process status: ``disk-sleep`` (D) is an uninterruptible I/O wait."""
    if status == "disk-sleep":
        return "io"
    if not wchan or wchan == "0":
        return None
    if _KERNEL_IO.search(wchan):
        return "io"
    return "data_wait" if _KERNEL_DATA.search(wchan) else None


Frame = Mapping[str, Any]
Matcher = Callable[[Frame], "str | None"]


def _name(fr: Frame) -> str:
    return str(fr.get("name") or "")


def _last(fr: Frame) -> str:
    """``Queue.get`` → ``get``; py-spy gives qualified names on Python ≥3.11."""
    return _name(fr).rsplit(".", 1)[-1]


def _file(fr: Frame) -> str:
    return str(fr.get("filename") or fr.get("short_filename") or "").replace("\\", "/")


def _in(fr: Frame, *parts: str) -> bool:
    f = _file(fr)
    return any(p in f for p in parts)


def _collective(fr: Frame) -> str | None:
    name = _last(fr)
    if _in(fr, *C10D_FILES):
        return None if _C10D_NOT_BLOCKING.match(name) else name
    if _in(fr, *COLLECTIVE_LIBRARY_FILES) and COLLECTIVE_WORDS.search(name):
        return name
    if is_native(fr) and _NATIVE_COLLECTIVE.search(_name(fr)):
        if "c10d::Reducer::" in _name(fr):
            return DDP_OP
        return "wait" if "::wait" in _name(fr) else _name(fr).rsplit("::", 1)[-1]
    if fr.get(_INNERMOST_IDLE) and _in(fr, "torch/autograd/") and _last(fr) in _AUTOGRAD_ENGINE_CALLS:
        return DDP_OP  # the autograd engine blocked with no Python below it: a C++ hook's wait (DDP's Reducer)
    if fr.get(_INNERMOST_IDLE) and _in(fr, DDP_FILE):
        # DDP's own collectives called from C++ bindings (the forward's buffer broadcast, bucket rebuild, join)
        return "ddp_" + _last(fr).lstrip("_")
    return None


def _device_sync(fr: Frame) -> str | None:
    if _in(fr, "torch/cuda/") and _last(fr) in ("synchronize", "item", "cpu", "tolist"):
        return ""
    return "" if _DEVICE_SYNC_NATIVE.search(_name(fr)) else None


def device_sync_call(code: str) -> str | None:
    """The device-syncing call a line of Python makes (``item``, ``synchronize``, ...), else None; comments and
    plain strings do not count, an f-string's fields do (``print(f"loss {loss.item():.4f}")``)."""
    def blank(m: re.Match[str]) -> str:
        return m.group(0) if "f" in (m.group(1) or "").lower() else '""'

    m = DEVICE_SYNC_CALL.search(_STRING_OR_COMMENT.sub(blank, code))
    return (m.group(1) or m.group(2)) if m else None


def _data_wait(fr: Frame) -> str | None:
    f = _file(fr)
    if f == "[kernel]":
        return "" if kernel_wait(_name(fr)) == "data_wait" else None
    if (f == "queue.py" or f.endswith("/queue.py")) and _last(fr) == "get":
        return ""
    if any(f == s or f.endswith("/" + s) for s in SOCKET_FILES):
        return SOCKET_OP
    if _in(fr, *DATA_FILES):
        return ""
    if _in(fr, "torch/utils/data/") and _last(fr) in DATALOADER_WAITS:
        return ""
    return None


def _io(fr: Frame) -> str | None:
    if _file(fr) == "[kernel]":
        return "" if kernel_wait(_name(fr), str(fr.get("status") or "")) == "io" else None
    if _in(fr, *IO_FILES) or _last(fr) in IO_NAMES:
        return ""
    return None


def _sleep(fr: Frame) -> str | None:
    if _last(fr) in SLEEP_NAMES:
        return ""
    if _file(fr) == "[kernel]" and "nanosleep" in _name(fr):
        return ""
    return None


# THE table. Order breaks ties on one frame: data_wait before io so a multiprocessing pipe read is a
# data wait, collective first so c10d's own helpers never read as io.
RULES: list[tuple[str, Matcher]] = [
    ("collective", _collective),
    ("device_sync", _device_sync),
    ("data_wait", _data_wait),
    ("io", _io),
    ("sleep", _sleep),
]


def is_native(fr: Frame) -> bool:
    """A C/C++ frame (py-spy --native) or our kernel pseudo-frame, as opposed to a Python frame."""
    f = _file(fr)
    return not (f.endswith(".py") or f.startswith("<") or f.endswith(".pyw"))


def frame_text(fr: Frame) -> str:
    """``name (short_filename:line)``; native frames have no line."""
    short = fr.get("short_filename") or fr.get("filename") or "?"
    line = fr.get("line") or 0
    return f"{_name(fr)} ({short}:{line})" if line and not is_native(fr) else f"{_name(fr)} ({short})"


def main_thread(threads: Iterable[Mapping[str, Any]], pid: int | None = None) -> dict[str, Any] | None:
    """The thread named MainThread, else the one whose os_thread_id equals the pid, else None."""
    ths = list(threads)
    for th in ths:
        if th.get("thread_name") == "MainThread":
            return dict(th)
    for th in ths:
        if pid is not None and th.get("os_thread_id") == pid:
            return dict(th)
    return None


_INNERMOST_IDLE = "innermost_idle"  # marks the innermost Python frame of a thread py-spy saw off CPU


def _frames_in_order(thread: Mapping[str, Any]) -> tuple[list[Frame], list[Frame]]:
    """(python frames, native frames), each innermost first; the kernel pseudo-frame (the wait channel, and
    the uninterruptible state D, which the kernel shows as an I/O wait) leads the native. The innermost Python
    frame of an idle thread is marked (a copy): only there does "blocked with no Python below" hold."""
    frames: Sequence[Frame] = thread.get("frames") or ()
    py = [f for f in frames if not is_native(f)]
    if py and not thread.get("active"):
        py[0] = {**py[0], _INNERMOST_IDLE: True}
    native = [f for f in frames if is_native(f)]
    wchan = str(thread.get("wchan") or "")
    uninterruptible = thread.get("kstate") == "D"
    if (wchan and wchan != "0") or uninterruptible:
        native.insert(0, {"name": wchan if wchan not in ("", "0") else "uninterruptible", "filename": "[kernel]",
                          "short_filename": "kernel", "line": 0,
                          "status": "disk-sleep" if uninterruptible else ""})
    return py, native


def classify_frames(thread: Mapping[str, Any]) -> tuple[str, str | None, Frame | None]:
    """(state, op, decisive frame) for one py-spy thread object."""
    py, native = _frames_in_order(thread)
    for group in (py, native):
        for fr in group:
            for state, match in RULES:
                op = match(fr)
                if op is not None:
                    return state, (op or None), fr
    if thread.get("active"):
        if py and device_sync_call(str(thread.get(GPU_LINE) or "")):
            return "device_sync", None, py[0]  # spinning in a C device sync under this line (see the docstring)
        return "compute", None, (py[0] if py else None)
    return "unknown", None, (py[0] if py else None)


def signature(thread: Mapping[str, Any]) -> str:
    """Python frames only, innermost first, joined by `` <- ``: stable across processes (native frames
    carry ASLR addresses) and across --native / default dumps."""
    py, native = _frames_in_order(thread)
    frames = py or [f for f in native if _file(f) != "[kernel]"]
    return " <- ".join(frame_text(f) for f in frames)


def classify_thread(thread: Mapping[str, Any], rank: int, pid: int) -> RankStack:
    """The RankStack of one rank's main thread. ``where`` is the decisive frame, except that a native
    decisive frame is reported at its innermost Python caller (``main (train.py:94)``, not
    ``hrtimer_nanosleep``): that is the line a user can act on."""
    state, op, decisive = classify_frames(thread)
    py, _ = _frames_in_order(thread)
    if decisive is not None and is_native(decisive) and py:
        where = frame_text(py[0])
    elif decisive is not None:
        where = frame_text(decisive)
    else:
        where = ""
    timed = state in WAITS_IN_USER_CODE and polls(thread, state)
    return RankStack(
        rank=rank, pid=pid, state=state, signature=signature(thread), active=bool(thread.get("active")),
        op=op if state == "collective" or op == SOCKET_OP else None, where=where, timed=timed,
    )


# A wait that returns by itself within this is a polling loop's (a sleep, a poll, an Event.wait with a timeout):
# alive. Longer ones are waits all the same: a sleep(3600), a collective's 30-minute timeout inside gloo or NCCL.
POLL_MAX_S = 60.0


def polls(thread: Mapping[str, Any], state: str) -> bool:
    """Is the thread in a wait that ends by itself soon (a polling loop)? From the time left in its system call
    (evidence.stacks.syscalls); when that cannot be read, a call with a timeout — or a sleep, without the call — is
    taken to be a poll (the cautious side: never act on it)."""
    left = thread.get("wait_left_s")
    if isinstance(left, (int, float)) and not isinstance(left, bool):
        return left <= POLL_MAX_S
    timed = timed_wait(str(thread.get("syscall") or ""))
    return timed is True or (timed is None and state == "sleep")


# Main-thread states that may only be waiting on another thread of the rank (Event.wait, a queue, a join).
WAITS_IN_USER_CODE = ("unknown", "sleep", "data_wait")
COMMUNICATION_STATES = ("collective", "device_sync")


# A main thread whose innermost Python frame is here only hands out work (Ray's worker in its C++ task loop, while
# Ray Train runs the user's training function on a thread of its own): the rank's work is on another thread. Idle or
# not: the loop's own C++ work (gRPC, a task's arrival) shows the thread active at some dumps — on a saturated host CI
# saw one dump of a pair judge the loop and the other the training thread, and the hang wait for 3 more dumps.
DISPATCH_LOOPS = (("ray/_private/worker.py", "main_loop"),)
_RUNTIME_FILES = ("/ray/", "/threading.py", "/concurrent/futures/", "/queue.py", "/selectors.py", "/asyncio/")


def _dispatching(thread: Mapping[str, Any]) -> bool:
    py, _ = _frames_in_order(thread)
    return bool(py) and any(
        _file(py[0]).endswith(path) and _name(py[0]).endswith(func) for path, func in DISPATCH_LOOPS)


def _work_thread(others: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """Of the threads besides a dispatching main thread, the one doing its work: Ray Train's ``TrainingThread(…)``,
    else the first with a frame of the job's own code (not Ray's, not the threading or asyncio machinery)."""
    for th in others:
        if str(th.get("thread_name") or "").startswith("TrainingThread"):
            return th
    for th in others:
        py, _ = _frames_in_order(th)
        if any(not any(part in _file(fr) for part in _RUNTIME_FILES) for fr in py):
            return th
    return None


def work_thread(threads: Iterable[Mapping[str, Any]], pid: int) -> Mapping[str, Any] | None:
    """The thread a dispatching main thread (DISPATCH_LOOPS) hands the rank's work to — Ray Train's training
    thread — from one dump; None when the main thread does the rank's work itself (or the dump has none)."""
    ths = list(threads)
    mt = main_thread(ths, pid)
    if mt is None or not _dispatching(mt):
        return None
    return _work_thread(_others(ths, mt))


def _others(threads: list[Mapping[str, Any]], main: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [th for th in threads if (th.get("os_thread_id"), th.get("thread_name"))
            != (main.get("os_thread_id"), main.get("thread_name"))]


def _on_thread(rs: RankStack, th: Mapping[str, Any], main: RankStack) -> RankStack:
    """``rs`` (another thread's classification) as the rank's: ``where`` names the thread, and its own wakeups and
    I/O (stacks.py reads them per thread) stand for the rank's."""
    name = th.get("thread_name") or th.get("os_thread_id") or "?"
    return replace(rs, where=f"{rs.where} [thread {name}]", signature=main.signature + " || " + rs.signature,
                   wakeups_before=th.get("wakeups_before"), wakeups_after=th.get("wakeups_after"),
                   io_before=th.get("io_before"), io_after=th.get("io_after"))


def classify_threads(threads: Iterable[Mapping[str, Any]], rank: int, pid: int) -> RankStack | None:
    """Classify a rank from every thread of its dump: its main thread's state, unless the main thread only
    dispatches work (DISPATCH_LOOPS: a Ray worker) — then its work thread's — or only waits (WAITS_IN_USER_CODE)
    while another thread is blocked in communication — a communication thread the main thread waits on: then that
    thread's, its ``where`` naming the thread. None when the dump has no main thread."""
    ths = list(threads)
    mt = main_thread(ths, pid)
    if mt is None:
        return None
    main = classify_thread(mt, rank, pid)
    if (work := work_thread(ths, pid)) is not None:
        return _on_thread(classify_thread(work, rank, pid), work, main)
    if main.state not in WAITS_IN_USER_CODE:
        return main
    for th in _others(ths, mt):
        other = classify_thread(th, rank, pid)
        if other.state in COMMUNICATION_STATES:
            return _on_thread(other, th, main)
    return main
