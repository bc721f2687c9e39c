"""A job that died of its own collective timeout: the ranks that exited first are the ones that *waited* — gloo
raises in them, NCCL's watchdog aborts them — while the rank they waited on was still working. Naming the first to
exit would blame the innocent. The evidence that does not race: what the ranks printed ("Timed out waiting 30000ms
for recv operation to complete", "Watchdog caught collective operation timeout: WorkNCCL(… Timeout(ms)=600000)",
torchrun prefixing each line with ``[rankN]:``) and who the detector saw waiting on whom when the job last ran.
Pure: the job's output text and its last status in, a verdict out."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpu_watchdog.evidence.stacks.diagnosis import collective_waited_in
from gpu_watchdog.model import JobStatus, rank_label

_GLOO = re.compile(r"^\[rank(\d+)\]:.*Timed out waiting (\d+)ms for (?:recv|send) operation", re.M)
_NCCL = re.compile(r"^\[rank(\d+)\]:.*Watchdog caught collective operation timeout: WorkNCCL\([^)]*?"
                   r"OpType=(\w+)[^)]*?Timeout\(ms\)=(\d+)", re.M)
_NCCL_BARE = re.compile(r"\[Rank (\d+)\][^\n]*Watchdog caught collective operation timeout: WorkNCCL\([^)]*?"
                        r"OpType=(\w+)[^)]*?Timeout\(ms\)=(\d+)")


@dataclass(frozen=True)
class TimeoutExit:
    """The job's own collective timeout ended it: ``timed_out`` ranks gave up after ``timeout_s`` waiting (in
    ``collective`` when known) on ``waited_on``, which were still working (``doing``)."""

    timed_out: tuple[int, ...]
    timeout_s: float
    waited_on: tuple[int, ...]
    collective: str | None
    doing: str

    def to_json(self) -> dict[str, object]:
        return {"timed_out_ranks": list(self.timed_out), "timeout_s": self.timeout_s,
                "waited_on": list(self.waited_on), "collective": self.collective, "doing": self.doing}

    def detail(self) -> str:
        who = ", ".join(rank_label(r) for r in self.waited_on)
        what = f" in {self.collective}" if self.collective else ""
        return (f"rank(s) {','.join(map(str, self.timed_out))} hit the job's own {self.timeout_s:.0f} s collective "
                f"timeout waiting{what} on {who}" + (f" ({self.doing})" if self.doing else ""))


def timeouts_in(output: str) -> dict[int, tuple[float, str | None]]:
    """rank → (timeout in seconds, the collective when NCCL names it) for every rank whose output says its collective
    timed out."""
    out: dict[int, tuple[float, str | None]] = {}
    for m in _GLOO.finditer(output):
        out.setdefault(int(m.group(1)), (int(m.group(2)) / 1000.0, None))
    for pattern in (_NCCL, _NCCL_BARE):
        for m in pattern.finditer(output):
            out.setdefault(int(m.group(1)), (int(m.group(3)) / 1000.0, m.group(2).lower().lstrip("_")))
    return out


def timeout_exit(output: str, status: JobStatus | None, first: Iterable[int], seen_at: float | None = None,
                 exited_at: float | None = None) -> TimeoutExit | None:
    """The verdict when the output shows collective timeouts, every rank that exited first is one of them, and the
    detector saw those ranks waiting on others (``status.waiting_on``) that did not time out, at ``seen_at``, within
    the timeout before the first exit at ``exited_at`` (the waiters sat in the collective all that time: an older
    wait is another story); else None."""
    first = tuple(sorted(first))
    if status is None or not status.waiting_on or not first:
        return None
    timed = timeouts_in(output)
    waited_on = tuple(r for r in status.waiting_on if r not in timed)
    if not waited_on or not set(first) <= set(timed):
        return None
    timeout_s = max(timed[r][0] for r in first)
    if seen_at is not None and exited_at is not None and seen_at < exited_at - timeout_s:
        return None
    collective = next((c for r in first if (c := timed[r][1])), None)
    if collective is None and status.deadline is not None:
        collective = status.deadline.collective
    collective = collective or collective_waited_in(status.waiting_on, status.evidence)
    return TimeoutExit(tuple(sorted(timed)), timeout_s, waited_on, collective, status.waiting_doing)
