"""Name the ranks that broke a hung job from Flight Recorder dumps of every process group (pure functions).

A real job runs many process groups (TP, DP, PP, …) and the hang sits in one of them. Per group, the members'
last enqueued collective sequence ids and the entries at the frontier tell who waits and who never came:

* **missing**: members that never enqueued the collective their peers wait in;
* **mismatch**: members in a different op, or with different sizes / dtypes, at the same sequence id (the side
  that differs from the job's other ranks at that sequence id in groups of the same description is named; a
  coalesced batch is compared op by op); sizes are compared on the side that must agree (the input; the output of
  scatter and all_gather_v; none for all_to_all's split sizes: ``_signature``), dtypes as the set a rank moves (a
  scatter's non-root records no input);
* **p2p**: a send or recv whose partner has no matching recv / send;
* **behind**: members that enqueued collectives the others completed, and never completed them (``pg_status``) —
  also a member that has completed none at all yet (the job's very first collective).

A missing rank is not the culprit when it is itself blocked in another group waiting on someone else: the ranks
waiting form a graph (waiter → the ranks it waits for) and the culprits are where the chains end: ranks blocked
on nobody (or with no dump at all). A chain that closes on itself (a send posted while the partner runs a
collective that waits for the sender) names the rank whose send/recv nobody matches.

Structure decides, the clock only where the dumps tell it. A member **behind in completion** (``pg_status``: the
others completed collectives it enqueued and did not complete — its device stopped) and a **mismatch** are hangs
whatever the clock says. What a merely slow job shows as well — a member that has not enqueued the collective yet
(``missing``, an unmatched ``p2p``), or every member inside the same collective (``blocked``) — is "in progress" (a
slow rank, not a hang; it names nobody) when the dumps tell when they were taken and every wait of the job is
shorter than ``min_wait_s``. A dump holds no time of its own: its file's mtime is its time while the dump's own
clock agrees (``told_dump_time``); a dump copied or checked out elsewhere tells no wait at all (its newest stamp is
only a lower bound: measured against it, a rank waiting in its newest collective "waited 0.0 s"), and there the
structure alone decides.

Dump format (``torch/csrc/distributed/c10d/FlightRecorder.hpp``, read the same for gloo and NCCL, versions 2.x):
``pg_config`` {group name: {name, desc, ranks: "[0, 1]"}} (NCCL fills it; gloo leaves one empty entry, so group
members are then the ranks whose entries name the group), ``pg_status`` {pg_id: {last_enqueued_collective,
last_started_collective, last_completed_collective}} where pg_id is the rank-local id the entries carry in ``pg_id``
(a group without entries is paired with its id by creation order: ``_status_names``; gloo counts op ids there, sends
and recvs included: ``_gloo_seq``), and ``entries`` with ``process_group`` = (name, desc), ``collective_seq_id``,
``p2p_seq_id``, ``is_p2p``, ``profiling_name`` ("nccl:all_reduce", "nccl:send 0->1", "nccl:recv 1<-0"; gloo records
no send/recv), ``input_sizes``, ``output_sizes``, ``input_dtypes``, ``op_id``, ``state`` (scheduled / started /
completed: NCCL tracks it; gloo always says scheduled and marks a finished entry ``retired``; a batch —
``batch_isend_irecv``, a coalesced collective — is closed by an entry whose state is the batch's: ``CLOSES_BATCH``),
``time_created_ns``, ``timeout_ms`` (the group's timeout when the op was enqueued). Everything is read defensively:
a field of the wrong type is treated as absent.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_watchdog.evidence.stacks.diagnosis import format_ranks

DEFAULT_MIN_WAIT_S = 10.0  # a wait shorter than this at dump time is a slow rank, not a hang
# The findings a merely slow job also shows, which only the clock (where the dumps tell it) tells from a hang: every
# member inside the collective, or a member not there yet. "behind" and "mismatch" are hangs by structure alone.
CLOCKED = ("missing", "p2p", "blocked")
DEFAULT_DESC = "default_pg"
_P2P_NAME = re.compile(r"^(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)$")


@dataclass(frozen=True)
class FrOp:
    """One recorded operation of one rank in one group."""

    seq: int  # collective_seq_id (a p2p op carries the group's current collective seq)
    p2p_seq: int
    op: str  # "all_reduce", "send", "recv", … (backend prefix dropped)
    peer: int | None  # a p2p op's partner, as a rank local to the group
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    state: str
    done: bool
    created_s: float | None
    timeout_s: float | None = None  # the collective's own timeout (``timeout_ms``): when the backend gives up on it
    out_sizes: tuple[tuple[int, ...], ...] = ()  # ``output_sizes``: what must agree for scatter, all_gather_v
    out_dtypes: tuple[str, ...] = ()

    @property
    def is_p2p(self) -> bool:
        return self.peer is not None or self.op in ("send", "recv")


@dataclass
class GroupView:
    """One rank's view of one process group."""

    name: str
    desc: str
    members: tuple[int, ...] | None = None  # global ranks, from pg_config
    last_enqueued: int = -1
    last_completed: int = -1
    status_seen: bool = False  # pg_status named this group: last_completed -1 then means "completed none yet"
    ops: list[FrOp] = field(default_factory=list)  # oldest first

    def pending(self) -> list[FrOp]:
        return [o for o in self.ops if not o.done]


