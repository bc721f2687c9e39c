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
No rule matched: ``compute`` when py-spy saw the thread on CPU (``active``), else ``unknown``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .model import RankStack

STATES = ("collective", "device_sync", "io", "data_wait", "sleep", "compute", "unknown")

# c10d entry points that block until peers arrive (plus the init-time waits that hang the same way).
COLLECTIVE_OPS = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_coalesced", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "send", "recv", "send_object_list", "recv_object_list", "batch_isend_irecv", "all_to_all",
    "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
    "init_process_group", "new_group", "_store_based_barrier", "_new_group_with_tag",
})
IO_NAMES = frozenset({
    "write", "writelines", "read", "readinto", "readline", "readlines", "flush", "fsync", "fdatasync",
    "save_checkpoint", "load_checkpoint", "save_pretrained", "save_model", "save_state_dict",
    "save_file", "load_file", "copyfile", "copyfileobj", "copytree",
})
IO_FILES = ("torch/serialization.py", "safetensors/", "torch/distributed/checkpoint/", "shutil.py")
DATA_FILES = ("multiprocessing/queues.py", "multiprocessing/connection.py")
DATALOADER_WAITS = frozenset({"_next_data", "_get_data", "_try_get_data"})
SLEEP_NAMES = frozenset({"sleep", "time_sleep", "pysleep", "clock_nanosleep", "nanosleep", "usleep"})
# Native symbols of a host↔device sync (CUDA runtime/driver, and the item()/tolist() bindings).
_DEVICE_SYNC_NATIVE = re.compile(
    r"(cuda|cu)(Device|Stream|Event|Ctx)Synchronize|_local_scalar_dense_cuda|cudaMemcpy(?!Async)"
)

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
    if _file(fr).endswith("torch/distributed/distributed_c10d.py") and _last(fr) in COLLECTIVE_OPS:
        return _last(fr)
    if _in(fr, "torch/distributed/_functional_collectives.py") and _last(fr) in ("wait", "wait_tensor"):
        return "wait"
    if re.match(r"c10d::\w*Work\w*::wait", _name(fr)):
        return "wait"  # Work.wait() of isend/irecv/async ops: a C++ call, visible only with --native
    return None


def _device_sync(fr: Frame) -> str | None:
    if _in(fr, "torch/cuda/") and _last(fr) in ("synchronize", "item", "cpu", "tolist"):
        return ""
    return "" if _DEVICE_SYNC_NATIVE.search(_name(fr)) else None


def _data_wait(fr: Frame) -> str | None:
    f = _file(fr)
    if (f == "queue.py" or f.endswith("/queue.py")) and _last(fr) == "get":
        return ""
    if _in(fr, *DATA_FILES):
        return ""
    if _in(fr, "torch/utils/data/") and _last(fr) in DATALOADER_WAITS:
        return ""
    return None


def _io(fr: Frame) -> str | None:
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


def _frames_in_order(thread: Mapping[str, Any]) -> tuple[list[Frame], list[Frame]]:
    """(python frames, native frames), each innermost first; the wchan pseudo-frame leads the native."""
    frames: Sequence[Frame] = thread.get("frames") or ()
    py = [f for f in frames if not is_native(f)]
    native = [f for f in frames if is_native(f)]
    wchan = str(thread.get("wchan") or "")
    if wchan and wchan != "0":
        native.insert(0, {"name": wchan, "filename": "[kernel]", "short_filename": "kernel", "line": 0})
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
    return RankStack(
        rank=rank, pid=pid, state=state, signature=signature(thread), active=bool(thread.get("active")),
        op=op if state == "collective" else None, where=where,
    )


def classify_threads(threads: Iterable[Mapping[str, Any]], rank: int, pid: int) -> RankStack | None:
    """Classify the main thread of a dump, or None when the dump has no main thread."""
    mt = main_thread(threads, pid)
    return None if mt is None else classify_thread(mt, rank, pid)
