"""One node sample of GPUs the NVML stand-in plays, read by the real ``gpu-watchdog record --backend nvml`` through
the real pynvml (test code only): the straggler tests' GPUs, one per rank, one of them held down by thermal slowdown."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pynvml
from gpu_watchdog.model import NodeSample
from gpu_watchdog.sample.trace import read_trace
from nvml_standin import NvmlStandin

CLI = str(Path(sys.executable).with_name("gpu-watchdog"))
THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown


def one_gpu_per_rank_one_hot(standin: NvmlStandin, tmp_path: Path, pids: Mapping[int, int],
                             gpus: Sequence[Mapping[str, Any]], hot: int) -> NodeSample:
    """GPU ``i`` (fields ``gpus[i]``) holds rank ``i``'s pid; GPU ``hot`` is thermally throttled to 1140 of its
    1980 MHz. The sample as the recorder saw it, its processes left out (the caller's ranks are its own)."""
    state = standin.require_scripted()
    with state.batch():
        index = [state.add_gpu(**fields) for fields in gpus]
        for rank, pid in pids.items():
            state.place_process(index[rank], pid=pid, mem_bytes=20 << 30)
        state.throttle(index[hot], THERMAL, sm_clock_mhz=1140, sm_clock_max_mhz=1980)
    trace = tmp_path / "gpus.jsonl"
    subprocess.run([CLI, "record", "--backend", "nvml", "--duration", "0.5", "--interval", "0.5", "--output",
                    str(trace)], env=standin.env, check=True, capture_output=True, timeout=60)
    sample = next(r for r in read_trace(trace)[1] if isinstance(r, NodeSample))
    return NodeSample(t=sample.t, hostname=sample.hostname, backend=sample.backend, devices=sample.devices)
