"""Crash-safe state: incident directories, the daemon's SQLite store, the fallback overlay files.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpu_watchdog.errors import StateUnreadable


def require_state_dir(state_dir: Path, what: str) -> None:
    """StateUnreadable (exit 66) naming the state dir when it is missing or not readable: a reader must never take a
    mistyped ``--state-dir`` for an empty one (no incidents, fallback level 0)."""
    if not state_dir.is_dir() or not os.access(state_dir, os.R_OK | os.X_OK):
        raise StateUnreadable(f"cannot read the state dir {state_dir}: missing or not readable ({what})")