@dataclass(frozen=True)
class RankTrace:
    rank: int
    version: str
    groups: Mapping[str, GroupView]
    dumped_at: float | None = None  # unix seconds the dump was taken where the dump tells (told_dump_time), else None
    entries: int = 0


@dataclass(frozen=True)
class GroupFinding:
    """A process group with an unfinished collective (or p2p) and what its members did."""

    name: str
    desc: str
    kind: str  # "missing" | "mismatch" | "p2p" | "behind" (enqueued, not completing) | "blocked" | "in_progress"
    op: str | None
    sizes: list[list[int]] | None
    dtypes: list[str] | None
    seq: int | None
    members: tuple[int, ...]
    waiting: tuple[int, ...]
    missing: tuple[int, ...]
    mismatch: str | None = None  # "op" | "sizes" | "dtypes"
    culprits: tuple[int, ...] = ()  # the members this group alone blames (before following chains)
    waited_s: float | None = None
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "desc": self.desc, "kind": self.kind, "op": self.op, "sizes": self.sizes,
                "dtypes": self.dtypes, "seq": self.seq, "members": list(self.members),
                "waiting_ranks": list(self.waiting), "missing_ranks": list(self.missing),
                "mismatch": self.mismatch, "culprit_ranks": list(self.culprits), "waited_s": self.waited_s,
                "detail": self.detail}


@dataclass(frozen=True)
class FrAnalysis:
    culprit_ranks: tuple[int, ...]
    reason: str
    groups: tuple[GroupFinding, ...] = ()
    ranks: tuple[int, ...] = ()  # ranks with a dump
    no_dump: tuple[int, ...] = ()  # members of some group (or below world_size) without a dump: suspects
    versions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


# ---- reading one dump ---------------------------------------------------------------------------------------

def _int(v: Any, default: int = -1) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def parse_ranks(text: Any) -> tuple[int, ...] | None:
    """pg_config's ``ranks``: the string "[0, 1, 2]" (or a list); None when absent, empty or malformed."""
    if isinstance(text, (list, tuple)):
        items = list(text)
    elif isinstance(text, str) and text.strip().startswith("[") and text.strip().endswith("]"):
        inner = text.strip()[1:-1].strip()
        items = [p.strip() for p in inner.split(",")] if inner else []
    else:
        return None
    out: list[int] = []
    for p in items:
        if isinstance(p, int) and not isinstance(p, bool):
            out.append(p)
        elif isinstance(p, str) and p.isdigit():
            out.append(int(p))
        else:
            return None
    return tuple(out) or None


def _op_of(entry: Mapping[str, Any]) -> tuple[str, int | None]:
    """("all_reduce", None) from "gloo:all_reduce"; ("send", 1) from "nccl:send 0->1"; ("recv", 0) from
    "nccl:recv 1<-0" (the peer is local to the group)."""
    name = entry.get("profiling_name")
    name = name.split(":", 1)[1] if isinstance(name, str) and ":" in name else (name if isinstance(name, str) else "?")
    m = _P2P_NAME.match(name.strip())
    if m:
        kind, a, _arrow, b = m.groups()
        return kind, int(b)  # send src->dst: peer dst; recv dst<-src: peer src
    return name.strip() or "?", None


def _sizes(v: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, (list, tuple)):
        return ()
    return tuple(tuple(_int(x, 0) for x in s) if isinstance(s, (list, tuple)) else () for s in v)


def _dtypes(v: Any) -> tuple[str, ...]:
    return tuple(d for d in v if isinstance(d, str)) if isinstance(v, (list, tuple)) else ()


def _is_done(entry: Mapping[str, Any], op: str, seq: int, gv: GroupView, gloo: bool) -> bool:
    if entry.get("state") == "completed":
        return True
    if gloo and entry.get("retired") is True:  # gloo never updates state; a finished work is retired
        return True
    # pg_status counts collectives only; a retired NCCL entry that is not completed timed out (still unfinished)
    return op not in ("send", "recv") and not entry.get("is_p2p") and 0 <= seq <= gv.last_completed


def _group_of(entry: Mapping[str, Any]) -> tuple[str, str]:
    """An entry's (group name, desc); the default group "0" when it names none."""
    pg = entry.get("process_group")
    if not isinstance(pg, (list, tuple)) or not pg:
        return "0", ""
    return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""


