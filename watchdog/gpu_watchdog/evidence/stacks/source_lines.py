"""The text of one line of a rank's Python source, as the rank sees its files.

py-spy names the file and line of every Python frame; what the line *calls* is only in the source. Reading it is
cheap (a stat per frame, the file read once per version: cached per (path, mtime, size)) and needs no ptrace, so it
can stand in where a native dump cannot be had (evidence.stacks.collect). A rank in another mount namespace (a
container) is read through ``/proc/PID/root``, a relative file name (``python train.py``) through
``/proc/PID/cwd``; where neither is readable the agent's own view of the path is tried. Never raises: None when
the line cannot be read.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

MAX_FILES = 256  # source files kept in the cache (a training job imports a few hundred; only innermost frames ask)
MAX_FILE_BYTES = 8 << 20  # larger files are not read (no source file is; a generated blob might be)

_cache: OrderedDict[tuple[str, int, int], tuple[str, ...]] = OrderedDict()
_lock = threading.Lock()  # dumps of several jobs run on worker threads


def _candidates(filename: str, pid: int | None) -> list[str]:
    out = []
    if pid is not None:
        out.append(f"/proc/{pid}/root{filename}" if os.path.isabs(filename)
                   else os.path.join(f"/proc/{pid}/cwd", filename))
    out.append(filename)
    return out


def _lines(path: str) -> tuple[str, ...] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    key = (path, st.st_mtime_ns, st.st_size)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    if st.st_size > MAX_FILE_BYTES:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except (OSError, ValueError):
        return None
    lines = tuple(data.decode("utf-8", errors="replace").splitlines())
    with _lock:
        for old in [k for k in _cache if k[0] == path]:  # an earlier version of the same file
            del _cache[old]
        _cache[key] = lines
        while len(_cache) > MAX_FILES:
            _cache.popitem(last=False)
    return lines


def source_line(filename: str, line: int, pid: int | None = None) -> str | None:
    """Line ``line`` (1-based) of ``filename``, stripped, as process ``pid`` sees the file; None when it cannot be
    read (a pseudo-file such as ``<string>``, a file gone or unreadable, a line past its end)."""
    if not filename or filename.startswith("<") or not isinstance(line, int) or line <= 0:
        return None
    for path in _candidates(filename, pid):
        lines = _lines(path)
        if lines is not None:
            return lines[line - 1].strip() if line <= len(lines) else None
    return None


def clear_cache() -> None:
    with _lock:
        _cache.clear()
