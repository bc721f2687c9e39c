"""Which process group a rank waits in, read from its own frames (py-spy ``--locals``), and the groups its in-job
client reported (``groups-<rank>.json``).

A c10d call's frame holds the ``group`` it was called with (the default group's object once the call resolved
``group=None``). py-spy prints a ``ProcessGroup`` only as its address (``<torch._C._distributed_c10d.ProcessGroup at
0x7f…>``: no ranks, no name), and that address differs from rank to rank, so the frames alone name no group. The
in-job client reports each group's address (``id(pg)``, the same number) beside its name, description and ranks:
where it runs, the address names the group exactly. (A functional collective waits in ``wait_tensor``, whose frame
holds no group.) A point-to-point call carries its partner: ``dst``/``src`` (global ranks) or
``group_dst``/``group_src`` (ranks within the group); pipelining's ``_wait_batch_p2p(work)`` waits on the Work its
caller's ``works`` dict holds under the partner's rank (only an identical Work counts: its sends waited later in bulk
show no partner).

Locals may hold anything (paths, tokens): only these few values are kept, never the dump itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from gpu_watchdog.config.schema import StacksConfig
from gpu_watchdog.evidence.stacks.classify import C10D_FILES, classify_threads, is_native, main_thread
from gpu_watchdog.evidence.stacks.dump import dump_stacks
from gpu_watchdog.job.protocol import CONTROL_DIR_ENV, ControlDir
from gpu_watchdog.model import RankStack

PIPELINE_WAIT = ("torch/distributed/pipelining/", "_wait_batch_p2p")
_PROCESS_GROUP = re.compile(r"ProcessGroup at 0x[0-9a-f]+>$")
_PEER_WORKS = re.compile(r"(-?\d+): (\[[^\[\]]*\])")
_GLOBAL_PEER = ("dst", "src")
_GROUP_PEER = ("group_dst", "group_src")


@dataclass(frozen=True)
class FrameGroup:
    """The group (and partner) one rank's frames show for the call it waits in."""

    rank: int
    op: str | None  # the op its stack was classified in (RankStack.op)
    address: int | None = None  # the ProcessGroup object's address (its client's report names it)
    peer: int | None = None  # a point-to-point partner, global rank
    group_peer: int | None = None  # a point-to-point partner as a rank within the group (group_dst / group_src)

    @property
    def known(self) -> bool:
        return self.address is not None or self.peer is not None or self.group_peer is not None


def _local(frame: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((v for v in frame.get("locals") or () if isinstance(v, Mapping) and v.get("name") == name), None)


def _int_local(frame: Mapping[str, Any], name: str) -> int | None:
    v = _local(frame, name)
    text = str(v.get("repr", "")) if v is not None else ""
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def _file(frame: Mapping[str, Any]) -> str:
    return str(frame.get("filename") or frame.get("short_filename") or "").replace("\\", "/")


def group_in_frames(thread: Mapping[str, Any], rank: int, op: str | None = None) -> FrameGroup:
    """The group (and partner) the innermost c10d call of a py-spy ``--locals`` thread object was called with; an
    empty FrameGroup when no frame shows one."""
    frames = [f for f in thread.get("frames") or () if isinstance(f, Mapping) and not is_native(f)]
    peer = _pipeline_peer(frames)
    for fr in frames:
        if not any(p in _file(fr) for p in C10D_FILES):
            continue
        group = _local(fr, "group")
        found = FrameGroup(
            rank, op,
            address=int(group["addr"]) if group is not None and isinstance(group.get("addr"), int)
            and _PROCESS_GROUP.search(str(group.get("repr", ""))) else None,
            peer=next((p for k in _GLOBAL_PEER if (p := _int_local(fr, k)) is not None), peer),
            group_peer=next((p for k in _GROUP_PEER if (p := _int_local(fr, k)) is not None), None))
        if found.known:
            return found
    return FrameGroup(rank, op, peer=peer)


def _pipeline_peer(frames: Sequence[Mapping[str, Any]]) -> int | None:
    """The partner of pipelining's ``_wait_batch_p2p(work)``: the key under which its caller's ``works`` holds the
    very Work list it waits on (None when the waited Work is not there: e.g. forward sends waited in bulk)."""
    for i, fr in enumerate(frames[:-1]):
        if PIPELINE_WAIT[0] not in _file(fr) or not str(fr.get("name", "")).endswith(PIPELINE_WAIT[1]):
            continue
        work = _local(fr, "work")
        works = _local(frames[i + 1], "works")
        if work is None or works is None or "..." in str(work.get("repr", "")):
            return None
        for key, value in _PEER_WORKS.findall(str(works.get("repr", ""))):
            if value == work.get("repr"):
                return int(key)
        return None
    return None


def read_frame_groups(stacks: Sequence[RankStack], rank_pids: Mapping[int, int], cfg: StacksConfig
                      ) -> dict[int, FrameGroup]:
    """Re-dump, with their locals, the ranks of ``stacks`` waiting in a collective or point-to-point op (in
    parallel, ``cfg.timeout_s`` each) and read the group each was called with; a rank whose re-dump shows another
    op than its stack (it moved) or no group is left out."""
    waiting = [s for s in stacks if s.state == "collective" and s.rank in rank_pids]
    if not waiting:
        return {}
    results = dump_stacks([rank_pids[s.rank] for s in waiting], timeout_s=cfg.timeout_s, concurrency=cfg.concurrency,
                          py_spy=cfg.py_spy or None, nonblocking=cfg.nonblocking, with_locals=True)
    out: dict[int, FrameGroup] = {}
    for s, res in zip(waiting, results, strict=True):
        again = classify_threads(res.threads, s.rank, res.pid) if res.ok else None
        thread = main_thread(res.threads, res.pid) if res.ok else None
        if again is None or thread is None or (again.state, again.op) != (s.state, s.op):
            continue
        fg = group_in_frames(thread, s.rank, s.op)
        if fg.known:
            out[s.rank] = fg
    return out


def client_groups(pids: Iterable[int]) -> dict[int, list[dict[str, Any]]]:
    """Rank → the process groups its in-job client reported (``groups-<rank>.json``), found through the control
    directory in a rank's environment; empty when the job runs no client."""
    for pid in pids:
        try:
            control = psutil.Process(pid).environ().get(CONTROL_DIR_ENV)
        except psutil.Error:
            continue
        if control:
            return {rank: [g for g in report.get("groups") or () if isinstance(g, dict)]
                    for rank, report in ControlDir(control).groups().items()}
    return {}