def rank_trace(doc: Mapping[str, Any], rank: int, dumped_at: float | None = None) -> RankTrace:
    """The analysis' view of one loaded dump (``flight_recorder.load_dump``)."""
    version = str(doc.get("version", "?"))
    entries = [e for e in doc.get("entries", ()) if isinstance(e, Mapping)]
    entries.sort(key=lambda e: _int(e.get("record_id"), 0))
    groups: dict[str, GroupView] = {}
    config = doc.get("pg_config")
    _add_config_groups(groups, config)
    pg_id_name = _add_entry_groups(groups, entries)
    status = doc.get("pg_status")
    if isinstance(status, Mapping):
        _apply_status(groups, status, _status_names(status, config, pg_id_name, groups), _gloo_op_ids(entries))
    for e in entries:
        _record_entry(groups[_group_of(e)[0]], e)
    return RankTrace(rank, version, groups, told_dump_time(entries, dumped_at), len(entries))


def _view(groups: dict[str, GroupView], name: str, desc: str) -> GroupView:
    """The group named ``name``, added when new; a description learnt later fills an empty one."""
    gv = groups.get(name)
    if gv is None:
        gv = groups[name] = GroupView(name, desc)
    elif desc and not gv.desc:
        gv.desc = desc
    return gv


def _add_config_groups(groups: dict[str, GroupView], config: Any) -> None:
    """Add the groups ``pg_config`` lists, with their members (gloo's one empty entry lists none)."""
    if not isinstance(config, Mapping):
        return
    for key, info in config.items():
        if not isinstance(info, Mapping):
            continue
        members = parse_ranks(info.get("ranks"))
        name = str(info.get("name", key))
        if members and name:
            _view(groups, name, str(info.get("desc") or "")).members = members


def _add_entry_groups(groups: dict[str, GroupView], entries: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Add the groups the entries name; return the rank-local pg ids they show → group names."""
    pg_id_name: dict[str, str] = {}
    for e in entries:
        name, desc = _group_of(e)
        _view(groups, name, desc)
        if "pg_id" in e:
            pg_id_name[str(e["pg_id"])] = name
    return pg_id_name


def _apply_status(groups: Mapping[str, GroupView], status: Mapping[Any, Any], pg_id_name: Mapping[str, str],
                  gloo_ops: Mapping[str, Sequence[tuple[int, int]]]) -> None:
    """Take each named group's last enqueued and last completed collective from ``pg_status`` (gloo's op counters
    translated into collective sequence ids: ``_gloo_seq``)."""
    for pg_id, st in status.items():
        known = pg_id_name.get(str(pg_id))
        if known is None or not isinstance(st, Mapping):
            continue  # a group whose entries left the ring buffer: its name is unknown
        gv = groups[known]
        counters = _int(st.get("last_enqueued_collective")), _int(st.get("last_completed_collective"))
        enqueued, completed = (_gloo_seq(c, gloo_ops[known]) for c in counters) if known in gloo_ops else counters
        if completed is not None:
            gv.status_seen = True
            gv.last_completed = max(gv.last_completed, completed)
        gv.last_enqueued = max(gv.last_enqueued, -1 if enqueued is None else enqueued)


def _gloo_op_ids(entries: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    """Per gloo group: its entries' (``op_id``, ``collective_seq_id``), oldest first."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for e in entries:
        op_id, seq = _int(e.get("op_id")), _int(e.get("collective_seq_id"))
        if str(e.get("profiling_name", "")).startswith("gloo:") and op_id >= 0 and seq >= 0:
            out[_group_of(e)[0]].append((op_id, seq))
    return out


def _gloo_seq(counter: int, op_seq: Sequence[tuple[int, int]]) -> int | None:
    """The collective sequence id a gloo ``pg_status`` counter stands for. Gloo counts every op of a group in it —
    its sends and recvs too, which it does not record — as in the entries' ``op_id``, while ``collective_seq_id``
    counts collectives only: a pipeline stage that sent 3 times has completed op 5 where its peers completed op 2,
    all of them collective #2. The counter is the newest collective entry's at or before it; the counter itself where
    no send/recv came before the oldest entry (op id = seq); None (unknown) where the ring buffer lost the mapping."""
    if counter < 0:
        return counter
    before = [seq for op_id, seq in op_seq if op_id <= counter]
    if before:
        return max(before)
    return counter if op_seq and op_seq[0][0] == op_seq[0][1] else None


