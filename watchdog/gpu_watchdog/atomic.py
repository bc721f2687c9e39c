"""One way to write a file for the whole package: temp file in the same directory, fsync, rename — a reader sees
the old content or the new, never half of it — and one account of the writes that failed.

A state directory can fill up or turn read-only under a running agent. The agent must go on (detect, stop,
restart: the job must never be left unsupervised because a summary could not be written), so callers that
can keep their data in memory catch ``OSError`` and report it through ``note_write_error``: one log line per
place and cause, and a count that the metrics export (``gpu_watchdog_state_write_errors_total``).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("gpu_watchdog.state")

_lock = threading.Lock()
_errors = 0
_told: set[tuple[str, int]] = set()


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably. Raises OSError (the temp file is removed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def note_write_error(where: str, err: OSError) -> None:
    """Count a failed state write and say it once per (place, errno), e.g. ``No space left on device``."""
    global _errors
    with _lock:
        _errors += 1
        key = (where, err.errno or 0)
        first = key not in _told
        _told.add(key)
    if first:
        log.warning("cannot write %s: %s; kept in memory, the agent carries on", where, err.strerror or err)


def write_errors() -> int:
    """State writes that failed since the agent started."""
    with _lock:
        return _errors
