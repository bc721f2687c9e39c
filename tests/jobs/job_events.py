"""What every test job shares: its events file (JSON lines {"rank", "step", "t", "event", ...}) and a CPU burner.
Imported by the job scripts beside it (a script's own directory is on its sys.path)."""

from __future__ import annotations

import json
import time


def log_event(path: str | None, **fields: object) -> None:
    if not path:
        return
    fields.setdefault("t", time.time())
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def compute(seconds: float) -> None:
    """Burn CPU for roughly ``seconds`` (a stand-in for forward/backward or evaluation)."""
    import torch

    end = time.monotonic() + seconds
    a = torch.randn(128, 128)
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
