"""The readable incident report: the verdict and the culprit first, then the ranks grouped by stack."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpu_watchdog.evidence.culprit import SOURCE_TITLES
from gpu_watchdog.evidence.diagnosis import format_ranks, group_key
from gpu_watchdog.model import RankStack


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def render_report(summary: dict[str, Any], stacks: Sequence[RankStack]) -> str:
    s = summary
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
    groups: dict[str, list[RankStack]] = {}
    for rs in stacks:
        groups.setdefault(group_key(rs), []).append(rs)
    culprits = set(s.get("culprit_ranks") or [])
    ordered = sorted(groups.values(), key=lambda g: (not (culprits & {r.rank for r in g}), -len(g)))
    if ordered:
        lines += ["", "stacks (main thread, innermost first), grouped:"]
    for g in ordered:
        ranks = [r.rank for r in g]
        tag = "  <- culprit" if culprits & set(ranks) else ""
        lines.append(f"  {format_ranks(ranks)}: {g[0].state}{':' + g[0].op if g[0].op else ''}{tag}")
        for frame in g[0].signature.split(" <- "):
            lines.append(f"      {frame}")
    fr_groups = (s.get("flight_recorder") or {}).get("process_groups") or []
    if fr_groups:
        lines += ["", "flight recorder, process groups with an unfinished collective:"]
        lines += [f"  {g.get('kind')}: {g.get('detail')}" for g in fr_groups]
    if s.get("actions"):
        lines += ["", "actions:"]
        for a in s["actions"]:
            ok = {True: "ok", False: "FAILED", None: "in progress"}[a.get("ok")]
            lines.append(f"  {_when(a.get('at'))} {a['action']}: {ok} — {a.get('detail', '')}")
    return "\n".join(lines) + "\n"
