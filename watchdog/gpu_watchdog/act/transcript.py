"""A recovery as a stream of typed events (``Transcript``): each step says what happened once — an action begun or
ended, summary keys noted, a line for people, a count for the metrics, the report due, the incident finished —
and every subscriber takes what it keeps: the incident record (``IncidentRecord``: ``summary.json``, the daemon's
journal, ``report.txt``), the console, the agent's metrics. Steps never write the incident themselves."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_watchdog.act.events import ActEvent
from gpu_watchdog.act.steps import Phase, move
from gpu_watchdog.evidence.report import render_report
from gpu_watchdog.model import RankStack
from gpu_watchdog.store.incidents import Incident


@dataclass
class Step:
    """How one step ended (``Transcript.step``); left unset, the step ended ok."""

    ok: bool = True
    detail: str = ""
    outcome: str | None = None

    def end(self, ok: bool, detail: str, outcome: str | None = None) -> None:
        self.ok, self.detail, self.outcome = ok, detail, outcome


@dataclass(frozen=True)
class Noted:
    fields: Mapping[str, Any]  # keys of the incident's summary, set (or replaced)


@dataclass(frozen=True)
class ActionBegun:
    key: int  # pairs it with its ActionEnded
    action: str
    detail: str


@dataclass(frozen=True)
class ActionEnded:
    key: int
    ok: bool
    detail: str
    outcome: str | None  # None: "ok" or "failed" by ``ok``


@dataclass(frozen=True)
class Said:
    line: str


@dataclass(frozen=True)
class ReportDue:
    stacks: tuple[RankStack, ...]  # the ranks' stacks, grouped in the readable report


@dataclass(frozen=True)
class Finished:
    outcome: str


@dataclass(frozen=True)
class Moved:
    frm: Phase  # the recovery's step before (act.steps)
    to: Phase


RecordEvent = Noted | ActionBegun | ActionEnded | Said | ReportDue | Finished | Moved
RECORD_EVENTS = (Noted, ActionBegun, ActionEnded, Said, ReportDue, Finished, Moved)  # the rest are act.events' counts
Subscriber = Callable[[RecordEvent | ActEvent], None]


class IncidentRecord:
    """The incident's subscriber: writes each event into the incident (store.incidents) as it comes."""

    def __init__(self, incident: Incident) -> None:
        self.incident = incident
        self._open: dict[int, dict[str, Any]] = {}

    def __call__(self, event: RecordEvent | ActEvent) -> None:
        inc = self.incident
        match event:
            case Noted(fields):
                inc.update(**fields)
            case ActionBegun(key, action, detail):
                self._open[key] = inc.begin_action(action, detail)
            case ActionEnded(key, ok, detail, outcome):
                inc.end_action(self._open.pop(key), ok, detail, outcome)
            case ReportDue(stacks):
                inc.write_report(render_report(inc.summary, list(stacks)))
            case Finished(outcome):
                inc.finish(outcome)


def console(say: Callable[[str], None]) -> Subscriber:
    """The console's subscriber: the lines for people."""
    def take(event: RecordEvent | ActEvent) -> None:
        if isinstance(event, Said):
            say(event.line)
    return take


def steps_log(log: logging.Logger) -> Subscriber:
    """The agent's log: each move of a recovery, at debug level."""
    def take(event: RecordEvent | ActEvent) -> None:
        if isinstance(event, Moved):
            log.debug("recovery: %s -> %s", event.frm, event.to)
    return take


def metrics(count: Callable[[ActEvent], None]) -> Subscriber:
    """The metrics' subscriber: the counted events (act.events)."""
    def take(event: RecordEvent | ActEvent) -> None:
        if not isinstance(event, RECORD_EVENTS):
            count(event)
    return take


class Transcript:
    """What a recovery (and each evidence source it asks) writes to: one method per kind of event, each emitted to
    every subscriber in order. Also what the targets and restart hooks write their actions to."""

    def __init__(self, incident: Incident, subscribers: Sequence[Subscriber]) -> None:
        self.incident = incident  # for the hosts, which read and finish it; steps go through the events
        self._subscribers = tuple(subscribers)
        self._keys = itertools.count()
        self._noted: dict[str, Any] = {}
        self.phase = Phase.JUDGING  # the recovery's step (act.steps), moved by ``enter``

    @property
    def id(self) -> str:
        return self.incident.id

    @property
    def dir(self) -> Path:
        return self.incident.dir

    def emit(self, event: RecordEvent | ActEvent) -> None:
        for take in self._subscribers:
            take(event)

    def enter(self, to: Phase) -> None:
        """The recovery's next step, checked against act.steps.MOVES (IllegalMove: a bug), then emitted."""
        frm, self.phase = self.phase, move(self.phase, to)
        self.emit(Moved(frm, to))

    def update(self, **fields: Any) -> None:
        self._noted.update(fields)
        self.emit(Noted(fields))

    def noted(self, key: str) -> Any:
        """What this recovery noted under ``key`` (None if nothing): a later step reads what an earlier one found."""
        return self._noted.get(key)

    def begin_action(self, action: str, detail: str = "") -> int:
        key = next(self._keys)
        self.emit(ActionBegun(key, action, detail))
        return key

    def end_action(self, entry: int, ok: bool, detail: str, outcome: str | None = None) -> None:
        self.emit(ActionEnded(entry, ok, detail, outcome))

    def record_action(self, action: str, ok: bool, detail: str, outcome: str | None = None) -> None:
        self.end_action(self.begin_action(action), ok, detail, outcome)

    @contextmanager
    def step(self, action: str, detail: str = "") -> Iterator[Step]:
        """One action, begun before it runs and ended after (``Step.end`` says how); a step that raises ends failed
        with the error, so no action is left open."""
        key = self.begin_action(action, detail)
        step = Step(detail=detail)
        try:
            yield step
        except BaseException as e:
            self.end_action(key, False, f"{step.detail}; failed: {type(e).__name__}: {e}".lstrip("; "))
            raise
        self.end_action(key, step.ok, step.detail, step.outcome)

    def say(self, line: str) -> None:
        self.emit(Said(line))

    def count(self, event: ActEvent) -> None:
        self.emit(event)

    def report(self, stacks: Sequence[RankStack] = ()) -> None:
        self.emit(ReportDue(tuple(stacks)))

    def finish(self, outcome: str) -> None:
        self.emit(Finished(outcome))


def with_subscribers(incident: Incident, say: Callable[[str], None],
                     count: Callable[[ActEvent], None]) -> Transcript:
    """The transcript of one incident, with the record, the console and the metrics subscribed."""
    return Transcript(incident, (IncidentRecord(incident), console(say), metrics(count),
                                 steps_log(logging.getLogger("gpu_watchdog.act"))))

