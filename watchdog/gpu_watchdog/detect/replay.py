"""Run the detector over a recorded trace, exactly as the live agent would over the same samples."""

from __future__ import annotations

from pathlib import Path

from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.detector import DetectorState, step
from gpu_watchdog.errors import TraceError
from gpu_watchdog.model import Finding, NodeSample, StackEvidence
from gpu_watchdog.sample.trace import read_trace


def replay_trace(path: str | Path, cfg: DetectConfig) -> list[Finding]:
    """All findings the detector produces over the trace, in order. Raises TraceError on bad input."""
    _head, records = read_trace(path)
    state = DetectorState()
    pending: list[StackEvidence] = []
    findings: list[Finding] = []
    last_t = None
    for rec in records:
        if isinstance(rec, StackEvidence):
            pending.append(rec)
        elif isinstance(rec, NodeSample):
            if last_t is not None and rec.t < last_t:
                raise TraceError(f"{path}: samples go back in time at t={rec.t}")
            last_t = rec.t
            state, new = step(state, rec, cfg, pending)
            pending = []
            findings.extend(new)
    return findings
