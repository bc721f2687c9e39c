"""Name the culprit rank of a stalled job from its ranks' classified stacks (pure functions).

The idea (ByteRobust, RESEARCH §1): in a hung collective every healthy rank shows the same stack,
blocked in the same collective; the rank that caused it shows something else. So:
  1. group ranks by (state, op, where);
  2. the collective op that holds the most ranks is where the waiting majority sits;
  3. every other rank is a culprit: one in a different collective means the ranks are desynchronised
     (``desync``: they issued different sequences of collectives; a point-to-point send/recv against a
     collective is not one: that rank waits for its partner's bytes); one doing anything else (sleep, data
     wait, io, compute) never arrived;
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpu_watchdog.evidence.stacks.classify import (
    COMMUNICATION_STATES,
    P2P_FAMILIES,
    PASSABLE_FAMILIES,
    SOCKET_OP,
    WAIT_FAMILY,
    collective_family,
    is_ddp_op,
)
from gpu_watchdog.model import RankStack, StackEvidence, rank_known, rank_label

WAITING_STATES = ("collective",)
SYNC_STATES = ("device_sync",)  # waiting on the GPU, which may be waiting on a collective kernel


@dataclass(frozen=True)
class Diagnosis:
    culprit_ranks: tuple[int, ...]
    collective: str | None  # the op the waiting majority is blocked in
    reason: str  # one line for humans
    desync: bool  # some rank is in a different collective than the majority
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()  # "state:op@where" -> ranks, largest first


def format_ranks(ranks: Iterable[int]) -> str:
    """``rank 3`` / ``ranks 0,1,3`` / ``ranks 0-3`` (runs of three or more are compressed); a rank no source gave
    as ``rank unknown (pid N)`` (model.unknown_rank)."""
    every = set(ranks)
    unknown = [rank_label(r) for r in sorted(every, reverse=True) if not rank_known(r)]
    rs = sorted(r for r in every if rank_known(r))
    if unknown:
        return ", ".join(([format_ranks(rs)] if rs else []) + unknown)
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


def _in_family(in_coll: Mapping[int, str], fam: str | None) -> list[int]:
    """The ranks on one collective family's side, in order."""
    return sorted(r for r, f in in_coll.items() if f == fam)


def _ops(by_rank: Mapping[int, RankStack], ranks: Iterable[int]) -> str:
    """The ops the ranks sit in, for people: ``all_gather_into_tensor/_all_gather_base``."""
    return "/".join(sorted({by_rank[r].op or "?" for r in ranks}))


@dataclass(frozen=True)
class _Verdict:
    """Who waits where and who is at fault, before any wording (``_verdict``)."""

    by_rank: Mapping[int, RankStack]
    ordered: list[tuple[str, list[int]]]  # (group key, ranks), largest first
    groups: tuple[tuple[str, tuple[int, ...]], ...]
    missing: set[int]
    in_coll: dict[int, str]  # rank → collective family, for the ranks that take a side
    in_wait: list[int]  # ranks in a bare Work.wait()/wait_tensor(): they take no side
    names: dict[str, str]  # family → the ops seen
    syncing: list[int]  # ranks in a device sync
    ddp_aside: list[int]  # ranks in DDP's regular flow, past what the others are stuck in
    passed: str | None  # the collective those passed, where it can be told
    top: list[tuple[str, int]]  # families by how many ranks sit in them
    desync: bool
    tie: bool
    majority: str | None
    waiting: list[int]  # the ranks of the majority's collective
    waiters: bool  # is there a waiting group to compare the others against?

    @property
    def majority_op(self) -> str | None:
        return self.names[self.majority] if self.majority else None

    @property
    def split(self) -> bool:
        return len(self.top) >= 2

    @property
    def never_arrived(self) -> list[list[int]]:
        """The groups neither in a collective nor in a device sync, where there is a waiting group to compare them
        against."""
        if not self.waiters:
            return []
        return [members for _key, members in self.ordered
                if self.by_rank[members[0]].state not in WAITING_STATES + SYNC_STATES]

    @property
    def culprits(self) -> set[int]:
        """The missing ranks, the ones in an odd collective, and the ones that never arrived."""
        culprits: set[int] = set(self.missing)
        if not self.tie:  # every rank in another collective than the majority's
            culprits |= {r for r, fam in self.in_coll.items() if fam != self.majority}
        culprits |= {r for members in self.never_arrived for r in members}
        return culprits