def _record_entry(gv: GroupView, e: Mapping[str, Any]) -> None:
    """Add one entry to its group's ops (a "coalesced" entry instead closes its batch)."""
    op, peer = _op_of(e)
    seq = _int(e.get("collective_seq_id"), 0)
    p2p_seq = _int(e.get("p2p_seq_id"), 0)
    gloo = str(e.get("profiling_name", "")).startswith("gloo:")
    done = _is_done(e, op, seq, gv, gloo)
    if CLOSES_BATCH.match(op):
        _close_batch(gv, bool(e.get("is_p2p")), seq, p2p_seq, str(e.get("state", "?")), done)
        return
    created = e.get("time_created_ns")
    gv.ops.append(FrOp(
        seq=seq, p2p_seq=p2p_seq, op=op, peer=peer, sizes=_sizes(e.get("input_sizes")),
        dtypes=_dtypes(e.get("input_dtypes")),
        state=str(e.get("state", "?")), done=done,
        created_s=created / 1e9 if isinstance(created, (int, float)) and created > 0 else None,
        timeout_s=max(_int(e.get("timeout_ms"), 0), 0) / 1000.0 or None, out_sizes=_sizes(e.get("output_sizes")),
        out_dtypes=_dtypes(e.get("output_dtypes"))))
    if not (peer is not None or e.get("is_p2p")):
        gv.last_enqueued = max(gv.last_enqueued, seq)


def _status_names(status: Mapping[Any, Any], config: Any, from_entries: Mapping[str, str],
                  groups: Mapping[str, GroupView]) -> dict[str, str]:
    """pg_status keys (rank-local pg ids) → group names. The entries name the groups of their ids; a dump of active
    entries only (NCCL's dump on timeout) may hold none for a group — or none at all, on a rank that stopped issuing
    work, the very rank to find. Then the order tells: ProcessGroupNCCL numbers its groups as the rank creates them
    and torch names groups by a job-wide creation counter, so the i-th pg id (numerically) is the i-th group name of
    ``pg_config`` when both lists are as long, every name is a number and the pairs the entries show agree (other
    backends' groups take ids too: ids skip, names do not). Else a group named after its id (a job with one backend
    and torch's default names), when the entries show no other pairing."""
    out = dict(from_entries)
    ids = sorted((str(k) for k in status if str(k).isdigit()), key=int)
    names = [str(info.get("name", key)) for key, info in config.items() if isinstance(info, Mapping)] \
        if isinstance(config, Mapping) else []
    if ids and len(ids) == len(names) and all(n.isdigit() for n in names):
        ordinal = dict(zip(ids, sorted(names, key=int), strict=True))
        if all(ordinal.get(k) == v for k, v in from_entries.items()) and all(n in groups for n in names):
            return {**ordinal, **out}
    if all(k == v for k, v in from_entries.items()):
        out.update({k: k for k in ids if k in groups and k not in out})
    return out


# ProcessGroupNCCL records a batch (batch_isend_irecv, a coalesced collective) as one entry per op, all with the
# batch's sequence id, then one entry for the work that runs them together: only that one's state moves (the ops
# stay "scheduled" forever). It is bookkeeping, not an op of its own: "coalesced", or "<OPTYPE>_coalesced" where an
# all_gather / reduce_scatter of uneven sizes runs as one _broadcast_oop / _reduce_oop per rank
# ("ALLGATHER_coalesced"). The lower-case fast paths ("allreduce_coalesced", "all_gather_into_tensor_coalesced")
# are collectives of their own.
CLOSES_BATCH = re.compile(r"^(?:coalesced|[A-Z][A-Z_]*_coalesced)$")


def _close_batch(gv: GroupView, p2p: bool, seq: int, p2p_seq: int, state: str, done: bool) -> None:
    """The ops of the batch a "coalesced" entry closes (the group's newest ops with its sequence id) take its
    state."""
    i = len(gv.ops)
    while i > 0 and (gv.ops[i - 1].p2p_seq == p2p_seq if p2p else gv.ops[i - 1].seq == seq) and \
            gv.ops[i - 1].is_p2p == p2p:
        i -= 1
        gv.ops[i] = replace(gv.ops[i], state=state, done=done)


# A file's mtime is the dump's time only while the dump's own clock agrees: dumps copied or unpacked elsewhere get
# a new mtime (a report once said "waited 36939078 s"). NCCL writes its dumps within its collective timeout.
MTIME_TRUSTED_S = 3600.0


def dump_time(entries: Sequence[Mapping[str, Any]], mtime: float | None) -> float | None:
    """When the dump was taken, in unix seconds: the file's mtime when it is at most MTIME_TRUSTED_S after the
    newest timestamp inside the dump, else that newest timestamp (the dump's own clock)."""
    stamps = [v / 1e9 for e in entries for k in ("time_created_ns", "time_discovered_started_ns",
                                                 "time_discovered_completed_ns")
              if isinstance(v := e.get(k), (int, float)) and not isinstance(v, bool) and v > 0]
    newest = max(stamps, default=None)
    if newest is None:
        return mtime
    if mtime is not None and newest <= mtime <= newest + MTIME_TRUSTED_S:
        return mtime
    return newest


