"""Shared helpers live in tests/support (a directory of plain modules, imported by name)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