def diagnose(
    ranks: Sequence[RankStack], world_size: int | None = None, missing_ranks: Iterable[int] = (),
    unseen: Iterable[int] = (),
) -> Diagnosis:
    """Diagnose one job from one stack dump of its ranks (see the module docstring for the rules). ``unseen``: ranks
    of the job on other nodes whose stacks are not at hand — said so, never culprits for that."""
    v = _verdict(ranks, world_size, missing_ranks)
    return Diagnosis(tuple(sorted(v.culprits)), v.majority_op, _wording(v, unseen), v.desync, v.groups)


def _verdict(ranks: Sequence[RankStack], world_size: int | None, missing_ranks: Iterable[int]) -> _Verdict:
    by_rank = {r.rank: r for r in ranks}
    missing = set(missing_ranks) - set(by_rank)
    if world_size is not None:
        missing |= set(range(world_size)) - set(by_rank)
    ordered, groups = _grouped(by_rank, missing)
    in_coll, in_wait = _sides(by_rank)
    names = {fam: _ops(by_rank, _in_family(in_coll, fam)) for fam in set(in_coll.values())}
    syncing = sorted(r for r, rs in by_rank.items() if rs.state in SYNC_STATES)
    # The ranks in DDP's regular flow leave the sides; they count on the side of a collective they can be told to
    # have passed.
    ddp_aside = _ddp_aside(by_rank, in_coll)
    in_coll = {r: fam for r, fam in in_coll.items() if r not in ddp_aside}
    names = {fam: n for fam, n in names.items() if fam in set(in_coll.values())}
    passed = _passed(in_coll) if ddp_aside else None
    counts = Counter(in_coll.values())
    if passed is not None:
        counts[passed] += len(ddp_aside)
    # Different collectives are a desync (the ranks issued different sequences); a rank in a point-to-point
    # send/recv while the others sit in a collective is waiting for its partner's bytes: a transport hang.
    desync = len([fam for fam in counts if fam not in P2P_FAMILIES]) >= 2
    top, tie = _settle_tie(counts.most_common())
    majority = top[0][0] if top and not tie else None
    return _Verdict(by_rank, ordered, groups, missing, in_coll, in_wait, names, syncing, ddp_aside, passed, top,
                    desync, tie, majority, waiting=_in_family(in_coll, majority),
                    waiters=bool(in_coll or syncing or ddp_aside))


