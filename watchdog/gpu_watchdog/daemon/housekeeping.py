"""Housekeeping: incident directories do not fill the disk."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from gpu_watchdog.config.schema import DaemonSettings
from gpu_watchdog.store.db import Store

log = logging.getLogger("gpu_watchdog.daemon")


def prune_incidents(root: Path, store: Store, settings: DaemonSettings, now: float) -> list[str]:
    """Remove finished incident directories older than ``daemon.incident_max_age_days``, then the oldest until the
    rest fit in ``daemon.incident_max_total_mb``. Unfinished incidents are never removed. Returns the removed ids."""
    if not root.is_dir():
        return []
    active = {r["id"] for r in store.unfinished_incidents()}
    entries = []
    for d in root.iterdir():
        if not d.is_dir() or d.name in active or d.is_symlink():
            continue
        try:
            mtime = (d / "summary.json").stat().st_mtime
        except OSError:
            mtime = d.stat().st_mtime
        entries.append((mtime, d, _du(d)))
    entries.sort()
    removed = []
    max_age = settings.incident_max_age_days * 86400
    budget = settings.incident_max_total_mb * (1 << 20)
    total = sum(e[2] for e in entries)
    for mtime, d, size in entries:
        if now - mtime > max_age or total > budget:
            shutil.rmtree(d, ignore_errors=True)
            store.forget_incident(d.name)
            total -= size
            removed.append(d.name)
    if removed:
        log.info("housekeeping: removed %d old incident(s)", len(removed))
    return removed


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total
