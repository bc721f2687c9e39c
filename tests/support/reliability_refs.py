"""The tests docs/reliability.md names: ``(path, None)`` for a whole file, ``(path, name)`` for one test."""

from __future__ import annotations

import re
from pathlib import Path

_REF = re.compile(r"`(tests/[\w/]+\.py)(?:::([\w\[\]\-.]+))?`")


def fault_tests(page: Path) -> set[tuple[str, str | None]]:
    return {(m.group(1), m.group(2)) for m in _REF.finditer(page.read_text())}