def told_dump_time(entries: Sequence[Mapping[str, Any]], mtime: float | None) -> float | None:
    """When the dump was taken, where the dump tells: its file's mtime while the dump's own clock agrees (dump_time
    chose it); else None. A dump holds no time of its own: its newest timestamp is only a lower bound of when it
    was taken — the creation of the very collective its rank waits in, on a dump of active entries — and a wait
    measured against it reads "0.0 s" however long the rank had waited (NVIDIA's fault-injected dumps, checked out
    from git with new mtimes). Such waits are unknown, not short."""
    at = dump_time(entries, mtime)
    return at if mtime is not None and at == mtime else None


# ---- the analysis -------------------------------------------------------------------------------------------

def _members(name: str, traces: Mapping[int, RankTrace], world: set[int]) -> tuple[int, ...]:
    for t in traces.values():
        gv = t.groups.get(name)
        if gv is not None and gv.members:
            return gv.members
    known = {r for r, t in traces.items() if name in t.groups}
    descs = {t.groups[name].desc for t in traces.values() if name in t.groups}
    if name == "0" or DEFAULT_DESC in descs:
        known |= world
    return tuple(sorted(known))


# Which sizes must agree on every member: the input (the default: all_reduce, broadcast, gather's contribution,
# reduce_scatter_v's full input), the output where each rank sends its own share and all receive the same (scatter
# from its root, all_gather_v), none where each rank has its own split sizes (all_to_all: MoE's uneven routing is
# normal; only the totals agree, ``_split_totals_differ``).
SPLIT_SIZES = frozenset({"all_to_all", "all_to_all_single", "all_to_all_v_single", "alltoall", "alltoall_base"})
OUTPUT_AGREES = frozenset({"scatter", "all_gather_v"})


def _signature(ops: Sequence[FrOp], kind: str) -> object:
    """What a member ran at one sequence id (a coalesced batch: every op of it), as far as ``kind`` compares."""
    if kind == "op":
        return tuple(o.op for o in ops)
    if kind == "dtypes":  # the types a member moves, whichever side: a scatter root has inputs, its peers none
        return tuple(frozenset(o.dtypes + o.out_dtypes) for o in ops)
    return tuple(None if o.op in SPLIT_SIZES else o.out_sizes if o.op in OUTPUT_AGREES else o.sizes for o in ops)


def _op_at(gv: GroupView | None, seq: int) -> FrOp | None:
    if gv is None:
        return None
    return next((o for o in reversed(gv.ops) if o.seq == seq and not o.is_p2p), None)


def _ops_at(gv: GroupView | None, seq: int) -> tuple[FrOp, ...]:
    """Every collective op a member recorded at ``seq``: one, or the ops of a coalesced batch."""
    return () if gv is None else tuple(o for o in gv.ops if o.seq == seq and not o.is_p2p)


def _waited(traces: Mapping[int, RankTrace], ops: Mapping[int, FrOp]) -> float | None:
    ages = [traces[r].dumped_at - o.created_s for r, o in ops.items()  # type: ignore[operator]
            if traces[r].dumped_at is not None and o.created_s is not None]
    return round(max(ages), 1) if ages else None


def _deviants(members_ops: Mapping[int, Sequence[FrOp]], name: str, desc: str, seq: int,
              traces: Mapping[int, RankTrace]) -> tuple[str | None, tuple[int, ...]]:
    """(mismatch kind, the ranks whose ops at ``seq`` differ). A tie inside the group is broken by what every rank
    of every group with the same description did at the same sequence id (TP groups run the same program)."""
    for kind in ("op", "sizes", "dtypes"):
        sigs = {r: _signature(ops, kind) for r, ops in members_ops.items()}
        if len(set(sigs.values())) < 2:
            continue
        votes = Counter(sigs.values())
        top = votes.most_common()
        if top[0][1] == top[1][1]:  # tie: ask the sibling groups
            votes = Counter()
            for t in traces.values():
                for gv in t.groups.values():
                    if gv.desc == desc and gv.name != name:
                        ops = _ops_at(gv, seq)
                        if ops:
                            votes[_signature(ops, kind)] += 1
            ranked = [s for s, _ in votes.most_common() if s in set(sigs.values())]
            if not ranked or (len(votes) > 1 and votes.most_common()[0][1] == votes.most_common()[1][1]):
                return kind, tuple(sorted(sigs))  # cannot tell which side: name them all
            normal = ranked[0]
        else:
            normal = top[0][0]
        return kind, tuple(sorted(r for r, s in sigs.items() if s != normal))
    return None, ()


def _fmt_sizes(o: FrOp | None) -> str:
    return "x".join(str(list(s)) for s in o.sizes) if o and o.sizes else "-"


@dataclass
class _Graph:
    """Who waits for whom, filled group by group."""

    waits: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    blocked: set[int] = field(default_factory=set)  # ranks with an unfinished op in a stuck group
    direct: set[int] = field(default_factory=set)  # mismatch deviants: the cause wherever they are
    p2p_blame: set[int] = field(default_factory=set)  # ranks that posted a send/recv nobody matches


