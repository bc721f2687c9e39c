"""Ask a job to save before it is stopped (recovery) or preempted (the control API's ``preempt``).

Through its in-job client when it has one (a request file it answers with an acknowledgement per rank), else
with ``recovery.checkpoint_signal`` when the job opted in — never a signal the job did not ask for.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from gpu_watchdog.act.stopper import JobProcess, send_signal
from gpu_watchdog.atomic import note_write_error
from gpu_watchdog.config.schema import RecoveryConfig
from gpu_watchdog.job.protocol import ControlDir

SAVED = ("saved", "aborted_saved")


@dataclass(frozen=True)
class CheckpointResult:
    how: str  # "client" | "signal" | "none" (the job did not opt in)
    ok: bool  # client: no rank's save failed and some rank saved; signal: it was sent
    detail: str
    acks: dict[int, dict[str, Any]] = field(default_factory=dict)
    missing: tuple[int, ...] = ()  # clients that did not answer in time
    sent_to: tuple[int, ...] = ()  # pids signalled
    outcome: str = ""  # the action's outcome: "ok", "failed" or "skipped" (see client_outcome)


def client_outcome(acks: dict[int, dict[str, Any]]) -> str:
    """The checkpoint's outcome from the ranks' answers: ``failed`` when any rank's save failed (typically rank 0,
    the only one that writes: a no-op "saved" from the others must not hide it), else ``ok`` when some rank saved,
    else ``skipped`` when every answer is "no step completed in this run" (the state on disk is the one the run
    resumed from), else ``failed`` (no answer at all)."""
    outcomes = [a.get("outcome") for a in acks.values()]
    if "failed" in outcomes:
        return "failed"
    if any(o in SAVED for o in outcomes):
        return "ok"
    return "skipped" if outcomes and all(o == "skipped" for o in outcomes) else "failed"


def _ack_text(rank: int, ack: dict[str, Any]) -> str:
    if ack.get("outcome") == "skipped":
        return f"rank {rank}: skipped: {ack.get('detail') or 'no step completed in this run'}"
    text = f"rank {rank}: {ack.get('outcome')} at step {ack.get('step')}"
    return f"{text} ({ack['detail']})" if ack.get("detail") else text


def request_checkpoint(control: ControlDir, request_id: str, rc: RecoveryConfig, *, timeout_s: float,
                       running: Callable[[], bool], signal_ranks: Collection[JobProcess] = (),
                       unanswerable: Collection[int] = ()) -> CheckpointResult:
    """Ask and wait at most ``timeout_s`` (less when ``running()`` turns false). ``signal_ranks``: the rank
    processes to signal when there is no client (empty when the job did not opt in); ``unanswerable``: ranks
    that cannot answer (stopped with SIGSTOP), not waited for."""
    clients = control.clients()
    if clients:
        try:
            control.request_checkpoint(request_id, rc.client_boundary_s, timeout_s)
        except OSError as e:  # the request travels through the state dir: full or read-only
            note_write_error(f"the checkpoint request in {control.path}", e)
            return CheckpointResult("client", False, f"could not ask the job to save: {e.strerror or e}",
                                    outcome="failed")
        deadline = time.monotonic() + timeout_s
        expected = set(clients) - set(unanswerable)
        while time.monotonic() < deadline and running() and not set(control.acks(request_id)) >= expected:
            time.sleep(0.2)
        acks = control.acks(request_id)
        missing = tuple(sorted(set(clients) - set(acks)))
        detail = ", ".join(_ack_text(r, a) for r, a in sorted(acks.items()))
        if missing:
            detail += f"{'; ' if detail else ''}no answer from ranks {list(missing)}"
        outcome = client_outcome(acks)
        return CheckpointResult("client", outcome == "ok", detail, acks, missing, outcome=outcome)
    if signal_ranks and rc.checkpoint_signal:
        sig = getattr(signal, rc.checkpoint_signal)
        sent = tuple(p.pid for p in signal_ranks if send_signal(p, sig))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and running():
            time.sleep(0.2)
        return CheckpointResult("signal", bool(sent), f"{rc.checkpoint_signal} sent to pids {list(sent)}; "
                                                       "waited for the job", sent_to=sent,
                                outcome="ok" if sent else "failed")
    return CheckpointResult("none", False, "the job did not opt in (no in-job client, no recovery.checkpoint_signal "
                                           "it asked for)", outcome="skipped")
