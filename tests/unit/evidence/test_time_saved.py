"""The time a recovery saved: against the job's own deadline, in GPU-seconds (rank-seconds for a CPU job), and
only for a hang the job's own timeout would have ended (one in communication)."""

from __future__ import annotations

import shutil
from pathlib import Path

from gpu_watchdog.evidence.analyze import fr_dir
from gpu_watchdog.evidence.deadline.saved import NOT_IN_COMMUNICATION, deadline_at_incident, time_saved
from gpu_watchdog.evidence.deadline.sources import backend_default
from gpu_watchdog.model import DeviceSample, GpuProcess, JobIdentity, NodeSample, ProcessSample

DATA = Path(__file__).resolve().parents[2] / "data"


def _sample(on_gpus: bool) -> NodeSample:
    procs = tuple(ProcessSample(100 + r, 0.0, 1, "sleeping", 0.0, 0, 1, job=JobIdentity("j", r, r, 4), is_rank=True)
                  for r in range(4))
    devs = tuple(DeviceSample(r // 2, f"GPU-{r // 2}", "H200", processes=(GpuProcess(100 + r, 1 << 30),))
                 for r in range(4)) if on_gpus else ()
    return NodeSample(t=0.0, hostname="n", backend="nvml" if on_gpus else "proc", devices=devs, processes=procs)


def test_saved_against_pytorchs_default_in_rank_seconds() -> None:
    gloo = backend_default("gloo")
    assert gloo is not None
    rec = time_saved(gloo, onset=1000.0, acted_at=1014.0, job_id="j", sample=_sample(False))
    assert (rec.due_at, rec.saved_s, rec.units, rec.unit, rec.gpu_seconds) == (2800.0, 1786.0, 4, "rank", 7144.0)
    assert rec.line() == ("time saved: stopped 1786 s before the job's own timeout would have (default: 1800 s) — "
                          "1.98 rank-hours on 4 rank(s)")
    assert rec.to_json()["source"] == "default" and "not_counted" not in rec.to_json()


def test_gpus_are_counted_once_however_many_ranks_share_them() -> None:
    nccl = backend_default("nccl")
    assert nccl is not None
    rec = time_saved(nccl, onset=0.0, acted_at=100.0, job_id="j", sample=_sample(True))
    assert (rec.saved_s, rec.units, rec.unit, rec.gpu_seconds) == (500.0, 2, "gpu", 1000.0)


def test_a_hang_outside_communication_counts_nothing_and_a_late_stop_counts_zero() -> None:
    gloo = backend_default("gloo")
    assert gloo is not None
    rec = time_saved(gloo, 0.0, 10.0, "j", _sample(False), in_communication=False)
    assert rec.saved_s is None and rec.gpu_seconds is None and rec.to_json()["not_counted"] == NOT_IN_COMMUNICATION
    assert rec.line() == f"time saved: none counted ({NOT_IN_COMMUNICATION})"
    late = time_saved(gloo, 0.0, 1900.0, "j", _sample(False))
    assert late.saved_s == 0.0  # past the deadline: never negative


def test_the_incidents_own_flight_recorder_dumps_come_first(tmp_path: Path) -> None:
    d = fr_dir(tmp_path)
    d.mkdir(parents=True)
    real = DATA / "real-gpu" / "nccl-hang" / "flight-recorder"
    for r in (0, 1):
        shutil.copy(real / f"nccl_trace_rank_{r}", d / f"fr-rank-{r}.pkl")
    groups = {0: {"groups": [{"name": "0", "timeout_s": 900.0}]}}
    from_fr = deadline_at_incident(tmp_path, groups, "nccl")
    assert (from_fr.source, from_fr.timeout_s) == ("flight_recorder", 30.0)
    assert deadline_at_incident(tmp_path / "none", groups, "nccl").source == "client"
    assert deadline_at_incident(tmp_path / "none", {}, "nccl").timeout_s == 600.0
    unknown = deadline_at_incident(tmp_path / "none", {}, None)
    assert unknown.source == "unknown" and unknown.timeout_s is None
