"""Name the culprit rank of a stalled job from its ranks' classified stacks (pure functions).

The idea (ByteRobust, RESEARCH §1): in a hung collective every healthy rank shows the same stack,
blocked in the same collective; the rank that caused it shows something else. So:
  1. group ranks by (state, op, where);
  2. the collective op that holds the most ranks is where the waiting majority sits;
  3. every other rank is a culprit: one in a different collective means the ranks are desynchronised
     (``desync``); one doing anything else (sleep, data wait, io, compute) never arrived;
  4. ranks with no stack at all (exited, undumpable: ``missing_ranks``, or absent from
     ``range(world_size)``) are culprits too;
  5. if everybody waits in the same collective, the culprit is not among these ranks — likely on
     another node (``gpu-watchdog analyze`` merges the nodes' stacks).
Ranks in ``device_sync`` count as waiting, never as culprits: NCCL collectives are asynchronous, so
a healthy rank of a hung NCCL job usually blocks in ``.item()`` / ``cuda.synchronize()`` behind the
stuck collective kernel rather than in the c10d call. When no rank is in a collective, the
device_sync ranks are the waiting group (``collective`` is then None).
Ties between two different collectives name no culprit (either rank may be the one behind), but the
diagnosis still says ``desync``; Flight Recorder sequence ids can break that tie.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .model import RankStack, StackEvidence

WAITING_STATES = ("collective",)
SYNC_STATES = ("device_sync",)  # waiting on the GPU, which may be waiting on a collective kernel
PROGRESS_STATES = ("compute", "io")


@dataclass(frozen=True)
class Diagnosis:
    culprit_ranks: tuple[int, ...]
    collective: str | None  # the op the waiting majority is blocked in
    reason: str  # one line for humans
    desync: bool  # some rank is in a different collective than the majority
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()  # "state:op@where" -> ranks, largest first


def format_ranks(ranks: Iterable[int]) -> str:
    """``rank 3`` / ``ranks 0,1,3`` / ``ranks 0-3`` (runs of three or more are compressed)."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    return "ranks " + ",".join(parts)


def group_key(rs: RankStack) -> str:
    """The grouping key: ``collective:all_reduce@all_reduce (…distributed_c10d.py:3252)``."""
    head = f"{rs.state}:{rs.op}" if rs.op else rs.state
    return f"{head}@{rs.where}" if rs.where else head


def _verb(ranks: Sequence[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def _waits(ranks: Sequence[int]) -> str:
    return f"{format_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"


def diagnose(
    ranks: Sequence[RankStack], world_size: int | None = None, missing_ranks: Iterable[int] = ()
) -> Diagnosis:
    """Diagnose one job from one stack dump of its ranks (see the module docstring for the rules)."""
    by_rank = {r.rank: r for r in ranks}
    missing = set(missing_ranks) - set(by_rank)
    if world_size is not None:
        missing |= set(range(world_size)) - set(by_rank)
    groups: dict[str, list[int]] = defaultdict(list)
    for r in sorted(by_rank):
        groups[group_key(by_rank[r])].append(r)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    group_t = tuple((k, tuple(v)) for k, v in ordered)
    if missing:
        group_t += (("missing", tuple(sorted(missing))),)

    in_coll = {r: (rs.op or "?") for r, rs in by_rank.items() if rs.state in WAITING_STATES}
    syncing = sorted(r for r, rs in by_rank.items() if rs.state in SYNC_STATES)
    top = Counter(in_coll.values()).most_common()
    desync = len(top) >= 2
    tie = desync and top[0][1] == top[1][1]
    majority_op = top[0][0] if top and not tie else None
    waiting = sorted(r for r, op in in_coll.items() if op == majority_op)
    waiters = bool(in_coll or syncing)  # is there a waiting group to compare the others against?

    culprits: set[int] = set(missing)
    parts: list[str] = []
    if tie:
        sides = ", ".join(f"{format_ranks([r for r, o in in_coll.items() if o == op])} in {op}" for op, _ in top)
        parts.append(f"desync: {sides} (equal groups: cannot tell which side is behind)")
    else:
        for op in sorted({o for o in in_coll.values() if o != majority_op}):
            members = sorted(r for r, o in in_coll.items() if o == op)
            culprits |= set(members)
            parts.append(f"{format_ranks(members)} in {op} while {_waits(waiting)} in {majority_op}")
    if waiters:  # every rank neither in a collective nor in a device sync never arrived
        for _key, members in ordered:
            rs0 = by_rank[members[0]]
            if rs0.state in WAITING_STATES or rs0.state in SYNC_STATES:
                continue
            culprits |= set(members)
            how = "busy" if rs0.active else "stuck"
            at = f" at {rs0.where}" if rs0.where else ""
            parts.append(f"{format_ranks(members)} {_verb(members)} {how} in {rs0.state}{at}")
    if missing:
        m = sorted(missing)
        parts.append(f"{format_ranks(m)} {_verb(m)} missing (no stack: exited or not dumpable)")
    if parts and waiting and not desync:
        parts.append(f"{_waits(waiting)} in {majority_op}")
    if parts and syncing:
        parts.append(f"{_waits(syncing)} in device_sync")

    if not waiters:
        states = ", ".join(f"{format_ranks(m)} {by_rank[m[0]].state}" for _, m in ordered) or "no stacks"
        parts.append(f"no rank is in a collective ({states})" + ("" if culprits else "; culprit unknown"))
    elif not parts:
        everyone = sorted(by_rank)
        what = majority_op if not syncing else (f"{majority_op} or device_sync" if waiting else "device_sync")
        who = f"all {len(everyone)} ranks wait" if len(everyone) > 1 else _waits(everyone)
        parts.append(f"{who} in {what}; culprit unknown, possibly on another "
                     "node (merge the nodes' stacks with `gpu-watchdog analyze`)")
    return Diagnosis(tuple(sorted(culprits)), majority_op, "; ".join(parts), desync, group_t)


def stacks_progressed(a: StackEvidence, b: StackEvidence) -> dict[int, bool]:
    """Per rank present in both dumps: did it make progress from ``a`` to ``b``?

    True when the signature changed, the pid changed (restarted), or the rank sits in compute/io and
    py-spy saw it on CPU in either dump (a long save or evaluation keeps one signature). Ranks present
    in only one dump are left out: there is nothing to compare."""
    before = {r.rank: r for r in a.ranks}
    out: dict[int, bool] = {}
    for r in b.ranks:
        prev = before.get(r.rank)
        if prev is None:
            continue
        if prev.pid != r.pid or prev.signature != r.signature:
            out[r.rank] = True
        else:
            out[r.rank] = r.state in PROGRESS_STATES and (r.active or prev.active)
    return out