def _where(name: str, desc: str) -> str:
    return f"group {name}{f' ({desc})' if desc else ''}"


def _collective_finding(name: str, desc: str, members: tuple[int, ...], views: Mapping[int, GroupView | None],
                        traces: Mapping[int, RankTrace], g: _Graph) -> GroupFinding | None:
    coll = [o for gv in views.values() if gv is not None for o in gv.pending() if not o.is_p2p]
    if not coll:
        return None
    seq = min(o.seq for o in coll)
    present = {r: o for r in members if (o := _op_at(views.get(r), seq)) is not None}
    waiting = tuple(sorted(r for r, o in present.items() if not o.done))
    missing = _never_enqueued(seq, members, present, views, traces)
    ref = present[waiting[0]] if waiting else next(iter(present.values()))
    waited = _waited(traces, {r: present[r] for r in waiting})
    batches = {r: _ops_at(views.get(r), seq) for r in present}
    kind_m, deviants = _deviants(batches, name, desc, seq, traces) if len(present) > 1 else (None, ())
    base: dict[str, Any] = dict(name=name, desc=desc, op=ref.op, sizes=[list(s) for s in ref.sizes],
                                dtypes=list(ref.dtypes), seq=seq, members=members, waiting=waiting, missing=missing,
                                waited_s=waited)
    where = f"{_where(name, desc)} {ref.op} #{seq}"
    g.blocked.update(waiting)
    if deviants:
        return _mismatch_finding(base, where, batches, kind_m, deviants, g)
    for r in waiting:
        g.waits[r] |= set(missing)
    if missing:
        return GroupFinding(kind="missing", culprits=missing, **base,
                            detail=f"{where} {_fmt_sizes(ref)}: {_waits(waiting)}; {format_ranks(missing)} never "
                                   "enqueued it")
    behind = _behind_in_completion(members, views)
    if behind:
        return _behind_finding(base, members, views, behind, g)
    return GroupFinding(kind="blocked", **base, detail=f"{where}: {_waits(waiting)}, no member is missing")


def _never_enqueued(seq: int, members: tuple[int, ...], present: Mapping[int, FrOp],
                    views: Mapping[int, GroupView | None], traces: Mapping[int, RankTrace]) -> tuple[int, ...]:
    """Members that never enqueued the collective ``seq``: those without a dump, and those without its entry whose
    group shows nothing enqueued that far."""
    lost = {r for r in members if r not in traces}
    return tuple(sorted(lost | {r for r in members if r in traces and r not in present
                                and (views.get(r) is None or views[r].last_enqueued < seq)}))  # type: ignore[union-attr]


def _mismatch_finding(base: dict[str, Any], where: str, batches: Mapping[int, Sequence[FrOp]], kind_m: str | None,
                      deviants: tuple[int, ...], g: _Graph) -> GroupFinding:
    """The members at the frontier run different collectives: the deviants are the cause, and every waiter waits
    for them."""
    g.direct.update(deviants)
    for r in base["waiting"]:
        g.waits[r] |= set(deviants) - {r}
    what = ", ".join(f"{format_ranks([r])} {_fmt_batch(batches[r])}" for r in deviants)
    normal = next((ops for r, ops in batches.items() if r not in deviants), batches[deviants[0]])
    return GroupFinding(kind="mismatch", mismatch=kind_m, culprits=deviants, **base,
                        detail=f"{where}: {kind_m} mismatch: {what} where the others run {_fmt_batch(normal)}")


def _fmt_batch(ops: Sequence[FrOp]) -> str:
    return " + ".join(f"{o.op} {_fmt_sizes(o)}" for o in ops)


def _behind_finding(base: dict[str, Any], members: tuple[int, ...], views: Mapping[int, GroupView | None],
                    behind: tuple[int, ...], g: _Graph) -> GroupFinding:
    """Members behind in completion (``_behind_in_completion``) are the cause, and the members with a collective
    pending here wait for them."""
    g.direct.update(behind)  # the cause wherever else they wait
    # The others' work past what the behind ranks completed cannot finish without them: whoever has a
    # collective pending here waits for them (a rank 13 blocked in its TP group behind rank 12's dead GPU is
    # not the end of the chain its pipeline peers' sends lead to).
    others = tuple(sorted(r for r in members if r not in behind and (v := views.get(r)) is not None
                          and any(not o.is_p2p for o in v.pending())))
    for r in others:
        g.waits[r] |= set(behind)
    g.blocked.update(others)
    base = {**base, "waiting": tuple(sorted(set(base["waiting"]) | set(others)))}
    done = max(v.last_completed for v in views.values() if v is not None)
    what = ", ".join(f"{format_ranks([r])} enqueued #{views[r].last_enqueued} but completed only "  # type: ignore[union-attr]
                     f"#{views[r].last_completed}" for r in behind)  # type: ignore[union-attr]
    return GroupFinding(kind="behind", culprits=behind, **base,
                        detail=f"{_where(base['name'], base['desc'])}: {what} while the others completed #{done} "
                               f"({'their devices' if len(behind) > 1 else 'its device'} stopped completing work: "
                               "a failed GPU, a stuck kernel)")


