"""``incidents show ID --plot F.png|.svg``: the incident's trace drawn for a person on call.

One panel per measure, one line per rank, time in seconds from the stall's onset: device utilization (the
rank's CPU % on the proc backend), memory, power, the rank's I/O rate and its main thread's wakeups (what the
detector weighs as progress besides CPU: why it judged "no progress"), and the rank's state as the detector
judged it tick by tick, with each stack dump's class for the rank
(replayed over the trace with the agent's ``[detect]`` settings: making progress, no progress, stopped), with
the job's suspect/stalled time shaded and a mark for the onset, the confirmation and every action the agent
took. The data comes from the incident's ``trace.jsonl``; matplotlib is an optional extra (``[plot]``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_watchdog.atomic import write_atomic
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.detector import DetectorState, step
from gpu_watchdog.detect.states import STALLED, SUSPECT
from gpu_watchdog.errors import MissingExtra, UsageError
from gpu_watchdog.model import NodeSample, StackEvidence
from gpu_watchdog.sample.trace import DIR_TRACE, TraceNotFound, read_trace

FORMATS = (".png", ".svg")
GIB = float(1 << 30)
# The state panel's rows, bottom to top.
PROGRESS, NO_PROGRESS, STOPPED = 2, 1, 0
STATE_LABELS = {PROGRESS: "progress", NO_PROGRESS: "no progress", STOPPED: "stopped / gone"}


@dataclass
class RankSeries:
    t: list[float] = field(default_factory=list)
    util: list[float | None] = field(default_factory=list)
    mem_gib: list[float | None] = field(default_factory=list)
    power_w: list[float | None] = field(default_factory=list)
    state: list[int] = field(default_factory=list)
    io_kib_s: list[float | None] = field(default_factory=list)  # the rank's tree's bytes read + written, KiB/s
    wakeups_s: list[float | None] = field(default_factory=list)  # its main thread's wakeups per second
    stack_marks: list[tuple[float, str]] = field(default_factory=list)  # (t, "collective:all_reduce")


@dataclass
class IncidentTimeline:
    """What the figure shows, in plain numbers (times relative to the onset): testable without matplotlib."""

    summary: dict[str, Any]
    backend: str
    ranks: dict[int, RankSeries]
    job_spans: list[tuple[float, float, str]]  # (start, end, "suspect" | "stalled")
    marks: list[tuple[float, str]]  # (t, label): onset, confirmed, each action


def _rank_of_pids(sample: NodeSample, job_id: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in sample.processes:
        if p.job and p.job.job_id == job_id and p.job.rank is not None and (p.is_rank or p.pid not in out):
            out[p.pid] = p.job.rank
    return out


def timeline(summary: dict[str, Any], trace: Path, cfg: DetectConfig) -> IncidentTimeline:
    """Read the trace, replay the detector over it for the ranks' state, and line everything up on the onset."""
    head, records = read_trace(trace)
    job_id = str(summary.get("job_id") or "")
    t0 = float(summary.get("onset") or summary.get("detected_at") or 0.0)
    ranks: dict[int, RankSeries] = {}
    spans: list[tuple[float, float, str]] = []
    state, pending = DetectorState(), []
    last: dict[int, tuple[float, int | None, int | None]] = {}  # pid → (t, io bytes, wakeups) of the last sample
    for rec in records:
        if isinstance(rec, StackEvidence):
            pending.append(rec)
            if rec.job_id == job_id:
                for rs in rec.ranks:
                    what = f"{rs.state}:{rs.op}" if rs.op else rs.state
                    ranks.setdefault(rs.rank, RankSeries()).stack_marks.append((rec.t - t0, what))
            continue
        if not isinstance(rec, NodeSample):
            continue
        state, _findings = step(state, rec, cfg, pending)
        pending = []
        rel = rec.t - t0
        pid_rank = _rank_of_pids(rec, job_id)
        rates = _rank_rates(rec, job_id, last)
        seen: set[int] = set()
        for d in rec.devices:
            owners = {pid_rank[p] for p in d.pids if p in pid_rank}
            for rank in owners:
                s = ranks.setdefault(rank, RankSeries())
                if rank in seen:  # a rank on several GPUs: the first one stands for it
                    continue
                seen.add(rank)
                s.t.append(rel)
                s.util.append(d.util_percent)
                s.mem_gib.append(None if d.mem_used_bytes is None else d.mem_used_bytes / GIB)
                s.power_w.append(d.power_w)
                s.io_kib_s.append(rates.get(rank, (None, None))[0])
                s.wakeups_s.append(rates.get(rank, (None, None))[1])
                obs = state.ranks.get((job_id, rank))
                s.state.append(STOPPED if obs is None or obs.stopped else PROGRESS if obs.progressing
                               else NO_PROGRESS)
        js = state.jobs.get(job_id)
        job_state = js.state if js is not None and js.state in (SUSPECT, STALLED) else ""
        if spans and spans[-1][2] == job_state and job_state:
            spans[-1] = (spans[-1][0], rel, job_state)
        elif job_state:
            spans.append((rel, rel, job_state))
    marks = [(0.0, "onset")]
    if isinstance(summary.get("detected_at"), (int, float)):
        marks.append((summary["detected_at"] - t0, "confirmed"))
    for a in summary.get("actions") or []:
        if isinstance(a.get("at"), (int, float)):
            marks.append((a["at"] - t0, f"{a.get('action')}{_outcome_suffix(a)}"))
    return IncidentTimeline(summary, str(head.get("backend") or ""), dict(sorted(ranks.items())), spans, marks)


