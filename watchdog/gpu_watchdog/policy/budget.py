"""The restart budget: how many restarts a job may still get (pure bookkeeping; the daemon persists its state)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpu_watchdog.config.schema import RecoveryConfig


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

    def allow(self, now: float, hang_step: int | None) -> tuple[bool, str]:
        """Account for one more hang; returns whether a restart is allowed and why not."""
        verdict = self._account(now, hang_step)
        if self._on_change is not None:
            self._on_change(self)
        return verdict

    def _account(self, now: float, hang_step: int | None) -> tuple[bool, str]:
        if self.last_hang_step is not None and (hang_step is None or hang_step <= self.last_hang_step):
            self.no_progress += 1
        else:
            self.no_progress = 0
        if hang_step is not None:
            self.last_hang_step = hang_step if self.last_hang_step is None else max(self.last_hang_step, hang_step)
        recent = [t for t in self.restarts if now - t < self.cfg.restart_window_s]
        if len(recent) >= self.cfg.max_restarts:
            return False, (f"{len(recent)} restarts in the last {self.cfg.restart_window_s:.0f}s "
                           f"(recovery.max_restarts = {self.cfg.max_restarts})")
        if self.no_progress >= self.cfg.max_no_progress_restarts:
            return False, (f"{self.no_progress} restarts in a row hung again without passing step "
                           f"{self.last_hang_step} (recovery.max_no_progress_restarts)")
        self.restarts.append(now)
        return True, ""

    def adopt(self, restarts: list[float]) -> None:
        """Count the job-wide restart history (a multi-node job's run records) instead of this node's own: every
        node's agent then spends, and sees spent, the same budget."""
        self.restarts = sorted(float(t) for t in restarts)
        if self._on_change is not None:
            self._on_change(self)

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
