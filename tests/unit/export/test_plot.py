"""``incidents show ID --plot``: the figure has a panel per measure, a line per rank and a mark per event, the PNG
is a real picture, and without matplotlib the command says how to get it in one line."""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.cli.main import main
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.replay import replay_trace
from gpu_watchdog.errors import EXIT_NOINPUT, EXIT_UNAVAILABLE, EXIT_USAGE
from gpu_watchdog.export.plot import build_figure, plot_incident, timeline
from gpu_watchdog.store.incidents import IncidentStore
from repo_paths import REPO

pytest.importorskip("matplotlib")
DATA = REPO / "tests" / "data"


def _incident(state: Path, corpus: str) -> tuple[dict[str, Any], Path]:
    """A real incident of the corpus trace's stall, its trace in place, with a few actions after confirmation."""
    (finding,) = [f for f in replay_trace(DATA / corpus, DetectConfig()) if f.kind == "stall"]
    inc = IncidentStore(state).create(finding, "corpus-node", now=finding.confirmed_at)
    shutil.copy(DATA / corpus, inc.dir / "trace.jsonl")
    for i, action in enumerate(("dump_stacks", "checkpoint", "stop", "restart")):
        entry = inc.begin_action(action)
        entry["at"] = finding.confirmed_at + 1.0 + 4.0 * i
        inc.end_action(entry, action != "checkpoint", "")
    inc.update(culprit_ranks=[1], trace="trace.jsonl")
    return inc.summary, inc.dir


def _labels(fig: Any) -> str:
    return " | ".join(t.get_text() for ax in fig.axes for t in ax.texts)


