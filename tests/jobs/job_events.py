"""What every test job shares: its events file (JSON lines {"rank", "step", "t", "event", ...}), a CPU burner and a
checkpoint crawling to slow storage. Imported by the job scripts beside it (a script's own directory is on its
sys.path)."""

from __future__ import annotations

import json
import os
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


def slow_save(path: str, seconds: float) -> int:
    """A checkpoint crawling to slow storage: 64 KiB chunks, each fsync'd, 50 ms apart. Returns the bytes written."""
    end = time.monotonic() + seconds
    chunk = os.urandom(64 << 10)
    written = 0
    with open(path, "wb") as f:
        while time.monotonic() < end:
            f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            written += len(chunk)
            time.sleep(0.05)
    return written