def _behind_in_completion(members: tuple[int, ...], views: Mapping[int, GroupView | None]) -> tuple[int, ...]:
    """Members (pg_status) that keep enqueueing collectives but fall behind the others in completing them: their GPU
    failed or a kernel never finished. (Members that stopped issuing work fall behind in *enqueueing* instead and
    have nothing pending: those are ``missing``.) Empty when the group has no status or nobody lags."""
    # A member whose status says it completed nothing yet (-1) is behind too when its peers completed what it
    # enqueued: the first collective of a job is where init-time hangs live.
    known = {r: v for r in members if (v := views.get(r)) is not None and (v.last_completed >= 0 or v.status_seen)}
    if len(known) < 2:
        return ()
    done = max(v.last_completed for v in known.values())
    if done < 0:
        return ()
    return tuple(sorted(r for r, v in known.items() if v.last_completed < done and v.last_enqueued > v.last_completed))


def _p2p_findings(name: str, desc: str, members: tuple[int, ...], views: Mapping[int, GroupView | None],
                  traces: Mapping[int, RankTrace], g: _Graph) -> list[GroupFinding]:
    """Unfinished sends/recvs whose partner posted fewer matching recvs/sends. Peers in dumps are local to the
    group: the sorted member list maps them to global ranks."""
    order = sorted(members)
    out: list[GroupFinding] = []

    def count(r: int, op: str, peer: int, upto: int | None = None) -> int:
        gv = views.get(r)
        return 0 if gv is None else sum(
            1 for x in gv.ops if x.op == op and x.peer is not None and x.peer < len(order) and order[x.peer] == peer
            and (upto is None or x.p2p_seq <= upto))

    for r, gv in sorted(views.items()):
        for o in gv.pending() if gv is not None else ():
            if o.peer is None or o.peer >= len(order) or o.op not in ("send", "recv"):
                continue
            peer = order[o.peer]
            want = "recv" if o.op == "send" else "send"
            if count(peer, want, r) >= count(r, o.op, peer, o.p2p_seq):
                continue
            waited = _waited(traces, {r: o})
            g.waits[r].add(peer)
            g.blocked.add(r)
            g.p2p_blame.add(r)
            out.append(GroupFinding(
                name=name, desc=desc, kind="p2p", op=o.op, sizes=[list(s) for s in o.sizes], dtypes=list(o.dtypes),
                seq=o.p2p_seq, members=members, waiting=(r,), missing=(peer,), waited_s=waited,
                detail=f"{_where(name, desc)}: {format_ranks([r])} {o.op} {'to' if o.op == 'send' else 'from'} rank "
                       f"{peer} (p2p #{o.p2p_seq}) has no matching {want} on rank {peer}"))
    return out


def _waits(ranks: Sequence[int]) -> str:
    return f"{format_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"


def _reach(start: int, waits: Mapping[int, set[int]], stop: set[int]) -> set[int]:
    seen: set[int] = set()
    todo = [start]
    while todo:
        r = todo.pop()
        if r in seen:
            continue
        seen.add(r)
        if r not in stop or r == start:
            todo.extend(waits.get(r, ()))
    return seen


def _roots(g: _Graph) -> set[int]:
    """Follow every waiter's chain to the ranks blocked on nobody (a mismatch deviant ends a chain too). A chain
    that only loops (a deadlock: a send posted where the partner runs a collective) names the ranks in the loop
    whose send/recv nobody matches, else every rank of the loop."""
    roots: set[int] = set()
    for start in sorted(g.waits):
        seen = _reach(start, g.waits, g.direct)
        ends = {r for r in seen if r in g.direct or (not g.waits.get(r) and r not in g.blocked)}
        if ends:
            roots |= ends
            continue
        loop = {r for r in seen if any(r in _reach(n, g.waits, g.direct) for n in g.waits.get(r, ()))}
        roots |= (loop & g.p2p_blame) or loop
    return roots