def _grouped(by_rank: Mapping[int, RankStack], missing: set[int]) -> tuple[
        list[tuple[str, list[int]]], tuple[tuple[str, tuple[int, ...]], ...]]:
    """The ranks grouped by stack (``group_key``), largest group first; and the same for ``Diagnosis.groups``, with
    the missing ranks as a group of their own last."""
    grouped: dict[str, list[int]] = defaultdict(list)
    for r in sorted(by_rank):
        grouped[group_key(by_rank[r])].append(r)
    ordered = sorted(grouped.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    group_t = tuple((k, tuple(v)) for k, v in ordered)
    if missing:
        group_t += (("missing", tuple(sorted(missing))),)
    return ordered, group_t


def _sides(by_rank: Mapping[int, RankStack]) -> tuple[dict[int, str], list[int]]:
    """Rank → collective family for the ranks that take a side, and the ranks in a bare wait (taking none)."""
    # Ranks are compared by collective family (all_gather_single and _all_gather_base are one all_gather); a rank
    # in a bare Work.wait()/wait_tensor() could be waiting for any of them, so it waits without taking sides.
    in_coll = {r: collective_family(rs.op or "?") for r, rs in by_rank.items() if rs.state in WAITING_STATES}
    in_wait = sorted(r for r, fam in in_coll.items() if fam == WAIT_FAMILY)
    sides = {r: fam for r, fam in in_coll.items() if fam != WAIT_FAMILY} or {r: WAIT_FAMILY for r in in_wait}
    return sides, in_wait


def _ddp_aside(by_rank: Mapping[int, RankStack], in_coll: Mapping[int, str]) -> list[int]:
    """The ranks in DDP's regular flow that take no side (none where their group is the clear majority)."""
    # DDP's gradient all-reduce is issued by every rank every step: a rank there has passed whatever the others
    # are stuck in and waits in the regular flow. Unless its group is the clear majority it takes no side (like a
    # bare wait) and is never a culprit: a desync's culprit is the rank in the odd collective, not the one in
    # backward.
    top = Counter(in_coll.values()).most_common()
    in_ddp = sorted(r for r in in_coll if is_ddp_op(by_rank[r].op))
    if in_ddp and len(top) >= 2 and not (top[0][0] == in_coll[in_ddp[0]] and top[0][1] > top[1][1]):
        return in_ddp
    return []


def _passed(in_coll: Mapping[int, str]) -> str | None:
    """The collective the ranks in DDP's regular flow passed, where it can be told (they then count on its side)."""
    # The ranks past the point passed the collective the others sit in at that point — and could only have
    # passed one some members leave before all arrive: where one side is such a collective and another is not,
    # the ranks past it are on that side (3 ranks: 0 in broadcast, 2 past it, 1 in all_gather: 1 is the odd one).
    families = set(in_coll.values())
    passable = [fam for fam in families if fam in PASSABLE_FAMILIES]
    return passable[0] if len(passable) == 1 and len(families) >= 2 else None


def _settle_tie(top: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], bool]:
    """``top`` with a tie between one collective and point-to-point ops settled in the collective's favour, and
    whether a tie remains."""
    if len(top) < 2 or top[0][1] != top[1][1]:
        return top, False
    # One collective against point-to-point ops only: the collective is the common path and the ranks in
    # send/recv wait for their partners' bytes (a node that sees one rank in recv and its local peer in
    # all_reduce names the one in recv, whatever the unseen nodes hold).
    tied = [fam for fam, n in top if n == top[0][1]]
    colls = [fam for fam in tied if fam not in P2P_FAMILIES]
    if len(colls) != 1:
        return top, True
    return sorted(top, key=lambda kv: (-kv[1], kv[0] != colls[0])), False


def _wording(v: _Verdict, unseen: Iterable[int]) -> str:
    """The verdict in one line for people: the sides, the culprits and what each does, who waits where."""
    parts = _sides_wording(v) + [_doing(v.by_rank[members[0]], members) for members in v.never_arrived]
    if v.missing:
        m = sorted(v.missing)
        parts.append(f"{format_ranks(m)} {_verb(m)} missing (no stack: exited or not dumpable)")
    if parts:  # who waits where goes next to what went wrong; with nothing wrong, _all_wait says it
        parts += _who_waits(v)
    if not v.waiters:
        states = ", ".join(f"{format_ranks(m)} {v.by_rank[m[0]].state}" for _, m in v.ordered) or "no stacks"
        parts.append(f"no rank is in a collective ({states})" + ("" if v.culprits else "; culprit unknown"))
    elif not parts:
        parts.append(_all_wait(v))
    away = sorted(set(unseen) - set(v.by_rank) - v.missing)
    if away:
        parts.append(f"{format_ranks(away)} {_verb(away)} not seen (on other nodes whose stacks are not here)")
    return "; ".join(parts)


def _sides_wording(v: _Verdict) -> list[str]:
    """The collectives the ranks sit in where they differ: both sides of a tie, or each odd one against the
    majority's."""
    if v.tie:
        sides = ", ".join(f"{format_ranks(_in_family(v.in_coll, fam))} in {v.names[fam]}" for fam, _ in v.top)
        return [f"{'desync: ' if v.desync else ''}{sides} (equal groups: cannot tell which side "
                f"{'ran ahead' if v.desync else 'is behind'})"]
    parts = []
    for fam in sorted({f for f in v.in_coll.values() if f != v.majority}):
        members = format_ranks(_in_family(v.in_coll, fam))
        if fam in P2P_FAMILIES or v.majority in P2P_FAMILIES:
            parts.append(f"{members} in {v.names[fam]} while {_waits(v.waiting)} in {v.majority_op}")
        else:
            parts.append(f"desync: {members} in {v.names[fam]} while {_waits(v.waiting)} in "
                         f"{v.majority_op} ({members} ran ahead or fell behind)")
    return parts


