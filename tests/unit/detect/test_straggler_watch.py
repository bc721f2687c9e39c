"""The straggler watch (detect.stragglers): scripted stack rounds stand in for py-spy, so its windows, its one
finding per rank and run, its hang rule and its causes are checked in seconds. The GPU under the slow rank is
the NVML stand-in's, read by ``gpu-watchdog record --backend nvml`` through the real pynvml."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

import pytest
from gpu_samples import one_gpu_per_rank_one_hot
from gpu_watchdog.config.load import config_from_dict
from gpu_watchdog.detect import stragglers
from gpu_watchdog.detect.detector import RUNNING, STALLED, SUSPECT
from gpu_watchdog.evidence.straggler.causes import HostCounters
from gpu_watchdog.model import JobStatus, NodeSample
from nvml_standin import NvmlStandin
from nvml_standin.fixtures import nvml_standin as _nvml_standin_fixture  # noqa: F401
from nvml_standin.fixtures import nvml_standin_lib as _nvml_standin_lib_fixture  # noqa: F401

PIDS = {0: 1001, 1: 1002, 2: 1003}
# The stack rounds alone (the cheap signal would read whatever processes hold these pids here: test_straggler_signals)
CFG = config_from_dict({"straggler": {"interval_s": 0.001, "window_s": 16.0, "slices": 4, "signals": False}})


def _rounds(monkeypatch: pytest.MonkeyPatch, slow: int | None, cpu_s: float = 0.0) -> None:
    """take_round answers at once: ``slow`` computes, the others wait in a collective; each round "cost" ``cpu_s``."""
    def take_round(rank_pids: Mapping[int, int], cfg, gpu, devices, t: float):
        states = {r: "compute" if r == slow else "collective" for r in rank_pids}
        return stragglers.Round(t, states, {r: HostCounters() for r in rank_pids}, cpu_s, {})
    monkeypatch.setattr(stragglers, "take_round", take_round)
    monkeypatch.setattr(stragglers, "DUMP_CPU_S", cpu_s / len(PIDS))  # what the first round is expected to cost


def _run(watch: stragglers.StragglerWatch, js: JobStatus, sample: NodeSample, seconds: int, start: float = 0.0,
         state_at=lambda t: RUNNING) -> list:
    """One tick per sample second; each round collected before the next tick."""
    found = []
    for i in range(seconds):
        t = start + i
        status = replace(js, state=state_at(t))
        found += watch.watch({js.job_id: status}, replace(sample, t=t))
        w = watch._jobs.get(js.job_id)
        deadline = time.monotonic() + 5
        while w is not None and w.pending is not None and not w.pending.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.002)  # past the interval
    return found


JOB = JobStatus("j", ranks=(0, 1, 2), rank_pids=PIDS)
BARE = NodeSample(t=0.0, hostname="node-a", backend="proc")


def test_one_finding_per_rank_and_run_after_a_whole_window_observe_only(monkeypatch) -> None:
    _rounds(monkeypatch, slow=1)
    watch = stragglers.StragglerWatch(lambda: CFG)
    assert _run(watch, JOB, BARE, 15) == []  # less than one window
    found = _run(watch, JOB, BARE, 30, start=15)
    assert len(found) == 1  # named once, though it stays slow
    f = found[0]
    assert (f.kind, f.signature, f.culprit_ranks, f.ranks, f.basis) == ("straggler", "slow_rank", (1,), (0, 1, 2),
                                                                       "stacks")
    assert f.facts["rank"] == 1 and f.facts["pid"] == 1002 and f.facts["host"] == "node-a"
    assert f.facts["wait_share"] == 0.0 and f.facts["peer_wait_share"] == 1.0 and f.facts["score"] == 1.0
    assert f.facts["causes"] == [] and "cause: none visible on this node" in f.detail
    assert watch.rank_scores()["j"][1] == (0.0, 1.0, True) and watch.rank_scores()["j"][0][2] is False
    from gpu_watchdog.policy.respond import RECORD, respond
    assert respond(f, CFG, supervised=True).action == RECORD  # never recover, whatever the job
    watch.forget("j")  # a restart: a new run, and the rank may be named again
    assert len(_run(watch, JOB, BARE, 20, start=50)) == 1


def test_a_uniform_job_and_a_stall_name_nobody(monkeypatch) -> None:
    _rounds(monkeypatch, slow=None)
    watch = stragglers.StragglerWatch(lambda: CFG)
    assert _run(watch, JOB, BARE, 40) == []
    assert set(watch.rank_scores()["j"].values()) == {(1.0, 0.0, False)}
    # Rank 1 "slow" through a confirmed stall: a hang is the hang detector's; the window starts again after it.
    _rounds(monkeypatch, slow=1)
    watch = stragglers.StragglerWatch(lambda: CFG)
    assert _run(watch, JOB, BARE, 40, state_at=lambda t: STALLED if t % 10 == 9 else RUNNING) == []
    # Suspect (peers idle, a starved rank crawling) is sampled on.
    assert len(_run(watch, JOB, BARE, 20, start=40, state_at=lambda t: SUSPECT)) == 1


def test_single_rank_jobs_are_sampled_only_when_their_world_is_larger(monkeypatch) -> None:
    from gpu_watchdog.model import JobIdentity, ProcessSample
    _rounds(monkeypatch, slow=None)
    lone = JobStatus("solo", ranks=(0,), rank_pids={0: 2001})
    watch = stragglers.StragglerWatch(lambda: CFG)
    _run(watch, lone, BARE, 5)
    assert watch.rank_scores() == {}
    proc = ProcessSample(pid=2001, create_time=1.0, ppid=1, status="running", cpu_time_s=0.0, io_bytes=None,
                         rss_bytes=0, cmdline=("python",), job=JobIdentity("solo", rank=0, world_size=8), is_rank=True)
    _run(watch, lone, replace(BARE, processes=(proc,)), 5, start=5)
    assert watch.rank_scores() == {"solo": {0: (1.0, 0.0, False)}}  # its wait share, for the cross-node rule


def test_the_slow_ranks_throttled_gpu_is_named_thermal(monkeypatch, nvml_standin: NvmlStandin, tmp_path) -> None:
    """The NVML stand-in plays three GPUs, the slow rank's hot (thermal slowdown, SM clock 1140 of 1980 MHz):
    the finding names that GPU and "thermal"."""
    sample = one_gpu_per_rank_one_hot(nvml_standin, tmp_path, PIDS, [{"utilization_gpu": 97}] * len(PIDS), hot=1)
    _rounds(monkeypatch, slow=1)
    watch = stragglers.StragglerWatch(lambda: CFG)
    found = _run(watch, JOB, sample, 20)
    assert len(found) == 1
    f = found[0]
    hot = sample.devices[1]
    assert f.devices == (hot.uuid,) and f.facts["gpu"] == {"index": 1, "uuid": hot.uuid}
    gpu = [c for c in f.facts["causes"] if c["kind"] == "gpu_clocks"]
    assert len(gpu) == 1 and "thermal" in gpu[0]["detail"] and "SM clock 1140 of 1980 MHz" in gpu[0]["detail"]
    assert "thermal" in f.detail


def test_rounds_that_cost_more_than_the_budget_are_spaced_and_the_window_stretches(monkeypatch) -> None:
    """The budget (a share of one core, split between the jobs sampled) spaces the rounds; the window stretches with
    them, so it holds as many samples: only the naming comes later."""
    assert stragglers.pace(30.0, None, 0.0005) == 30.0  # nothing measured yet
    assert stragglers.pace(30.0, 0.010, 0.0005) == 30.0  # 10 ms a round: 0.033 % of a core, within 0.05 %
    assert stragglers.pace(30.0, 0.060, 0.0005) == pytest.approx(120.0)  # 60 ms (a Ray worker group): every 2 min
    cfg = config_from_dict({"straggler": {"interval_s": 0.001, "window_s": 16.0, "slices": 4,
                                          "cpu_budget_percent": 0.1}})
    _rounds(monkeypatch, slow=1, cpu_s=0.000002)  # 2 µs a round against 1 µs of budget a round: every 2 ms
    watch = stragglers.StragglerWatch(lambda: cfg)
    assert _run(watch, JOB, BARE, 20) == []  # 20 s of samples: a whole 16 s window, not a 32 s one
    assert watch._jobs["j"].stretch == pytest.approx(2.0)
    found = _run(watch, JOB, BARE, 20, start=20)
    assert len(found) == 1 and found[0].facts["window_s"] == pytest.approx(32.0)