def _rank_rates(sample: NodeSample, job_id: str, last: dict[int, tuple[float, int | None, int | None]]
                ) -> dict[int, tuple[float | None, float | None]]:
    """rank → (I/O KiB/s, main-thread wakeups/s) since the previous sample of the same process: what the detector
    weighed as progress besides CPU. ``last`` is updated."""
    out: dict[int, tuple[float | None, float | None]] = {}
    for p in sample.processes:
        if not (p.is_rank and p.job and p.job.job_id == job_id and p.job.rank is not None):
            continue
        prev = last.get(p.pid)
        last[p.pid] = (sample.t, p.io_bytes, p.wakeups)
        if prev is None or sample.t <= prev[0]:
            continue
        dt = sample.t - prev[0]
        io = None if p.io_bytes is None or prev[1] is None else max(0, p.io_bytes - prev[1]) / dt / 1024
        wake = None if p.wakeups is None or prev[2] is None else max(0, p.wakeups - prev[2]) / dt
        out[p.job.rank] = (io, wake)
    return out


def _outcome_suffix(action: dict[str, Any]) -> str:
    """What an action's mark adds to its name: nothing when it went well, else its outcome (a skipped checkpoint is
    not a failed one); older incidents without ``outcome`` by ``ok``."""
    outcome = action.get("outcome")
    if action.get("ok") is None:
        return " (unfinished)"
    if outcome in ("skipped", "not_available", "failed"):
        return f" ({outcome.replace('_', ' ')})"
    return "" if outcome == "ok" or action.get("ok") else " (failed)"


def _mark_labels(marks: list[tuple[float, str]], near: float) -> list[tuple[float, str]]:
    """Labels of marks closer than ``near`` joined, so they do not print over each other."""
    out: list[tuple[float, str]] = []
    for t, label in sorted(marks):
        if out and t - out[-1][0] < near:
            out[-1] = (out[-1][0], f"{out[-1][1]} · {label}")
        else:
            out.append((t, label))
    return out


