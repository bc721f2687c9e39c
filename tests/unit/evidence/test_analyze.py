"""gpu_watchdog.evidence.analyze: two nodes' incident directories (ranks 0-3 and 4-7) merged into one diagnosis.
Threads have py-spy's JSON shape (copied from real dumps); the real-job path is in test_diagnosis."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.evidence.analyze import analyze_dirs, load_records, main_analyze, write_rank_stacks
from gpu_watchdog.evidence.stacks.dump import DumpResult

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _frame(name: str, filename: str, short: str, line: int) -> dict[str, Any]:
    return {"name": name, "filename": filename, "module": None, "short_filename": short, "line": line,
            "locals": None, "is_entry": False, "is_shim_entry": False}


def _threads(pid: int, state: str) -> tuple[dict[str, Any], ...]:
    inner = {
        "all_reduce": [_frame("all_reduce", C10D, "torch/distributed/distributed_c10d.py", 3252)],
        "queue": [_frame("Condition.wait", "/usr/lib/python3.11/threading.py", "threading.py", 327),
                  _frame("Queue.get", "/usr/lib/python3.11/queue.py", "queue.py", 171)],
    }[state]
    main = {"pid": pid, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": pid, "active": False,
            "owns_gil": False, "process_info": None,
            "frames": inner + [_frame("main", "/job/train.py", "train.py", 107),
                               _frame("<module>", "/job/train.py", "train.py", 115)]}
    producer = {"pid": pid, "thread_id": 2, "thread_name": "producer", "os_thread_id": pid + 50, "active": False,
                "owns_gil": False, "process_info": None,
                "frames": [_frame("Queue.put", "/usr/lib/python3.11/queue.py", "queue.py", 140)]}
    return (producer, main)


def _write(d: Path, rank: int, state: str = "all_reduce", outcome: str = "ok", world_size: int | None = 8,
           host: str = "node") -> None:
    pid = 4000 + rank
    res = DumpResult(pid, outcome, "x", _threads(pid, state) if outcome == "ok" else (), "", 0.03)
    write_rank_stacks(d, rank, host, res, world_size=world_size, job_id="job-1")


@pytest.fixture
def two_nodes(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "node-a" / "incident-1", tmp_path / "node-b" / "incident-7"
    for r in range(4):
        _write(a, r, host="node-a")
    for r in range(4, 8):
        _write(b, r, "queue" if r == 6 else "all_reduce", host="node-b")
    return a, b


def test_file_format(two_nodes: tuple[Path, Path]) -> None:
    a, _ = two_nodes
    files = sorted(p.name for p in (a / "stacks").iterdir())
    assert files == ["rank-0.json", "rank-1.json", "rank-2.json", "rank-3.json"]  # no temp files left
    doc = json.loads((a / "stacks" / "rank-2.json").read_text())
    assert {"version", "rank", "pid", "host", "outcome", "detail", "elapsed_s", "t", "world_size", "job_id",
            "threads", "raw"} == set(doc)
    assert (doc["rank"], doc["pid"], doc["host"], doc["outcome"], doc["world_size"]) == (2, 4002, "node-a", "ok", 8)
    assert doc["threads"][1]["thread_name"] == "MainThread"


def test_merge_two_nodes_finds_the_culprit_on_the_other_node(two_nodes: tuple[Path, Path]) -> None:
    a, b = two_nodes
    alone = analyze_dirs([a])  # node a alone: everybody waits, ranks 4-7 missing
    assert alone.culprit_ranks == (4, 5, 6, 7)
    d = analyze_dirs([a, b])
    assert d.culprit_ranks == (6,) and d.collective == "all_reduce" and not d.desync
    assert d.reason == ("rank 6 is stuck in data_wait at Queue.get (queue.py:171); "
                        "ranks 0-5,7 wait in all_reduce")
    assert analyze_dirs([a / "stacks", b]).culprit_ranks == (6,)  # the stacks dir itself works too


def test_unknown_world_size_means_culprit_unknown(tmp_path: Path) -> None:
    for r in range(4):
        _write(tmp_path / "a", r, world_size=None)
    d = analyze_dirs([tmp_path / "a"])
    assert d.culprit_ranks == () and "another node" in d.reason


def test_failed_dumps_and_absent_ranks_are_missing(two_nodes: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = two_nodes
    (b / "stacks" / "rank-7.json").unlink()
    _write(b, 5, outcome="exited")
    d = analyze_dirs([a, b])
    assert d.culprit_ranks == (5, 6, 7)
    assert "ranks 5,7 are missing" in d.reason
    # A successful dump of rank 5 elsewhere beats the failed one, whatever the order.
    c = tmp_path / "node-c"
    _write(c, 5)
    assert analyze_dirs([c, a, b]).culprit_ranks == (6, 7)
    assert analyze_dirs([a, b, c]).culprit_ranks == (6, 7)
    assert [r.rank for r in load_records([a, b, c])] == [0, 1, 2, 3, 4, 5, 6]


def test_main_analyze_outputs(two_nodes: tuple[Path, Path]) -> None:
    a, b = two_nodes
    out = io.StringIO()
    assert main_analyze([str(a), str(b)], as_json=False, out=out) == 0
    text = out.getvalue()
    assert text.startswith("culprit: rank 6\ncollective: all_reduce\nreason: rank 6 is stuck in data_wait")
    assert "     6  node-b  pid 4006  data_wait  Queue.get (queue.py:171)" in text
    out = io.StringIO()
    assert main_analyze([str(a), str(b)], as_json=True, out=out) == 0
    doc = json.loads(out.getvalue())
    assert doc["culprit_ranks"] == [6] and doc["collective"] == "all_reduce" and doc["desync"] is False
    assert doc["groups"][0]["ranks"] == [0, 1, 2, 3, 4, 5, 7]
    assert doc["ranks"][6] == {"rank": 6, "host": "node-b", "pid": 4006, "outcome": "ok", "state": "data_wait",
                               "op": None, "where": "Queue.get (queue.py:171)", "active": False}


def test_main_analyze_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_analyze([str(tmp_path / "nope")], as_json=False, out=io.StringIO()) == 66
    assert "nope: no such directory" in capsys.readouterr().err
    (tmp_path / "empty" / "stacks").mkdir(parents=True)
    assert main_analyze([str(tmp_path / "empty")], as_json=False, out=io.StringIO()) == 66
    bad = tmp_path / "bad" / "stacks"
    bad.mkdir(parents=True)
    (bad / "rank-0.json").write_text("{not json")
    assert main_analyze([str(tmp_path / "bad")], as_json=False, out=io.StringIO()) == 65
    assert "rank-0.json: not valid JSON" in capsys.readouterr().err
    (bad / "rank-0.json").write_text(json.dumps({"rank": "0", "pid": 1, "outcome": "ok", "threads": []}))
    assert main_analyze([str(tmp_path / "bad")], as_json=False, out=io.StringIO()) == 65
    assert "field 'rank' missing or not int" in capsys.readouterr().err
