"""The file protocol between the agent and the in-job client (gpu_watchdog.job). No torch here.

The agent gives the job a control directory through ``GPU_WATCHDOG_CONTROL_DIR``. In it:
- ``client-<rank>.json``  the client announces itself (opt-in to checkpoint requests): {pid, rank, t}
- ``step-<rank>``         the last completed step, rewritten by ``step(n)`` (a heartbeat)
- ``request.json``        the agent's checkpoint request: {id, t, boundary_s, grace_s}; a client that has
                          saved and acked waits up to ``grace_s`` for every announced client's ack before
                          its process exits (an exiting rank makes torchrun SIGTERM its peers mid-save)
- ``ack-<rank>.json``     the client's answer: {id, rank, pid, outcome, step, t, detail?}; outcome is one of
                          ``saved`` (at a step boundary), ``aborted_saved`` (after aborting the process
                          group), ``skipped`` (no step completed in this run: the callback was not called,
                          ``step`` is null) or ``failed`` (the callback raised; ``detail`` says what)
- ``groups-<rank>.json``  the rank's process groups once it has some, rewritten when their number changes:
                          {rank, pid, t, groups: [{name, desc, ranks, timeout_s}]} — each group's own timeout,
                          the deadline of a collective in it (evidence.deadline)
- ``done-<rank>.json``    the rank's training loop (``client.training()``) ended without an exception:
                          {rank, pid, step, t} — a death after it is a death at teardown, never restarted
Files are written to a temp name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gpu_watchdog.atomic import note_write_error, write_atomic

CONTROL_DIR_ENV = "GPU_WATCHDOG_CONTROL_DIR"
RESTART_COUNT_ENV = "GPU_WATCHDOG_RESTART_COUNT"
FALLBACK_LEVEL_ENV = "GPU_WATCHDOG_FALLBACK_LEVEL"

# Exit codes of a rank that the client stopped (documented in README "Exit codes").
EXIT_CHECKPOINTED = 85  # saved at a step boundary on request, then exited
EXIT_ABORTED = 86  # aborted the hung process group (and saved when it could), then exited
CLIENT_EXIT_CODES = {  # shown by ``gpu-watchdog --help`` beside errors.EXIT_CODES
    EXIT_CHECKPOINTED: "a rank stopped by the in-job client: checkpointed at a step boundary",
    EXIT_ABORTED: "a rank stopped by the in-job client: aborted the hung process group (and saved)",
}


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data))


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class ControlDir:
    """Agent-side view of one job's control directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def create(self) -> None:
        """A clean control directory for the next run. On a full or read-only state dir the run starts anyway:
        the in-job client then finds no directory and stays a no-op (no checkpoint requests)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            for f in self.path.glob("*"):  # a restart starts with a clean protocol state
                if f.is_file():
                    f.unlink()
        except OSError as e:
            note_write_error(f"the job's control directory {self.path}", e)

    def _by_rank(self, pattern: str, request_id: str | None = None) -> dict[int, dict[str, Any]]:
        """The files matching ``pattern`` by the rank they carry (of ``request_id`` only, when given)."""
        out = {}
        for f in self.path.glob(pattern):
            data = read_json(f)
            if data and isinstance(data.get("rank"), int) and (request_id is None or data.get("id") == request_id):
                out[data["rank"]] = data
        return out

    def clients(self) -> dict[int, dict[str, Any]]:
        return self._by_rank("client-*.json")

    def finished(self) -> dict[int, dict[str, Any]]:
        """The ranks whose training loop ended without an exception in this run (``done-<rank>.json``)."""
        return self._by_rank("done-*.json")

    def groups(self) -> dict[int, dict[str, Any]]:
        """The process groups (with their timeouts) each rank's client reported (``groups-<rank>.json``)."""
        return self._by_rank("groups-*.json")

    def steps(self) -> dict[int, int]:
        out = {}
        for f in self.path.glob("step-*"):
            try:
                out[int(f.name.split("-", 1)[1])] = int(f.read_text() or "-1")
            except (OSError, ValueError):
                continue
        return out

    def request_checkpoint(self, request_id: str, boundary_s: float, grace_s: float = 60.0) -> None:
        for f in self.path.glob("ack-*.json"):
            f.unlink()
        write_json_atomic(self.path / "request.json", {"id": request_id, "t": time.time(), "boundary_s": boundary_s,
                                                       "grace_s": grace_s})

    def acks(self, request_id: str) -> dict[int, dict[str, Any]]:
        return self._by_rank("ack-*.json", request_id)