def build_figure(tl: IncidentTimeline) -> Any:
    """The matplotlib Figure (not saved): four panels sharing the time axis."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtra("--plot needs matplotlib: pip install 'gpu-watchdog[plot]'") from None
    s = tl.summary
    proc = tl.backend == "proc"
    has_power = any(y is not None for rs in tl.ranks.values() for y in rs.power_w)
    fig = Figure(figsize=(12, 12), layout="constrained")
    axes = fig.subplots(6, 1, sharex=True, height_ratios=(3, 2, 2 if has_power else 0.6, 1.5, 1.5, 2))
    culprits = set(s.get("culprit_ranks") or [])
    titles = ("CPU % of the rank's process tree" if proc else "GPU utilization %",
              "memory (RSS), GiB" if proc else "GPU memory used, GiB", "power, W", "I/O, KiB/s (read+write)",
              "main-thread wakeups/s", "rank state (detector)")
    colors = {r: f"C{i % 10}" for i, r in enumerate(tl.ranks)}
    for rank, rs in tl.ranks.items():
        style = {"color": colors[rank], "linewidth": 2.6 if rank in culprits else 1.3,
                 "label": f"rank {rank}{' (culprit)' if rank in culprits else ''}"}
        for ax, ys in zip(axes[:5], (rs.util, rs.mem_gib, rs.power_w, rs.io_kib_s, rs.wakeups_s), strict=True):
            ax.plot(rs.t, [float("nan") if y is None else y for y in ys], drawstyle="steps-post", **style)
        # states offset a little per rank so overlapping ranks stay visible
        off = (list(tl.ranks).index(rank) - (len(tl.ranks) - 1) / 2) * 0.08
        axes[5].plot(rs.t, [v + off for v in rs.state], drawstyle="steps-post", **style)
        for t, what in rs.stack_marks:  # each dump's verdict for the rank: a point and its class
            axes[5].plot([t], [STOPPED + 0.35 + off], "v", color=colors[rank], markersize=5)
            axes[5].annotate(what, (t, STOPPED + 0.35 + off), fontsize=6, color=colors[rank], rotation=30,
                             xytext=(3, 2), textcoords="offset points")
    last_stacks = [f"rank {r}: {rs.stack_marks[-1][1]}" for r, rs in tl.ranks.items() if rs.stack_marks]
    if last_stacks:
        axes[5].text(0.005, 0.04, "▼ stack dumps; last: " + ", ".join(last_stacks), transform=axes[5].transAxes,
                     fontsize=8, va="bottom", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    for ax, title in zip(axes, titles, strict=True):
        ax.set_ylabel(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        for start, end, what in tl.job_spans:
            ax.axvspan(start, max(end, start + 0.5), color="gold" if what == SUSPECT else "tomato", alpha=0.18,
                       linewidth=0)
    axes[0].set_ylim(-3, 112)
    if not has_power:
        axes[2].text(0.5, 0.5, "no power reading" + (" (proc backend: no GPU)" if proc else ""),
                     transform=axes[2].transAxes, ha="center", va="center", color="gray")
        axes[2].set_yticks([])
    axes[5].set_yticks(list(STATE_LABELS), list(STATE_LABELS.values()))
    axes[5].set_ylim(-0.6, 2.6)
    axes[5].set_xlabel("seconds from the stall's onset")
    for t, label in tl.marks:
        color = {"onset": "darkorange", "confirmed": "red"}.get(label, "dimgray")
        for ax in axes:
            ax.axvline(t, color=color, linestyle="--" if label in ("onset", "confirmed") else ":", linewidth=1.4)
    lo, hi = axes[0].get_xlim()
    for t, text in _mark_labels(tl.marks, (hi - lo) / 40):  # marks a moment apart share one label
        axes[0].annotate(text, (t, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                         fontsize=8, color="black", xytext=(-2, -2), textcoords="offset points",
                         bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1})
    confirmed = dict((label, t) for t, label in tl.marks).get("confirmed")
    last = max((rs.t[-1] for rs in tl.ranks.values() if rs.t), default=None)
    if last is not None and confirmed is not None and abs(last - confirmed) < 2.0:  # what an incident's trace holds
        axes[1].annotate("trace ends at confirmation", (last, 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                         color="gray", ha="left", xytext=(3, 0), textcoords="offset points")
    if tl.ranks:  # below the panels: inside, it hides lines at 100 % or at 0; beside, the title ran under it
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=min(len(tl.ranks), 8),
                   fontsize=8)
    culprit = ",".join(map(str, sorted(culprits))) or "unknown"
    fig.suptitle(f"incident {s.get('id')}: {s.get('kind')} ({s.get('signature')}) in job {s.get('job_id')} on "
                 f"{s.get('host')}, culprit rank {culprit}\nshaded: job suspect (yellow) / stalled (red)",
                 fontsize=11)
    return fig


def plot_incident(summary: dict[str, Any], incident_dir: Path, out: str | Path, cfg: DetectConfig) -> Path:
    """Draw the incident to ``out`` (.png or .svg); returns the path written."""
    path = Path(out)
    if path.suffix.lower() not in FORMATS:
        raise UsageError(f"--plot: {out} must end in {' or '.join(FORMATS)}")
    trace = incident_dir / DIR_TRACE
    if not trace.is_file():
        raise TraceNotFound(f"incident {summary.get('id')} has no {DIR_TRACE} to draw (agent.incident_trace_s "
                            "was 0, or an older gpu-watchdog wrote it)")
    fig = build_figure(timeline(summary, trace, cfg))
    buf = io.BytesIO()  # drawn in memory, then written whole: a failed write leaves no half picture
    fig.savefig(buf, format=path.suffix.lower()[1:], dpi=110)
    try:
        write_atomic(path, buf.getvalue())
    except OSError as e:
        raise UsageError(f"--plot: cannot write {path}: {e.strerror}") from None
    return path
