"""The process group each waiting rank waits in, and whom it waits for (pure functions).

A big-model job runs many groups (a 2-D ``DeviceMesh`` of tensor × data parallel, pipeline stages, expert groups):
"rank 0 in all_gather while ranks 1-3 wait in all_reduce" lumps a rank's TP peer with the DP ranks and never says
the desync sits inside TP group {0, 1}. Two sources tell the group:

* the **Flight Recorder** (every pending collective per group: name, description, members, who waits and who never
  came; ``flight_recorder.analysis.GroupFinding``), exact where the job records one;
* the **ranks' own frames** (``stacks.frame_groups``): the ``group`` a c10d call was made with, named through the
  in-job client's report of its groups (its address), a point-to-point partner.

A ``WaitingGroup`` is one group × the collective some of its members wait in: the group's ranks, name and
description (``group_desc``: ``mesh_tp`` for a mesh dimension), the ranks waiting, and the members they wait for.
Nothing here names a culprit: who waits where is what the operator reads beside the verdict.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.evidence.flight_recorder.analysis import FrAnalysis
from gpu_watchdog.evidence.stacks.classify import P2P_FAMILIES, WAIT_FAMILY, collective_family
from gpu_watchdog.evidence.stacks.diagnosis import format_ranks
from gpu_watchdog.evidence.stacks.frame_groups import FrameGroup

FLIGHT_RECORDER = "flight_recorder"
FRAMES = "frames"
SOURCE_TITLES = {FLIGHT_RECORDER: "the Flight Recorder", FRAMES: "the ranks' frames"}


@dataclass(frozen=True)
class WaitingGroup:
    ranks: tuple[int, ...]  # the group's members, global ranks; () when not known
    name: str | None  # the group's name (torch's, the same on every rank); None when not known
    desc: str  # its description (group_desc, "mesh_<dim>" for a DeviceMesh dimension); "" when it has none
    collective: str | None  # what ``waiting`` sit in
    waiting: tuple[int, ...]  # the ranks that wait in it
    waits_on: tuple[int, ...]  # the members (or the partner) they wait for; () when not known
    source: str  # FLIGHT_RECORDER | FRAMES

    def as_json(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "name": self.name, "desc": self.desc, "collective": self.collective,
                "waiting": list(self.waiting), "waits_on": list(self.waits_on), "source": self.source}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WaitingGroup:
        def ints(v: Any) -> tuple[int, ...]:
            return tuple(r for r in v or () if isinstance(r, int) and not isinstance(r, bool))

        return cls(ints(d.get("ranks")), d.get("name"), str(d.get("desc") or ""), d.get("collective"),
                   ints(d.get("waiting")), ints(d.get("waits_on")), str(d.get("source") or ""))

    def line(self) -> str:
        """``rank 2 waits in all_reduce of group 3 mesh_dp (ranks 0,2) for rank 0``."""
        verb = "waits" if len(self.waiting) == 1 else "wait"
        on = f" for {format_ranks(self.waits_on)}" if self.waits_on else ""
        of = f" of {self.title()}" if self.ranks or self.name or self.desc else ""  # a partner alone: no group
        return f"{format_ranks(self.waiting)} {verb} in {self.collective or '?'}{of}{on}"

    def title(self) -> str:
        """``group 3 mesh_tp (ranks 0,1)``, ``group 0 default_pg (ranks 0-3)``."""
        head = " ".join(p for p in ("group", self.name, self.desc) if p)
        return f"{head} ({format_ranks(self.ranks)})" if self.ranks else head


def from_flight_recorder(analysis: FrAnalysis) -> list[WaitingGroup]:
    """One WaitingGroup per process group the Flight Recorder finds stuck (its ``in_progress`` findings wait on
    nobody yet): its waiting members, waiting on those that never came (missing, the p2p partner), or on those
    behind or in a mismatching op (a mismatch's deviants are not counted among the waiting)."""
    out = []
    for f in analysis.groups:
        if f.kind == "in_progress" or not f.waiting:
            continue
        on = set(f.missing if f.kind in ("missing", "p2p") else f.culprits)
        waiting = tuple(r for r in f.waiting if r not in on)  # a mismatch's deviants wait too, in another op
        if waiting:
            out.append(WaitingGroup(tuple(f.members), f.name, f.desc, f.op, waiting, tuple(sorted(on)),
                                    FLIGHT_RECORDER))
    return out


def _client_group(report: Sequence[Mapping[str, Any]], fg: FrameGroup) -> Mapping[str, Any] | None:
    """The client-reported group a frame's group is (by its address)."""
    return next((g for g in report if fg.address is not None and g.get("address") == fg.address), None)


def _members(g: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(sorted(r for r in g.get("ranks") or () if isinstance(r, int) and not isinstance(r, bool)))


def from_frames(frames: Mapping[int, FrameGroup], clients: Mapping[int, Sequence[Mapping[str, Any]]],
                elsewhere: Collection[int] = ()) -> list[WaitingGroup]:
    """The groups the ranks' frames show (``stacks.frame_groups``), named through each rank's client report
    (``clients``: rank → its groups) where there is one; ranks of one group in one collective family form one
    WaitingGroup, waiting on the members known not to be in it: those whose frames show another call, and
    ``elsewhere`` (ranks whose stacks are in no communication op, or that have none). A member seen nowhere (another
    node's rank, one whose frames were not read) may be waiting too: it is not named. A point-to-point op waits on
    its partner."""
    keyed: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    facts: dict[tuple[Any, ...], tuple[tuple[int, ...], str | None, str, str | None, int | None]] = {}
    for rank, fg in sorted(frames.items()):
        g = _client_group(clients.get(rank, ()), fg)
        if g is not None:
            ranks, name, desc = _members(g), str(g.get("name")), str(g.get("desc") or "")
        else:
            ranks, name, desc = (), None, ""
        family = collective_family(fg.op or "?")
        peer = fg.peer if fg.peer is not None else (
            ranks[fg.group_peer] if fg.group_peer is not None and 0 <= fg.group_peer < len(ranks) else None)
        if not (ranks or name or desc) and peer is None:
            continue  # an address no client report names says nothing (every rank's differs)
        key = (ranks, name, desc, family, peer)
        keyed[key].append(rank)
        facts[key] = (ranks, name, desc, fg.op, peer)
    out = []
    for key, waiting in keyed.items():
        ranks, name, desc, op, peer = facts[key]
        family = collective_family(op or "?")
        if peer is not None:
            on: tuple[int, ...] = (peer,)
        elif family in P2P_FAMILIES or family == WAIT_FAMILY or not ranks:
            on = ()  # whom a bare wait() or a p2p op without a partner in its frames waits for is not told
        else:
            on = tuple(r for r in ranks if r not in waiting and (r in frames or r in elsewhere))
        out.append(WaitingGroup(ranks, name, desc, op, tuple(waiting), on, FRAMES))
    return sorted(out, key=lambda w: w.waiting)


def desyncs(groups: Iterable[WaitingGroup]) -> list[str]:
    """Each group whose members wait in different collectives, in words: ``desync inside group 2 mesh_tp (ranks
    0,1): rank 0 in all_gather_single, rank 1 in all_reduce``."""
    by_group: dict[tuple[Any, ...], list[WaitingGroup]] = defaultdict(list)
    for w in groups:
        if w.ranks or w.name:
            by_group[(w.ranks, w.name, w.desc)].append(w)
    return [f"desync inside {ws[0].title()}: " + ", ".join(f"{format_ranks(w.waiting)} in {w.collective}" for w in ws)
            for ws in by_group.values()
            if len({collective_family(w.collective or "?") for w in ws} - P2P_FAMILIES - {WAIT_FAMILY}) >= 2]


def describe(groups: Sequence[WaitingGroup]) -> str:
    """Who waits in which group, for people ("" when nothing is known): each entry, then each desync inside a
    group."""
    if not groups:
        return ""
    return "; ".join(["in their groups: " + "; ".join(w.line() for w in groups), *desyncs(groups)])
