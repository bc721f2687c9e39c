"""The readable incident report: the verdict and the culprit first, then the ranks grouped by stack."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpu_watchdog.evidence.culprit import SOURCE_TITLES
from gpu_watchdog.evidence.stacks.diagnosis import format_ranks, group_key
from gpu_watchdog.evidence.waiting_groups import SOURCE_TITLES as GROUP_SOURCES
from gpu_watchdog.evidence.waiting_groups import WaitingGroup, desyncs
from gpu_watchdog.model import RankStack


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def action_status(action: dict[str, Any]) -> str:
    """How an incident action ended, in words: ok, FAILED, in progress, or its ``outcome`` when it neither ran nor
    failed (``skipped``: e.g. a checkpoint the job did not opt in to; ``not available``: e.g. Flight Recorder
    dumps a gloo job cannot be asked for)."""
    outcome = action.get("outcome")
    if outcome in ("skipped", "not_available"):
        return outcome.replace("_", " ")
    return {True: "ok", False: "FAILED", None: "in progress"}.get(action.get("ok"), "?")


def render_report(summary: dict[str, Any], stacks: Sequence[RankStack]) -> str:
    lines = (_verdict_lines(summary) + _waiting_group_lines(summary) + _stack_lines(summary, stacks)
             + _flight_recorder_lines(summary) + _action_lines(summary))
    return "\n".join(lines) + "\n"


def _verdict_lines(s: dict[str, Any]) -> list[str]:
    """The incident, its culprit and why, when it began and was caught, and what else the summary tells."""
    lines = [
        f"incident {s['id']} — {s['kind']} ({s.get('signature')}) in job {s.get('job_id')} on {s.get('host')}",
        "",
        f"culprit: {format_ranks(s['culprit_ranks']) if s.get('culprit_ranks') else 'unknown'}",
        f"reason:  {s.get('reason')}",
        f"collective the others wait in: {s.get('collective') or '-'}",
        f"onset {_when(s.get('onset'))}, detected {_when(s.get('detected_at'))} "
        f"(+{(s.get('detected_at') or 0) - (s.get('onset') or 0):.1f}s, evidence: {s.get('evidence')})",
    ]
    if s.get("culprit_evidence") and s["culprit_evidence"] != "stacks":
        lines.append(f"culprit named by: {SOURCE_TITLES.get(s['culprit_evidence'], s['culprit_evidence'])}")
    for line in s.get("evidence_disagreements") or ():
        lines.append(f"evidence disagrees: {line}")
    if s.get("advice"):
        lines.append(f"advice:  {s['advice']}")
    if s.get("fallback"):
        fb = s["fallback"]
        env = " ".join(f"{k}={v}" for k, v in sorted(fb.get("env", {}).items())) or "(no NCCL change)"
        lines.append(f"restart at fallback level {fb.get('level')} ({fb.get('name')}): {env}")
    if s.get("trace"):
        where = str(Path(s["stacks_dir"]).parent) if s.get("stacks_dir") else "INCIDENT_DIR"
        lines.append(f"trace:   {s['trace']}, the samples before confirmation (gpu-watchdog replay {where}; "
                     f"picture: gpu-watchdog incidents show {s['id']} --plot {s['id']}.png)")
    return lines


def _waiting_group_lines(s: dict[str, Any]) -> list[str]:
    """Who waits in which process group (``waiting_groups``: the Flight Recorder's, else the ranks' frames')."""
    groups = [WaitingGroup.from_json(g) for g in s.get("waiting_groups") or () if isinstance(g, dict)]
    if not groups:
        return []
    source = GROUP_SOURCES.get(groups[0].source, groups[0].source)
    return ["", f"process groups the ranks wait in (from {source}):"] + [f"  {w.line()}" for w in groups] + \
        [f"  {line}" for line in desyncs(groups)]


def _stack_lines(s: dict[str, Any], stacks: Sequence[RankStack]) -> list[str]:
    """The ranks grouped by stack, the culprits' groups first, each group's frames once."""
    groups: dict[str, list[RankStack]] = {}
    for rs in stacks:
        groups.setdefault(group_key(rs), []).append(rs)
    culprits = set(s.get("culprit_ranks") or [])
    ordered = sorted(groups.values(), key=lambda g: (not (culprits & {r.rank for r in g}), -len(g)))
    lines = ["", "stacks (main thread, innermost first), grouped:"] if ordered else []
    for g in ordered:
        ranks = [r.rank for r in g]
        tag = "  <- culprit" if culprits & set(ranks) else ""
        lines.append(f"  {format_ranks(ranks)}: {g[0].state}{':' + g[0].op if g[0].op else ''}{tag}")
        for frame in g[0].signature.split(" <- "):
            lines.append(f"      {frame}")
    return lines


def _flight_recorder_lines(s: dict[str, Any]) -> list[str]:
    fr_groups = (s.get("flight_recorder") or {}).get("process_groups") or []
    if not fr_groups:
        return []
    return (["", "flight recorder, process groups with an unfinished collective:"]
            + [f"  {g.get('kind')}: {g.get('detail')}" for g in fr_groups])


def _action_lines(s: dict[str, Any]) -> list[str]:
    if not s.get("actions"):
        return []
    return ["", "actions:"] + [f"  {_when(a.get('at'))} {a['action']}: {action_status(a)} — {a.get('detail', '')}"
                               for a in s["actions"]]