def _doing(rs0: RankStack, members: Sequence[int]) -> str:
    """What a group of ranks that never arrived does instead (``rs0``: its first rank's stack)."""
    if rs0.state == "stopped":
        return f"{format_ranks(members)} {_verb(members)} stopped (SIGSTOP or job control: state T)"
    how = "busy" if rs0.active else "stuck"
    at = f" at {rs0.where}" if rs0.where else ""
    return f"{format_ranks(members)} {_verb(members)} {how} in {rs0.state}{at}"


def _who_waits(v: _Verdict) -> list[str]:
    """Where the ranks that take no blame wait: the majority's collective, a device sync, a bare wait(), DDP."""
    parts = []
    if v.waiting and not v.split:
        parts.append(f"{_waits(v.waiting)} in {v.majority_op}")
    if v.syncing:
        parts.append(f"{_waits(v.syncing)} in device_sync")
    if v.in_wait and v.majority != WAIT_FAMILY:
        parts.append(f"{_waits(v.in_wait)} in a collective's wait()")
    if v.ddp_aside:
        past = f"past the {v.names[v.passed]}, which lets some members go before all arrive" if v.passed else \
            "past what the others are stuck in"
        parts.append(f"{_waits(v.ddp_aside)} in {_ops(v.by_rank, v.ddp_aside)} (DDP's regular flow: {past})")
    return parts


def _all_wait(v: _Verdict) -> str:
    """Everybody waits in the same place: the culprit is not among these ranks."""
    everyone = sorted(v.by_rank)
    what = v.majority_op if not v.syncing else (f"{v.majority_op} or device_sync" if v.waiting else "device_sync")
    who = f"all {len(everyone)} ranks wait" if len(everyone) > 1 else _waits(everyone)
    return (f"{who} in {what}; culprit unknown, possibly on another "
            "node (merge the nodes' stacks with `gpu-watchdog analyze`)")


@dataclass(frozen=True)
class RankContext:
    """What the samples say about one rank between two dumps (the detector supplies it)."""

    device: str | None = None  # its GPU's signature: "spin" | "idle_held" | "busy"; None: no GPU (proc backend)
    host_busy: bool = False  # its process tree used CPU or did I/O since the earlier dump
    stepped: bool = False  # its in-job client reported a new step since the earlier dump
    wrote: bool = False  # its process tree read or wrote at the progress rate since the earlier dump


# A thread blocked for good shows no wakeups between one dump's end and the next one's start; a loop that sleeps
# or polls at one line, or a reader whose bytes trickle in, shows one per iteration: waking at all is moving.
# (A paused attach's own wakeup is counted into the dump's ``wakeups_after`` by evidence.stacks.)
WOKE_BETWEEN_DUMPS = 1


def woke_between(a: RankStack, b: RankStack) -> bool:
    """Did the rank's main thread block and wake again between dump ``a`` and the later dump ``b``?"""
    if a.wakeups_after is None or b.wakeups_before is None or a.pid != b.pid:
        return False
    return b.wakeups_before - a.wakeups_after >= WOKE_BETWEEN_DUMPS


def moved_bytes(a: RankStack, b: RankStack) -> bool:
    """Did the rank's main thread read or write a byte between dump ``a`` and the later dump ``b``?"""
    if a.io_after is None or b.io_before is None or a.pid != b.pid:
        return False
    return b.io_before > a.io_after


