"""Incident directories: what one holds survives someone deleting it mid-incident (a clean-up script, an admin's
``rm -rf``), because the summary lives in memory and every save writes it whole again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gpu_watchdog.model import Finding
from gpu_watchdog.store.incidents import IncidentStore


def _finding() -> Finding:
    return Finding("stall", "idle_held", "job-1", (0, 1), (1,), 100.0, 130.0, ("GPU-0",), "rank 1 stopped", "stack")


def test_an_incident_directory_deleted_mid_incident_is_written_again_whole(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "state")
    inc = store.create(_finding(), "node-1")
    entry = inc.begin_action("dump_stacks")
    shutil.rmtree(inc.dir)  # deleted while the incident is under way
    inc.end_action(entry, True, "2/2 ranks dumped")
    inc.record_action("stop", True, "SIGTERM to 3 processes")
    inc.write_report("culprit: rank 1\n")
    on_disk = json.loads((inc.dir / "summary.json").read_text())
    assert on_disk == inc.summary  # nothing recorded before the deletion is lost
    assert [(a["action"], a["ok"]) for a in on_disk["actions"]] == [("dump_stacks", True), ("stop", True)]
    assert (inc.dir / "report.txt").read_text() == "culprit: rank 1\n"
    assert inc.stacks_dir.is_dir()
    assert [s["id"] for s in store.list()] == [inc.id]


def test_the_whole_incidents_root_deleted_is_recreated(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "state")
    first = store.create(_finding(), "node-1")
    shutil.rmtree(store.root)
    first.update(outcome="restarted")
    second = store.create(_finding(), "node-1")
    assert {s["id"] for s in store.list()} == {first.id, second.id} and first.id != second.id