def analyze_traces(traces: Sequence[RankTrace], *, world_size: int | None = None,
                   min_wait_s: float = DEFAULT_MIN_WAIT_S) -> FrAnalysis:
    """Name the culprits of a hung job from its ranks' dumps (see the module docstring for the rules)."""
    by_rank = {t.rank: t for t in traces}
    world = set(range(world_size)) if world_size else set()
    world |= set(by_rank)
    g = _Graph()
    findings = _group_findings(traces, by_rank, world, g)
    # Structure first: a mismatch, and a member behind in completion (the others completed what it enqueued: its
    # device stopped), are hangs however young. The clock is asked only where the dumps tell it (told_dump_time)
    # and only of what a slow job also shows: every member inside the same collective (blocked), or a member not
    # there yet (missing, p2p) — where every wait is young, the job may just be slow (tests/data/fr/slow). Judged
    # over the whole job, not group by group: one chain of waits started by one slow rank spans several groups.
    # Where the dumps do not tell when they were taken, the structure alone decides.
    longest = max((f.waited_s for f in findings if f.kind in CLOCKED and f.waited_s is not None), default=None)
    young = longest is not None and longest < min_wait_s
    if young:
        findings = [f if f.kind not in CLOCKED else replace(
            f, kind="in_progress", culprits=(), detail=f"{f.detail} (waiting {longest:.1f} s at most, < "
                                                       f"{min_wait_s:g} s: still in progress)") for f in findings]
        g = _Graph(direct=g.direct)
    stuck = [f for f in findings if f.kind != "in_progress"]
    members_all = {r for f in findings for r in f.members}
    no_dump = tuple(sorted((members_all | world) - set(by_rank)))
    notes = _notes(findings, by_rank, no_dump)
    versions = tuple(sorted({t.version for t in traces}))
    if not stuck:
        return FrAnalysis((), _no_hang_reason(findings, traces), tuple(findings), tuple(sorted(by_rank)), no_dump,
                          versions, notes)
    culprits = tuple(sorted(_roots(g) | g.direct)) or (no_dump if not young else ())
    return FrAnalysis(culprits, _hang_reason(stuck, culprits, no_dump), tuple(findings), tuple(sorted(by_rank)),
                      no_dump, versions, notes)


def _group_findings(traces: Sequence[RankTrace], by_rank: Mapping[int, RankTrace], world: set[int],
                    g: _Graph) -> list[GroupFinding]:
    """Every group's unfinished collective and unmatched sends/recvs, each group's waits added to ``g``."""
    findings: list[GroupFinding] = []
    for name in sorted({n for t in traces for n in t.groups}, key=lambda n: (len(n), n)):
        members = _members(name, by_rank, world)
        if len(members) < 2:
            continue  # a single-rank group waits on nobody
        views = {r: by_rank[r].groups.get(name) for r in members if r in by_rank}
        desc = next((gv.desc for gv in views.values() if gv is not None and gv.desc), "")
        f = _collective_finding(name, desc, members, views, by_rank, g)
        findings += ([f] if f else []) + _p2p_findings(name, desc, members, views, by_rank, g)
    return findings


def _notes(findings: Sequence[GroupFinding], by_rank: Mapping[int, RankTrace],
           no_dump: tuple[int, ...]) -> tuple[str, ...]:
    """What limits the analysis: dumps without entries, ranks without a dump, waiters whose dumps tell no time."""
    notes: list[str] = []
    empty = sorted(r for r, t in by_rank.items() if t.entries == 0)
    if empty:
        notes.append(f"{format_ranks(empty)} recorded no entries (Flight Recorder off, or nothing run yet)")
    if no_dump:
        notes.append(f"{format_ranks(no_dump)} left no dump (suspect: exited, unreachable, or FR off)")
    untimed = sorted({r for f in findings for r in f.waiting if r in by_rank and by_rank[r].dumped_at is None})
    if untimed:
        whose = ("dumps", "do", "they were", "their files'") if len(untimed) > 1 else ("dump", "does", "it was",
                                                                                         "its file's")
        notes.append(f"the {whose[0]} of {format_ranks(untimed)} {whose[1]} not tell when {whose[2]} taken ({whose[3]} "
                     "mtime disagrees with the dump's own clock: copied or checked out): how long the ranks waited is "
                     "unknown; the structure of the dumps decides")
    return tuple(notes)


def _no_hang_reason(findings: Sequence[GroupFinding], traces: Sequence[RankTrace]) -> str:
    """The reason when nothing is stuck: the findings still in progress, or why there are none."""
    if findings:
        return "; ".join(f.detail for f in findings) + "; no hang in the Flight Recorder"
    if not traces:
        return "no Flight Recorder dumps"
    return "every process group finished its last collective; no hang in the Flight Recorder"


def _hang_reason(stuck: Sequence[GroupFinding], culprits: tuple[int, ...], no_dump: tuple[int, ...]) -> str:
    """The culprits, then every stuck group's finding, then the ranks its findings named that wait elsewhere."""
    parts = [f.detail for f in stuck]
    chained = sorted({r for f in stuck for r in f.culprits} - set(culprits))
    if chained:
        parts.append(f"{format_ranks(chained)} {'is' if len(chained) == 1 else 'are'} blocked elsewhere (not the "
                     "cause)")
    if culprits and set(culprits) <= set(no_dump):
        parts.append(f"{format_ranks(culprits)} left no dump")
    parts.insert(0, f"culprit {format_ranks(culprits)}" if culprits else "culprit unknown")
    return "; ".join(parts)