def rank_moved(a: RankStack, b: RankStack, ctx: RankContext = RankContext()) -> bool:
    """Did one rank make progress from dump ``a`` to dump ``b``? Equal stacks alone are not proof of a stall.

    - a new signature or pid, or a new step from its in-job client: it moved;
    - io (a write, a flush, a file-system wait), or bytes its tree read or wrote meanwhile: slow is not stuck: it
      is being waited on, however slowly its bytes move (an NFS flush can sit a minute in one write() with
      nothing counted; a checkpoint written in chunks sits in a short sleep between them at every dump);
    - a socket read or write with a timeout (its peer is outside the job: it ends by itself), unless its GPU
      spins; without a timeout it is a data wait like any other (alive while its bytes come, i.e. it wakes);
    - unless its GPU spins (the host then only waits on the device, and NCCL's proxy thread polls): a data wait
      whose producer (dataloader workers, a reader thread: the rest of its tree) used CPU or I/O or whose main
      thread read or wrote a byte (a slow reader; never its wakeups alone: a consumer polling a dead producer
      wakes on its timeouts), compute that
      py-spy saw on CPU, a main thread that woke at all (a loop that sleeps or polls at one line, a slow reader),
      or one blocked in a wait with a timeout (a sleep, a poll: it wakes by itself; a poll every 10 s need not
      wake between two dumps 3 s apart).
    """
    if a.pid != b.pid or a.signature != b.signature or ctx.stepped:
        return True
    if b.state == "io" or (ctx.wrote and b.state != "stopped"):
        return True
    if ctx.device == "spin" or b.state == "stopped":
        return False  # a spinning GPU's host counters are the busy-wait and NCCL's proxy thread polling
    if b.state == "data_wait":
        if b.op == SOCKET_OP and (a.timed or b.timed):
            return True  # a socket read or write with a timeout, its peer outside the job: it ends by itself
        # A consumer is judged by its data: its producer (workers, a reader thread) worked, its own bytes moved, or
        # it woke from a read without a timeout (a socket or pipe read returns only when bytes came). Not by the
        # wakeups of a wait with a timeout: a DataLoader polls its queue every 5 s while its worker is wedged.
        return ctx.host_busy or moved_bytes(a, b) or (woke_between(a, b) and not (a.timed or b.timed))
    if b.timed and b.state not in COMMUNICATION_STATES:
        return True
    return woke_between(a, b) or moved_bytes(a, b) or (b.state == "compute" and (a.active or b.active))


def stacks_progressed(a: StackEvidence, b: StackEvidence,
                      context: Mapping[int, RankContext] | None = None) -> dict[int, bool]:
    """Per rank present in both dumps: did it make progress from ``a`` to ``b`` (``rank_moved``)? Ranks present
    in only one dump are left out: there is nothing to compare."""
    before = {r.rank: r for r in a.ranks}
    ctx = context or {}
    return {r.rank: rank_moved(before[r.rank], r, ctx.get(r.rank, RankContext()))
            for r in b.ranks if r.rank in before}


def collective_waited_in(waiting_on: Sequence[int], evidence: Sequence[StackEvidence]) -> str | None:
    """The collective the ranks not in ``waiting_on`` sit in at the latest dump (the most common one), None when
    none of them is in communication."""
    if not evidence:
        return None
    ops = [r.op or r.state for r in evidence[-1].ranks
           if r.rank not in waiting_on and r.state in COMMUNICATION_STATES]
    return max(sorted(set(ops)), key=ops.count) if ops else None


def communication_evidence(diag: Diagnosis, ranks: Sequence[RankStack]) -> str:
    """What in the stacks says the hang is in communication, in one line ("" when nothing does): ranks that wait
    in the framework's communication path (a c10d collective or p2p op, DDP's reducer, FSDP/DTensor/functional
    collectives, a device sync behind a collective) while the culprits do something else, or all of them there
    (a transport hang; the culprit may be on another node)."""
    waiting = sorted(r.rank for r in ranks if r.state in COMMUNICATION_STATES and r.rank not in diag.culprit_ranks)
    culprits_in = [r for r in ranks if r.state in COMMUNICATION_STATES and r.rank in diag.culprit_ranks]
    if not waiting and not culprits_in:
        return ""
    def by_op(rs: Sequence[RankStack]) -> list[tuple[str, list[int]]]:
        ops: dict[str, list[int]] = defaultdict(list)
        for r in rs:
            ops[r.op or r.state].append(r.rank)
        return sorted(ops.items(), key=lambda kv: (-len(kv[1]), kv[0]))

    waiters = by_op([r for r in ranks if r.rank in waiting])
    parts = [f"{_waits(rs) if i == 0 else format_ranks(rs)} in {op}" for i, (op, rs) in enumerate(waiters)]
    parts += [f"{format_ranks(rs)} in {op}" for op, rs in by_op(culprits_in)]
    return "stacks: " + ", ".join(parts)
