"""The detector over the labelled corpus in tests/data/ (made by tests/data/make_corpus.py).

Every labelled hang is found, of the labelled kind, with its onset within one sampling interval of the true
onset; healthy runs and legitimate pauses (checkpoint save, evaluation) produce no finding at all — with the
default configuration and with the one the live end-to-end test uses.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.replay import replay_trace
from gpu_watchdog.model import Finding, NodeSample
from gpu_watchdog.sample.trace import read_trace
from repo_paths import REPO, TESTS

DATA = TESTS / "data"
DOC = REPO / "docs" / "detection-latency.md"
MANIFEST = json.loads((DATA / "corpus.json").read_text())
TRACES = MANIFEST["traces"]
CONFIGS = {"default": DetectConfig(), "test": dataclasses.replace(DetectConfig(), **MANIFEST["test_config"])}


def _ids(entry: dict[str, Any]) -> str:
    return entry["name"]


def test_the_corpus_covers_every_case() -> None:
    names = {e["name"] for e in TRACES}
    assert {"proc-healthy", "proc-hang", "proc-save", "nvml-idle-held", "nvml-spin", "nvml-save", "nvml-eval",
            "nvml-rank-died", "nvml-gpu-lost",
            # NCCL ranks whose hosts busy-wait, with and without the live agent's stack dumps, and the healthy
            # runs that look closest to them
            "nvml-spin-busy", "nvml-spin-busy-stacks", "nvml-host-stuck", "nvml-host-stuck-stacks",
            "nvml-comm-bound", "nvml-save-90s", "nvml-slow-input"} <= names
    kinds = {(x["kind"], x["signature"]) for e in TRACES for x in e["expected"]}
    assert {("stall", "idle_held"), ("stall", "spin"), ("stall", "rank_exited"), ("gpu_fault", "gpu_lost")} <= kinds
    assert any(e["source"] == "recorded" and e["expected"] for e in TRACES)
    assert any(e["source"] == "recorded" and not e["expected"] and e["pause_start"] for e in TRACES)


@pytest.mark.parametrize("entry", TRACES, ids=_ids)
def test_trace_file_is_small_plain_and_labelled(entry: dict[str, Any]) -> None:
    path = DATA / entry["file"]
    assert path.stat().st_size < 5_000 * 120  # ~5 KB per 8-GPU sample; the longest trace is 120 s
    head, records = read_trace(path)
    assert head["backend"] == entry["backend"] and head["interval_s"] == entry["interval_s"]
    recs = list(records)
    samples = [r for r in recs if isinstance(r, NodeSample)]
    events = [r for r in recs if isinstance(r, dict)]
    assert len(samples) >= 20
    if entry["true_onset"] is not None:  # the label agrees with the event recorded in the trace
        assert entry["true_onset"] in [e["t"] for e in events]
        assert samples[0].t < entry["true_onset"] < samples[-1].t
    if entry["pause_start"] is not None:
        assert entry["pause_start"] in [e["t"] for e in events if e["name"] == "pause_start"]
    if entry["source"] == "hand-made":
        assert {len(s.devices) for s in samples} == {8}


def _check(entry: dict[str, Any], findings: list[Finding], cfg: DetectConfig) -> None:
    expected = entry["expected"]
    assert [(f.kind, f.signature) for f in findings] == [(x["kind"], x["signature"]) for x in expected], \
        [f.to_json() for f in findings]
    for f, x in zip(findings, expected, strict=True):
        if "culprit_ranks" in x:
            assert list(f.culprit_ranks) == x["culprit_ranks"]
        if "devices" in x:
            assert list(f.devices) == x["devices"]
        if f.kind == "stall":
            assert f.job_id == entry["job"]
            assert abs(f.onset - entry["true_onset"]) <= entry["interval_s"], (f.onset, entry["true_onset"])
            # confirmed no later than confirm_after_s (+ one tick) after the onset
            assert f.confirmed_at - f.onset <= cfg.confirm_after_s + entry["interval_s"]
            # ... and within the acceptance bounds: 10 s after the true onset when the trace carries the live
            # agent's stack dumps, 35 s without (time only)
            assert f.confirmed_at - entry["true_onset"] <= (10.0 if x.get("stacks") else 35.0)
            assert f.basis == ("stacks" if x.get("stacks") else "time")
        else:  # a fault is reported on the first sample that shows it
            assert 0 <= f.confirmed_at - entry["true_onset"] <= entry["interval_s"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("entry", TRACES, ids=_ids)
def test_replay_matches_the_label(entry: dict[str, Any], config: str) -> None:
    cfg = CONFIGS[config]
    _check(entry, replay_trace(DATA / entry["file"], cfg), cfg)


def test_legit_pauses_last_longer_than_the_test_confirmation() -> None:
    """The pauses are long enough that a detector mistaking them for hangs would have fired."""
    for e in TRACES:
        if e["pause_start"] is None:
            continue
        end = [r["t"] for r in read_trace(DATA / e["file"])[1] if isinstance(r, dict) and r["name"] == "pause_end"]
        assert end and end[0] - e["pause_start"] > CONFIGS["test"].confirm_after_s + 10, e["name"]


def _doc_rows() -> list[list[str]]:
    """The rows of the corpus table (the one headed ``| trace |``; the page's other tables are not the corpus's)."""
    rows, inside = [], False
    for line in DOC.read_text().splitlines():
        if re.match(r"\|\s*trace\s*\|", line):
            inside = True
        elif not line.startswith("|"):
            inside = False
        elif inside and not re.match(r"\|\s*-+\s*\|", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_latency_doc_lists_every_trace_of_the_manifest() -> None:
    rows = _doc_rows()
    assert [r[0] for r in rows] == [e["name"] for e in TRACES]
    for row, e in zip(rows, TRACES, strict=True):
        found = row[2]
        want = ", ".join(f"{x['kind']} {x['signature']}" for x in e["expected"]) or "none"
        assert found == want, row
