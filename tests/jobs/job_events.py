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


def checkpointing(workdir: str, model: object, opt: object, rank: int, events: str | None,
                  map_location: object = None) -> tuple[int, object]:
    """Resume a DDP ``model`` and ``opt`` from ``<workdir>/ckpt.pt`` when there is one; returns (the first step to
    run, the in-job client's save callback: rank 0 writes atomically, no collectives — it may run after an abort)."""
    import torch

    ckpt = os.path.join(workdir, "ckpt.pt")
    start = 1
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, map_location=map_location, weights_only=True)
        model.module.load_state_dict(saved["model"])  # type: ignore[attr-defined]
        opt.load_state_dict(saved["opt"])  # type: ignore[attr-defined]
        start = int(saved["step"]) + 1
        log_event(events, rank=rank, step=start - 1, event="resume")

    def save(step: int) -> None:
        if rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},  # type: ignore
                       tmp)
            os.replace(tmp, ckpt)
            log_event(events, rank=rank, step=step, event="checkpoint")

    return start, save
