"""Where a job's deadline comes from: real Flight Recorder dumps (the H200's NCCL hang, a 4-rank gloo job), the
in-job client's group report, the backend's default, and "unknown" when nothing tells."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_watchdog.evidence.deadline import sources
from gpu_watchdog.evidence.flight_recorder.analysis import rank_trace
from gpu_watchdog.evidence.flight_recorder.dumps import load_dump

DATA = Path(__file__).resolve().parents[2] / "data"


def _traces(directory: Path, pattern: str, dumped_at: dict[str, float] | None = None) -> list:
    out = []
    for f in sorted(directory.glob(pattern)):
        rank = int(f.name.rsplit("_", 1)[1])
        out.append(rank_trace(load_dump(f), rank, (dumped_at or {}).get(f.name)))
    return out


def test_the_h200_nccl_hang_dumps_say_30_s_from_the_pending_all_reduce() -> None:
    traces = _traces(DATA / "real-gpu" / "nccl-hang" / "flight-recorder", "nccl_trace_rank_*")
    d = sources.from_flight_recorder(traces)
    assert d is not None and d.source == "flight_recorder" and d.timeout_s == 30.0
    assert d.collective == "all_reduce" and "timeout_ms 30000" in d.detail
    assert d.started_at is not None and abs(d.started_at - 1795670372.741) < 1.0  # the pending entry's enqueue


def test_a_gloo_dump_says_the_groups_timeout() -> None:
    case = json.loads((DATA / "fr" / "chain" / "case.json").read_text())
    traces = _traces(DATA / "fr" / "chain", "trace_*", case["dumped_at"])
    d = sources.from_flight_recorder(traces)
    assert d is not None and d.timeout_s == 1800.0 and d.collective == "all_reduce"
    # dumps taken before the wait began are an earlier wait's: they tell nothing about this one
    assert sources.from_flight_recorder(traces, since=max(case["dumped_at"].values()) + 1) is None


def test_dumps_with_nothing_pending_tell_no_deadline() -> None:
    case = json.loads((DATA / "fr" / "healthy" / "case.json").read_text())
    traces = _traces(DATA / "fr" / "healthy", "trace_*", case["dumped_at"])
    assert sources.from_flight_recorder(traces) is None


def test_the_client_report_gives_the_longest_group_timeout() -> None:
    one = sources.from_client({0: {"groups": [{"name": "0", "desc": "default_pg", "timeout_s": 900.0}]},
                               1: {"groups": [{"name": "0", "desc": "default_pg", "timeout_s": 900.0}]}})
    assert one is not None and one.timeout_s == 900.0 and one.source == "client"
    assert "every process group's timeout" in one.detail and "15 min" in one.detail
    two = sources.from_client({0: {"groups": [{"name": "0", "desc": "default_pg", "timeout_s": 900.0},
                                              {"name": "1", "desc": "tp", "timeout_s": 120.0},
                                              {"name": "2", "desc": "x", "timeout_s": None}]}})
    assert two is not None and two.timeout_s == 900.0 and "default_pg 15 min, tp 2 min" in two.detail
    assert sources.from_client({}) is None
    assert sources.from_client({0: {"groups": [{"name": "0", "timeout_s": "soon"}]}}) is None


def test_backend_defaults_are_pytorchs() -> None:
    gloo, nccl = sources.backend_default("gloo"), sources.backend_default("nccl")
    assert gloo is not None and gloo.timeout_s == 1800.0 and gloo.source == "default"
    assert nccl is not None and nccl.timeout_s == 600.0 and "init_process_group(timeout=)" in nccl.detail
    assert sources.backend_default(None) is None and sources.backend_default("mpi") is None


def test_no_source_says_unknown_and_what_was_tried() -> None:
    d = sources.first_known(None, None, None, tried=["no Flight Recorder dump", "no in-job client"])
    assert not d.known and d.source == "unknown" and d.timeout_s is None
    assert d.detail == "unknown: no Flight Recorder dump; no in-job client"
    assert d.due_at(100.0) is None
    fr_first = sources.first_known(sources.backend_default("gloo"), sources.backend_default("nccl"))
    assert fr_first.timeout_s == 1800.0  # the first known wins, in the order given
