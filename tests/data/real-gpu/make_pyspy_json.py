"""Regenerate the py-spy JSON fixtures in tests/data/real-gpu/ from the real captures beside them.

``<case>/stacks.txt`` are copies (unchanged) of ``/work/shared/real-gpu/<case>/stacks.txt``: ``gpu-watchdog
dump-stacks`` (and ``dump-stacks --native``) of a real 2-rank NCCL job on one H200 (PyTorch 2.11, NCCL 2.28.9), see
that directory's README. Its text shows each pid's main thread, innermost frame first, as ``name (file:line)``
(Python) or ``name (library)`` (native). This script writes each dump back as what ``py-spy dump --json`` printed
for it: a list holding the main thread's object. Files::

    <case>/pid-<pid>.json          the dump without --native (0.01 s)
    <case>/pid-<pid>-native.json   the dump with --native (1.2-1.3 s)

What the text does not keep is left as the capture shows it: Python frames' ``filename`` is the short name
(``train.py``, ``threading.py``), a native frame's is its library's short name, the thread id is the pid.

Usage (from the repository root)::

    .venv/bin/python tests/data/real-gpu/make_pyspy_json.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CASES = ("nccl-hang", "slow-save")
_HEADER = re.compile(r"^pid (\d+): ok \(([\d.]+) s\) (\S+): (.*) (active|idle)$")
_PY_LOC = re.compile(r"^(.*\.py):(\d+)$")


def frame(text: str) -> dict[str, Any]:
    name, _, loc = text.strip().rpartition(" (")
    loc = loc[:-1]  # the closing parenthesis
    m = _PY_LOC.match(loc)
    if m:
        return {"name": name, "filename": m.group(1), "module": None, "short_filename": m.group(1),
                "line": int(m.group(2)), "locals": None, "is_entry": False, "is_shim_entry": False}
    return {"name": name, "filename": loc, "module": loc, "short_filename": loc, "line": 0, "locals": None,
            "is_entry": False, "is_shim_entry": False}


def dumps(text: str) -> list[tuple[int, bool, dict[str, Any]]]:
    """(pid, native, main thread) of every dump in a stacks.txt, in order."""
    out: list[tuple[int, bool, dict[str, Any]]] = []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            pid = int(m.group(1))
            out.append((pid, False, {"pid": pid, "thread_id": pid, "thread_name": m.group(3), "os_thread_id": pid,
                                     "active": m.group(5) == "active", "owns_gil": False, "frames": [],
                                     "process_info": None}))
        elif line.startswith("    ") and out:
            out[-1][2]["frames"].append(frame(line))
    # A dump with any native frame (no line number) was taken with --native.
    return [(pid, any(f["line"] == 0 for f in th["frames"]), th) for pid, _, th in out]


def main() -> None:
    for case in CASES:
        for pid, native, th in dumps((HERE / case / "stacks.txt").read_text()):
            path = HERE / case / f"pid-{pid}{'-native' if native else ''}.json"
            path.write_text(json.dumps([th], indent=2) + "\n")
            print(path.relative_to(HERE))


if __name__ == "__main__":
    main()
