"""Read the per-rank state files of tests/jobs/nccl_like.py (``$NCCL_LIKE_STATE_DIR/rank-<r>.json``) and turn them into
what NCCL would show: an NCCL RAS report whose counts follow the job.

Each file holds one rank's NCCL-side state: pid, host, communicator id (one per run), collectives *launched* and
*completed* by type (NCCL RAS's names), bytes pending, and where the host is ("compute", "sync" = spinning in the
device sync, "blocked", "stopped", "save", "done"). The job rewrites it atomically at every change.

    ras = RasStandIn(source=lambda: ras_report(state_dir))   # ras_standin.py: a fresh report per STATUS

NCCL RAS semantics (docs/nccl-ras.md, shared/real-gpu): a collective is counted when the rank *launches* it, so the
rank that never launched the next all-reduce is behind; a rank that launched one which never completes (a broken
transport) is counted like its peers, so a transport hang shows equal, frozen counts. A process that does not answer
(stopped with SIGSTOP: its RAS thread cannot run) is a missing rank, "unresponsive"; a dead one is "considered dead".
Communicators with no live process are not reported (NCCL forgets them with their processes).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from ras_standin import Comm, Missing, Rank, report_json

STATE_DIR_ENV = "NCCL_LIKE_STATE_DIR"
ALIVE, STOPPED, DEAD = "alive", "stopped", "dead"


@dataclass(frozen=True)
class RankView:
    """One rank's file, plus how its process is now (``liveness``: alive / stopped / dead)."""

    rank: int
    world: int
    local_rank: int
    pid: int
    host: str
    comm: str
    restart: int
    step: int
    state: str
    since: float
    pending_bytes: int
    launched: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    t: float = 0.0
    liveness: str = ALIVE

    @property
    def completed_total(self) -> int:
        return sum(self.completed.values())


def liveness(pid: int) -> str:
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return DEAD
    if status == psutil.STATUS_ZOMBIE or status == psutil.STATUS_DEAD:
        return DEAD
    if status == psutil.STATUS_STOPPED:  # SIGSTOP (a ptrace stop, e.g. a blocking py-spy dump, is brief: alive)
        return STOPPED
    return ALIVE


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # gone, or (never: the job renames into place) torn


def read_ranks(state_dir: Path | str) -> list[RankView]:
    """Every rank file in ``state_dir`` (the latest run's file per rank), with each process's liveness now."""
    out = []
    for path in sorted(Path(state_dir).glob("rank-*.json")):
        doc = _read(path)
        if doc is None:
            continue
        out.append(RankView(
            rank=int(doc["rank"]), world=int(doc["world"]), local_rank=int(doc.get("local_rank", doc["rank"])),
            pid=int(doc["pid"]), host=str(doc.get("host", "127.0.0.1")), comm=str(doc["comm"]),
            restart=int(doc.get("restart", 0)), step=int(doc.get("step", 0)), state=str(doc["state"]),
            since=float(doc.get("since", 0.0)), pending_bytes=int(doc.get("pending_bytes", 0)),
            launched=dict(doc.get("launched", {})), completed=dict(doc.get("completed", {})),
            t=float(doc.get("t", 0.0)), liveness=liveness(int(doc["pid"]))))
    return out


def communicators(ranks: Sequence[RankView], cuda_dev: Callable[[RankView], int] | None = None) -> list[Comm]:
    """The ranks' communicators as NCCL RAS reports them: one per run (the job's world), live ranks with their launched
    counts, stopped ranks as unresponsive and dead ones as dead missing ranks; none without a live process."""
    dev = cuda_dev or (lambda r: r.local_rank)
    by_comm: dict[str, list[RankView]] = {}
    for r in ranks:
        by_comm.setdefault(r.comm, []).append(r)
    comms = []
    for cid, members in sorted(by_comm.items()):
        if not any(m.liveness == ALIVE for m in members):
            continue
        members.sort(key=lambda m: m.rank)
        present = [Rank(m.rank, host=m.host, pid=m.pid, cuda_dev=dev(m), counts=dict(m.launched))
                   for m in members if m.liveness == ALIVE]
        missing = [Missing(m.rank, host=m.host, pid=m.pid, cuda_dev=dev(m), unresponsive=m.liveness == STOPPED,
                           dead=m.liveness == DEAD) for m in members if m.liveness != ALIVE]
        comms.append(Comm(int(cid, 16), members[0].world, present, missing))
    return comms


def ras_report(state_dir: Path | str, *, n_gpus: int | None = None, version: str = "2.28.9") -> str:
    """An NCCL RAS JSON report (``report_json``'s layout) built from the job's state files now; ranks on CUDA device
    ``local_rank % n_gpus`` (None: one GPU per local rank), as gpu_play.GpuPlay places them."""
    comms = communicators(read_ranks(state_dir), None if n_gpus is None else (lambda r: r.local_rank % n_gpus))
    return report_json(comms, version=version, timeouts=sum(len([m for m in c.missing if m.unresponsive])
                                                             for c in comms))
