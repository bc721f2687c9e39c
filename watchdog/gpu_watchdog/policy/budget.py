"""The restart budget: how many restarts a job may still get (pure bookkeeping; the daemon persists its state)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.config.schema import RecoveryConfig


@dataclass(frozen=True)
class BudgetVerdict:
    allowed: bool
    why_not: str  # "" when allowed
    state: Mapping[str, Any]  # the budget's state once this hang is accounted for (RestartBudget.state()'s shape)


class RestartBudget:
    """How many restarts a job may still get: ``max_restarts`` per ``restart_window_s``, and at most
    ``max_no_progress_restarts`` in a row that hang again without passing the step that hung before.

    ``state`` restores a saved budget (``state()``'s output) and ``on_change`` is called after every
    accounting, so the daemon can keep budgets across its own restarts and the job's requeues."""

    def __init__(self, cfg: RecoveryConfig, state: Mapping[str, Any] | None = None,
                 on_change: Callable[[RestartBudget], None] | None = None) -> None:
        self.cfg = cfg
        self.restarts: list[float] = [float(t) for t in (state or {}).get("restarts", [])]
        self.no_progress = int((state or {}).get("no_progress", 0))
        step = (state or {}).get("last_hang_step")
        self.last_hang_step: int | None = None if step is None else int(step)
        self._on_change = on_change

    def state(self) -> dict[str, Any]:
        return {"restarts": list(self.restarts), "no_progress": self.no_progress,
                "last_hang_step": self.last_hang_step}

    def verdict(self, now: float, hang_step: int | None, job_wide: list[float] | None = None) -> BudgetVerdict:
        """Whether one more hang may be restarted, and the budget's state once it is accounted for; changes
        nothing (``commit`` does). ``job_wide``: the job's restart history from its run records (a multi-node job),
        counted instead of this node's own, so that every node's agent spends, and sees spent, the same budget."""
        restarts = sorted(float(t) for t in job_wide) if job_wide is not None else list(self.restarts)
        last = self.last_hang_step
        no_progress = self.no_progress + 1 if last is not None and (hang_step is None or hang_step <= last) else 0
        if hang_step is not None:
            last = hang_step if last is None else max(last, hang_step)
        recent = [t for t in restarts if now - t < self.cfg.restart_window_s]
        why = ""
        if len(recent) >= self.cfg.max_restarts:
            why = (f"{len(recent)} restarts in the last {self.cfg.restart_window_s:.0f}s "
                   f"(recovery.max_restarts = {self.cfg.max_restarts})")
        elif no_progress >= self.cfg.max_no_progress_restarts:
            why = (f"{no_progress} restarts in a row hung again without passing step {last} "
                   "(recovery.max_no_progress_restarts)")
        else:
            restarts.append(now)
        return BudgetVerdict(not why, why, {"restarts": restarts, "no_progress": no_progress, "last_hang_step": last})

    def commit(self, verdict: BudgetVerdict) -> None:
        """Account for the hang ``verdict`` was asked about (a restart it allowed is charged)."""
        self.restarts = list(verdict.state["restarts"])
        self.no_progress = int(verdict.state["no_progress"])
        self.last_hang_step = verdict.state["last_hang_step"]
        if self._on_change is not None:
            self._on_change(self)

    def allow(self, now: float, hang_step: int | None) -> tuple[bool, str]:
        """Account for one more hang; returns whether a restart is allowed and why not."""
        verdict = self.verdict(now, hang_step)
        self.commit(verdict)
        return verdict.allowed, verdict.why_not

    def refund(self) -> None:
        """The restart just allowed did not happen here (another agent restarted the job): not charged."""
        if self.restarts:
            self.restarts.pop()
            if self._on_change is not None:
                self._on_change(self)

    def backoff_s(self, now: float, healthy_reset_s: float) -> float:
        """How long to wait before the restart just allowed: the k-th restart in a row (each within
        ``healthy_reset_s`` of the previous) comes at least ``restart_backoff_s · 2^(k-2)`` (at most
        ``restart_backoff_max_s``) after the one before it; the first of a row comes at once."""
        if self.cfg.restart_backoff_s <= 0 or len(self.restarts) < 2:
            return 0.0
        k = 1
        for later, earlier in zip(self.restarts[::-1], self.restarts[-2::-1], strict=False):
            if later - earlier >= healthy_reset_s:
                break
            k += 1
        if k < 2:
            return 0.0
        spacing = min(self.cfg.restart_backoff_s * 2 ** (k - 2), self.cfg.restart_backoff_max_s)
        return max(0.0, self.restarts[-2] + spacing - now)
