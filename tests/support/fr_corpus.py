"""Flight Recorder dumps as torch 2.13 writes them, built from each rank's program: the FR corpus's builder.

    job = Job("nccl", world=3)
    job.run(0, "all_reduce").run(0, "all_reduce", state="started")     # rank 0: #1 completed, #2 in flight
    job.write(directory, waited_s=60.0)      # <dir>/nccl_trace_rank_<r>, mtime 60 s after the dump's newest stamp

A rank's program is its ops in the order it issued them; the builder numbers and records them as the backends do
(checked against the real dumps in tests/data/fr and tests/data/real-gpu, and a real gloo run of every op):

* **NCCL**: per group, ``collective_seq_id`` counts collectives (a coalesced batch takes one), ``p2p_seq_id`` counts
  sends/recvs (a batch takes one); ``op_id`` counts every op. States move scheduled → started (only with timing on)
  → completed; a batch's ops stay "scheduled" and its closing entry ("coalesced", "ALLGATHER_coalesced") carries the
  batch's state. ``pg_config`` lists the groups the rank is in with their members; ``pg_status`` counts collectives.
* **gloo**: every entry stays "scheduled", a finished one is ``retired``; sends and recvs are not recorded at all
  but take an ``op_id``, and ``pg_status`` counts in op ids (last enqueued / completed collective's op id);
  ``pg_config`` is the one empty entry gloo writes.
"""

from __future__ import annotations

import os
import pickle
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSION = "2.10"  # the Flight Recorder version torch 2.13 writes (tests/data/fr), and torch 2.11's on the H200
# The keys of every entry torch 2.13 writes (tests/data/fr, tests/data/real-gpu): checked by the corpus test.
ENTRY_KEYS = ("record_id", "pg_id", "process_group", "thread_name", "thread_id", "collective_seq_id", "p2p_seq_id",
              "op_id", "profiling_name", "time_created_ns", "input_sizes", "input_dtypes", "output_sizes",
              "output_dtypes", "state", "time_discovered_started_ns", "time_discovered_completed_ns", "retired",
              "timeout_ms", "is_p2p", "frames")
T0_NS = 1_795_000_000 * 10**9
DUMP_NAME = "nccl_trace_rank_"  # torch's default TORCH_FR_DUMP_TEMP_FILE prefix


@dataclass(frozen=True)
class Op:
    """One op as a rank issues it. ``peer`` (send/recv) is a global rank; sizes are what torch records."""

    name: str
    state: str = "completed"  # "scheduled" | "started" | "completed"
    group: str = "0"
    inputs: tuple[tuple[int, ...], ...] = ((4,),)
    outputs: tuple[tuple[int, ...], ...] = ((4,),)
    dtype: str = "Float"
    peer: int | None = None

    @property
    def is_p2p(self) -> bool:
        return self.name in ("send", "recv")


@dataclass(frozen=True)
class Batch:
    """Ops issued as one coalesced batch (batch_isend_irecv, a coalescing manager, an uneven all_gather), closed by
    the entry ``closer`` whose state is the batch's."""

    ops: tuple[Op, ...]
    state: str = "completed"
    closer: str = "coalesced"
    group: str = "0"

    @property
    def is_p2p(self) -> bool:
        return any(o.is_p2p for o in self.ops)


@dataclass
class _Counters:
    seq: int = 0  # collective_seq_id
    p2p: int = 0  # p2p_seq_id
    op_id: int = 0
    enqueued: int = -1  # pg_status, in the backend's unit
    started: int = -1
    completed: int = -1


