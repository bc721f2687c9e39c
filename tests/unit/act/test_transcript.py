"""A recovery's transcript: each event reaches every subscriber once, in order — the incident record (summary,
journal, report), the console and the metrics each take their own kind — and a step is on record before it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gpu_watchdog.act.events import ActionDone
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.act.transcript import ActionBegun, Said, Transcript
from gpu_watchdog.config.schema import Config
from gpu_watchdog.model import Finding
from gpu_watchdog.store.db import Store
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore


class Counted:
    def __init__(self) -> None:
        self.events: list[object] = []

    def count(self, event: object) -> None:
        self.events.append(event)


def _finding() -> Finding:
    return Finding("stall", "idle_held", "job-1", (0, 1), (1,), 100.0, 130.0, ("GPU-0",), "rank 1 stopped", "stack")


def _transcript(tmp_path: Path, journal: Store | None = None) -> tuple[Transcript, list[str], Counted]:
    said: list[str] = []
    metrics = Counted()
    ctx = ActContext(Config(), "node-1", IncidentStore(tmp_path / "state", journal=journal),
                     FallbackStore(tmp_path / "state"), metrics=metrics, say=said.append)
    return ctx.transcript(ctx.open_incident(_finding())), said, metrics


def test_each_subscriber_takes_its_own_events_in_order(tmp_path: Path) -> None:
    t, said, metrics = _transcript(tmp_path)
    metrics.events.clear()  # the incident's opening count
    t.update(reason="rank 1 stopped", collective="all_reduce")
    t.say("culprit: rank 1")
    t.count(ActionDone("stop", True))
    t.record_action("stop", True, "SIGTERM to 2 job processes")
    t.report(())
    t.finish("restarted")
    on_disk = json.loads((t.dir / "summary.json").read_text())
    assert (on_disk["reason"], on_disk["collective"], on_disk["outcome"]) == ("rank 1 stopped", "all_reduce",
                                                                               "restarted")
    assert [(a["action"], a["ok"], a["outcome"]) for a in on_disk["actions"]] == [("stop", True, "ok")]
    assert said == ["culprit: rank 1"]  # the console gets lines, never the record's events
    assert metrics.events == [ActionDone("stop", True)]  # the metrics get counts, never lines
    assert (t.dir / "report.txt").read_text().strip()
    assert t.noted("collective") == "all_reduce" and t.noted("restarted_by") is None


def test_a_step_is_on_record_before_it_runs_and_a_step_that_raises_ends_failed(tmp_path: Path) -> None:
    journal = Store(tmp_path / "state")
    t, _, _ = _transcript(tmp_path, journal)
    with t.step("checkpoint", "requested from ranks [0, 1]") as step:
        assert t.incident.summary["actions"][-1]["ok"] is None  # on record (and in the journal) while it runs
        step.end(False, "skipped: no client", outcome="skipped")
    with pytest.raises(OSError):
        with t.step("stop", "SIGTERM to 2 job processes"):
            raise OSError("permission denied")
    checkpoint, stop = t.incident.summary["actions"]
    assert (checkpoint["ok"], checkpoint["outcome"], checkpoint["detail"]) == (False, "skipped", "skipped: no client")
    assert stop["ok"] is False and stop["detail"] == "SIGTERM to 2 job processes; failed: OSError: permission denied"
    assert all(a["finished_at"] is not None for a in journal.actions(t.id))  # nothing left open to resume
    journal.close()


def test_a_subscriber_sees_every_event_once_in_the_order_emitted(tmp_path: Path) -> None:
    t, _, _ = _transcript(tmp_path)
    seen: list[object] = []
    tap = Transcript(t.incident, (seen.append,))
    tap.say("one")
    key = tap.begin_action("stop", "SIGTERM")
    tap.end_action(key, True, "done")
    assert seen[0] == Said("one") and seen[1] == ActionBegun(key, "stop", "SIGTERM") and len(seen) == 3