def test_the_figure_has_a_panel_per_measure_a_line_per_rank_and_every_mark(tmp_path: Path) -> None:
    summary, d = _incident(tmp_path, "proc-hang.trace")
    tl = timeline(summary, d / "trace.jsonl", DetectConfig())
    assert sorted(tl.ranks) == [0, 1, 2, 3]
    assert [label for _, label in tl.marks] == ["onset", "confirmed", "dump_stacks", "checkpoint (failed)", "stop",
                                                "restart"]
    assert tl.marks[0][0] == 0.0 and tl.marks[1][0] == pytest.approx(summary["detected_at"] - summary["onset"])
    # the detector's verdict per rank: progress before the onset, none after it, up to confirmation
    # (ranks blocked in all_reduce stop one by one; the onset is the last tick any rank made progress)
    for rs in tl.ranks.values():
        assert 2 in [s for t, s in zip(rs.t, rs.state, strict=True) if t < 0]
        assert {s for t, s in zip(rs.t, rs.state, strict=True) if t > 2} == {1}
    assert any(s == 2 for rs in tl.ranks.values() for t, s in zip(rs.t, rs.state, strict=True) if -3 < t <= 0)
    assert [what for _s, _e, what in tl.job_spans] == ["suspect", "stalled"]

    fig = build_figure(tl)
    util, mem, power, io, wakeups, state = fig.axes
    assert "CPU %" in util.get_ylabel() and "RSS" in mem.get_ylabel() and "state" in state.get_ylabel()
    # what the detector weighs besides CPU: a lane each, a line per rank, numbers from the trace's counters
    assert "I/O" in io.get_ylabel() and "wakeups" in wakeups.get_ylabel()
    for ax in (io, wakeups):
        assert len([ln for ln in ax.lines if ln.get_label().startswith("rank")]) == 4
    io_rates = [v for rs in tl.ranks.values() for v in rs.io_kib_s if v is not None]
    assert io_rates and all(v >= 0 for v in io_rates)  # (this corpus trace predates the wakeup counter)
    ranks_drawn = [ln.get_label() for ln in util.lines if ln.get_label().startswith("rank")]
    assert ranks_drawn == ["rank 0", "rank 1 (culprit)", "rank 2", "rank 3"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ranks_drawn
    assert max(ln.get_linewidth() for ln in util.lines if "culprit" in ln.get_label()) > 2
    vlines = [ln for ln in util.lines if not ln.get_label().startswith("rank")]
    assert len(vlines) == len(tl.marks)  # one per onset, confirmation, action
    labels = _labels(fig)
    for word in ("onset", "confirmed", "dump_stacks", "checkpoint (failed)", "stop", "restart",
                 "no power reading (proc backend"):
        assert word in labels, labels
    assert summary["id"] in fig.texts[0].get_text() or summary["id"] in fig.get_suptitle()


def test_an_nvml_incident_draws_power_and_gpu_utilization(tmp_path: Path) -> None:
    summary, d = _incident(tmp_path, "nvml-spin.trace")
    fig = build_figure(timeline(summary, d / "trace.jsonl", DetectConfig()))
    util, _mem, power, _io, _wakeups, _state = fig.axes
    assert util.get_ylabel().startswith("GPU utilization")
    drawn = [ln for ln in power.lines if ln.get_label().startswith("rank")]
    assert drawn and all(any(y == y for y in ln.get_ydata()) for ln in drawn)  # real numbers, not all NaN
    assert "no power reading" not in _labels(fig)


def _png_size(path: Path) -> tuple[int, int]:
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", raw[16:24])


def test_plot_writes_an_svg(tmp_path: Path) -> None:
    summary, d = _incident(tmp_path / "state", "proc-hang.trace")
    svg = plot_incident(summary, d, tmp_path / "inc.svg", DetectConfig())
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()[:2000]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plot_names_the_picture_and_rejects_bad_input_in_one_line(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    summary, d = _incident(state, "proc-hang.trace")
    show = ["incidents", "show", summary["id"], "--state-dir", str(state)]
    code, out, err = _cli(capsys, *show, "--plot", str(tmp_path / "x.png"))
    assert code == 0, err
    assert out.rstrip().endswith(f"picture: {tmp_path / 'x.png'}")
    w, h = _png_size(tmp_path / "x.png")  # a real PNG, of a size a person can read
    assert 800 <= w <= 2000 and 600 <= h <= 1600 and (tmp_path / "x.png").stat().st_size > 20_000
    for argv, want, words in (
        ([*show, "--plot", str(tmp_path / "x.jpg")], EXIT_USAGE, "must end in .png or .svg"),
        ([*show, "--plot", str(tmp_path / "no" / "x.png")], EXIT_USAGE, "cannot write"),
        (["incidents", "list", "--state-dir", str(state), "--plot", str(tmp_path / "z.png")], EXIT_USAGE,
         "--plot draws one incident"),
    ):
        code, _out, err = _cli(capsys, *argv)
        assert code == want and words in err and len(err.strip().splitlines()) == 1, err
    (d / "trace.jsonl").unlink()
    code, _out, err = _cli(capsys, *show, "--plot", str(tmp_path / "y.png"))
    assert code == EXIT_NOINPUT and "has no trace.jsonl" in err, err
    assert not (tmp_path / "y.png").exists()


def test_without_matplotlib_one_line_says_how_to_get_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    summary, _d = _incident(state, "proc-hang.trace")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if the [plot] extra were not installed
    code, _out, err = _cli(capsys, "incidents", "show", summary["id"], "--state-dir", str(state),
                           "--plot", str(tmp_path / "x.png"))
    assert code == EXIT_UNAVAILABLE, err
    assert len(err.strip().splitlines()) == 1 and "pip install 'gpu-watchdog[plot]'" in err
    assert not (tmp_path / "x.png").exists()


def test_a_skipped_checkpoint_is_marked_skipped_and_the_title_stays_clear_of_the_legend(tmp_path: Path) -> None:
    summary, d = _incident(tmp_path, "proc-hang.trace")
    ckpt = next(a for a in summary["actions"] if a["action"] == "checkpoint")
    ckpt.update(ok=False, outcome="skipped", detail="skipped: the job did not opt in")
    fig = build_figure(timeline(summary, d / "trace.jsonl", DetectConfig()))
    labels = _labels(fig)
    assert "checkpoint (skipped)" in labels and "(failed)" not in labels, labels
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    for dpi in (70, 110):  # 110: what --plot writes; at 70 the title ran under a legend beside the panels
        fig.set_dpi(dpi)
        canvas.draw()
        renderer = canvas.get_renderer()
        title = fig._suptitle.get_window_extent(renderer)  # type: ignore[union-attr]
        assert not title.overlaps(fig.legends[0].get_window_extent(renderer)), dpi