@dataclass
class Job:
    backend: str  # "nccl" | "gloo"
    world: int
    groups: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # name: (desc, global ranks)
    programs: dict[int, list[Op | Batch]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        self.groups.setdefault("0", ("default_pg", tuple(range(self.world))))

    def group(self, name: str, desc: str, ranks: Sequence[int]) -> Job:
        self.groups[name] = (desc, tuple(ranks))
        return self

    def run(self, rank: int, op: str | Op | Batch, **kw: Any) -> Job:
        self.programs[rank].append(op if isinstance(op, (Op, Batch)) else Op(op, **kw))
        return self

    def dumps(self) -> dict[int, dict[str, Any]]:
        return {r: _RankDump(self, r).doc() for r in range(self.world)}

    def write(self, directory: Path, waited_s: float = 60.0) -> Path:
        """One pickle per rank, its mtime ``waited_s`` after the newest stamp of the whole job (when the dumps
        were taken)."""
        directory.mkdir(parents=True, exist_ok=True)
        docs = self.dumps()
        newest = max((_newest_ns(d) for d in docs.values()), default=T0_NS) / 1e9
        for r, doc in docs.items():
            path = directory / f"{DUMP_NAME}{r}"
            path.write_bytes(pickle.dumps(doc))
            os.utime(path, (newest + waited_s, newest + waited_s))
        return directory


def _newest_ns(doc: dict[str, Any]) -> int:
    return max((v for e in doc["entries"] for k in ("time_created_ns", "time_discovered_started_ns",
                                                     "time_discovered_completed_ns") if (v := e.get(k))),
               default=T0_NS)


class _RankDump:
    """One rank's dump: its program numbered and recorded as its backend does."""

    def __init__(self, job: Job, rank: int) -> None:
        self.job, self.rank, self.gloo = job, rank, job.backend == "gloo"
        mine = [n for n, (_d, ranks) in job.groups.items() if rank in ranks]
        self.pg_id = {n: i for i, n in enumerate(mine)}  # rank-local ids, in creation order
        self.counters = {n: _Counters() for n in mine}
        self.entries: list[dict[str, Any]] = []

    def doc(self) -> dict[str, Any]:
        for item in self.job.programs.get(self.rank, []):
            self._batch(item) if isinstance(item, Batch) else self._single(item)
        return {"version": VERSION, "pg_config": self._config(), "comm_lib_version": "" if self.gloo else "2.28.9",
                "pg_status": {str(self.pg_id[n]): {"last_enqueued_collective": c.enqueued,
                                                   "last_started_collective": c.started,
                                                   "last_completed_collective": c.completed}
                              for n, c in self.counters.items()},
                "entries": self.entries}

    def _config(self) -> dict[str, Any]:
        if self.gloo:
            return {"": {"name": "", "desc": "", "ranks": "[]"}}
        return {n: {"name": n, "desc": self.job.groups[n][0], "ranks": str(list(self.job.groups[n][1]))}
                for n in self.pg_id}

    def _single(self, op: Op) -> None:
        c = self.counters[op.group]
        c.op_id += 1
        if op.is_p2p:
            c.p2p += 1
            if not self.gloo:  # gloo records no send/recv: only its op counter moves
                self._record(op, c, op.state)
            return
        c.seq += 1
        self._record(op, c, op.state)
        self._status(c, op.state, c.op_id if self.gloo else c.seq)

    def _batch(self, b: Batch) -> None:
        c = self.counters[b.group]
        if b.is_p2p:
            c.p2p += 1
        else:
            c.seq += 1
        for op in b.ops:
            c.op_id += 1
            self._record(op, c, "scheduled", in_batch=b.is_p2p)
        self._record(Op(b.closer, group=b.group, inputs=(), outputs=()), c, b.state, in_batch=b.is_p2p,
                     dtype_less=True)
        if not b.is_p2p:
            self._status(c, b.state, c.seq)

    def _status(self, c: _Counters, state: str, n: int) -> None:
        c.enqueued = n
        if state in ("started", "completed"):
            c.started = n if not self.gloo else c.started
        if state == "completed":
            c.completed = n

    def _record(self, op: Op, c: _Counters, state: str, in_batch: bool = False, dtype_less: bool = False) -> None:
        rid = len(self.entries)
        created = T0_NS + (rid + 1) * 10_000_000
        nccl_state = None if self.gloo else state  # gloo's entries stay "scheduled"; a finished one is retired
        desc, members = self.job.groups[op.group]
        self.entries.append({
            "record_id": rid, "pg_id": self.pg_id[op.group], "process_group": (op.group, desc),
            "thread_name": "python3", "thread_id": "140000000000000", "collective_seq_id": c.seq,
            "p2p_seq_id": c.p2p, "op_id": c.op_id,
            "profiling_name": f"{self.job.backend}:{_title(op, self.rank, sorted(members))}",
            "time_created_ns": created, "input_sizes": [list(s) for s in op.inputs],
            "input_dtypes": [] if dtype_less else [op.dtype] * len(op.inputs),
            "output_sizes": [list(s) for s in op.outputs],
            "output_dtypes": [] if dtype_less else [op.dtype] * len(op.outputs),
            "state": nccl_state or "scheduled",
            "time_discovered_started_ns": created + 1_000_000 if nccl_state == "started" else None,
            "time_discovered_completed_ns": created + 5_000_000 if nccl_state == "completed" else None,
            "retired": state == "completed", "timeout_ms": 600_000, "is_p2p": op.is_p2p or in_batch,
            "frames": [{"name": op.name, "filename": "torch/distributed/distributed_c10d.py", "line": 3000}]})


def _title(op: Op, rank: int, members: Sequence[int]) -> str:
    """The op's name as the profiling title carries it: "send 0->1" with ranks local to the group."""
    if not op.is_p2p:
        return op.name
    me, peer = members.index(rank), members.index(op.peer if op.peer is not None else rank)
    return f"send {me}->{peer}" if op.name == "send" else f"recv {me}<-{peer}"


def fill_pg_config(doc: Mapping[str, Any], groups: Mapping[str, tuple[str, tuple[int, ...]]], rank: int
                   ) -> dict[str, Any]:
    """A gloo dump with the ``pg_config`` NCCL would have written (the groups the rank is in, with members): what
    PyTorch's fr_trace needs to read it at all (gloo's one empty entry lists no ranks)."""
    return {**doc, "pg_config": {n: {"name": n, "desc": d, "ranks": str(list(r))}
                                 for n, (d, r) in groups.items() if rank in r}}


# ---- what each op records ---------------------------------------------------------------------------------------

Sizes = tuple[tuple[int, ...], ...]
ROOT = 0  # the root of broadcast / reduce / gather / scatter in the corpus


def shape(op: str, rank: int, world: int, n: int = 4) -> tuple[Sizes, Sizes]:
    """(input_sizes, output_sizes) a rank records for ``op`` on ``n`` elements per rank, as torch records them:
    flattened outputs for all_gather / inputs for reduce_scatter, the root's full list for gather / scatter (a
    non-root records none), one size per rank for the ``_v`` variants (``n + r`` for rank r: uneven)."""
    per_rank = tuple((n + r,) for r in range(world))
    shapes: dict[str, tuple[Sizes, Sizes]] = {
        "all_gather": (((n,),), ((world, n),)),
        "_all_gather_base": (((n,),), ((world * n,),)),
        "all_gather_into_tensor_coalesced": (((n,), (n + 1,)), ((world * n,), (world * (n + 1),))),
        "reduce_scatter": (((world, n),), ((n,),)),
        "_reduce_scatter_base": (((world * n,),), ((n,),)),
        "reduce_scatter_tensor_coalesced": (((world * n,), (world * (n + 1),)), ((n,), (n + 1,))),
        "all_gather_v": (((n + rank,),), per_rank),
        "reduce_scatter_v": (per_rank, ((n + rank,),)),
        "gather": (((n,),), ((world, n),) if rank == ROOT else ()),
        "scatter": (((world, n),) if rank == ROOT else (), ((n,),)),
        "all_to_all": (((world * n,),), ((world * n,),)),
        "allreduce_coalesced": (((n,), (n + 1,)), ((n,), (n + 1,))),
        "all_reduce_barrier": (((1,),), ((1,),)),
        "barrier": ((), ()),
    }
    return shapes.get(op, (((n,),), ((n,),)))


def uneven_all_to_all(rank: int, splits: Sequence[Sequence[int]]) -> tuple[Sizes, Sizes]:
    """all_to_all_single with split sizes: ``splits[i][j]`` elements go from rank i to rank j (MoE's routing). A rank
    records its input total and its output total."""
    return ((sum(splits[rank]),),), ((sum(row[rank] for row in splits),),)


def sized(op: str, rank: int, world: int, n: int = 4, **kw: Any) -> Op:
    """``op`` with the sizes it records (``shape``)."""
    inputs, outputs = shape(op, rank, world, n)
    return Op(op, inputs=inputs, outputs=outputs, **kw)
