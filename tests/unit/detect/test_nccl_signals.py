"""The detector on what a real NCCL job shows, not on what a gloo job shows.

The three captures from an H200 (tests/data/real-gpu/, copied unchanged from ../shared/real-gpu/: two NCCL ranks
on one GPU) replay with ``[detect] confirm_after_s = 8``: the hang (rank 1 blocked in its own code, rank 0
spinning at 2 cores in ``loss.item()`` behind DDP's all-reduce) is a stall; the slow save (rank 0 writes for 30 s
while rank 1 spins in the next all-reduce) waits on rank 0; the big all-reduces give nothing. Then the same
captures changed the ways other machines differ — polling at other rates, polling on NVLink, traffic counters
unsupported, the memory controller reported — must give the same verdicts, and a GPU drawing real power must not
(the signature is what finds the hang). NCCL RAS counts (``CommProgress``) and stale heartbeats are tested on
the synthetic node of test_detector.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.detector import RUNNING, SUSPECT, WAITING, DetectorState, device_signature, step, traffic_rate
from gpu_watchdog.model import CommProgress, DeviceSample, Finding, NodeSample
from gpu_watchdog.sample.trace import read_trace
from repo_paths import TESTS
from test_detector import JOB, Node, run, stall_findings

CAPTURES = TESTS / "data" / "real-gpu"
CFG8 = dataclasses.replace(DetectConfig(), confirm_after_s=8.0)
GIB, MIB = 1 << 30, 1 << 20


def samples_of(name: str) -> list[NodeSample]:
    _head, records = read_trace(CAPTURES / name / "nvml.trace")
    return [r for r in records if isinstance(r, NodeSample)]


def replay(samples: Sequence[NodeSample], cfg: DetectConfig = CFG8) -> tuple[list[Finding], list[DetectorState]]:
    state, findings, states = DetectorState(), [], []
    for s in samples:
        state, new = step(state, s, cfg)
        findings += new
        states.append(state)
    return findings, states


def devices(samples: Sequence[NodeSample], fn: Callable[[int, DeviceSample], DeviceSample]) -> list[NodeSample]:
    return [dataclasses.replace(s, devices=tuple(fn(i, d) for d in s.devices)) for i, s in enumerate(samples)]


def the_job(states: Sequence[DetectorState]):  # noqa: ANN201 - JobStatus
    (js,) = states[-1].jobs.values()
    return js


# -- the captures as recorded ---------------------------------------------------------------------------------
def test_the_real_nccl_hang_is_a_stall_confirmed_8_s_after_its_onset() -> None:
    samples = samples_of("nccl-hang")
    findings, _ = replay(samples)
    (f,) = findings
    assert (f.kind, f.signature) == ("stall", "spin"), f
    # The hang began before the recording: the streak starts at the first sample, confirmed 8 s later.
    assert f.onset == samples[0].t and f.confirmed_at - f.onset == pytest.approx(8.0, abs=0.05)


def test_the_real_slow_save_waits_on_rank_0_and_is_never_a_stall() -> None:
    findings, states = replay(samples_of("slow-save"))
    assert findings == []
    js = the_job(states)
    assert js.state == WAITING and js.waiting_on == (0,), js
    assert all(st.jobs[js.job_id].state in (RUNNING, WAITING) for st in states)


def test_the_real_big_all_reduces_run() -> None:
    findings, states = replay(samples_of("big-allreduce"))
    assert findings == []
    assert all(st.jobs[the_job(states).job_id].state == RUNNING for st in states)


def test_the_default_config_is_as_quiet_on_the_healthy_captures() -> None:
    for name in ("slow-save", "big-allreduce"):
        assert replay(samples_of(name), DetectConfig())[0] == [], name


# -- the traffic counters -------------------------------------------------------------------------------------
def test_a_wrapped_counter_never_turns_into_a_rate() -> None:
    """The capture's PCIe rx counter wrapped at 2^32 once (-4016 MiB/s as a naive delta): no rate comes from it,
    the tx counter alone still tells, and with both wrapped there is no rate at all."""
    samples = samples_of("nccl-hang")
    rates = []
    for a, b in zip(samples, samples[1:], strict=False):
        (da,), (db,) = a.devices, b.devices
        rates.append(traffic_rate(db, (a.t, (da.pcie_tx_bytes_total, da.pcie_rx_bytes_total, None, None)), b.t))
    assert all(r is not None and 0 <= r < 200 * MIB for r in rates), rates
    assert min(rates) < 50 * MIB  # the tick where rx wrapped: tx (~37 MiB/s) alone
    d = dataclasses.replace(samples[1].devices[0], pcie_tx_bytes_total=5, pcie_rx_bytes_total=7)
    assert traffic_rate(d, (samples[0].t, (10, 10, None, None)), samples[1].t) is None


def test_polling_traffic_does_not_veto_the_spin_but_data_does() -> None:
    (d,) = samples_of("nccl-hang")[1].devices
    assert device_signature(d, CFG8, 120 * MIB, frozenset()) == "spin"
    assert device_signature(d, CFG8, 400 * MIB, frozenset()) == "spin"
    assert device_signature(d, CFG8, 2 * GIB, frozenset()) == "busy"
    gen5 = dataclasses.replace(d, pcie_link_bytes_per_s=63e9)  # 5 % of a Gen5 x16 link: 3.1 GB/s is still polling
    assert device_signature(gen5, CFG8, 2 * GIB, frozenset()) == "spin"
    assert device_signature(gen5, CFG8, 8 * GIB, frozenset()) == "busy"


@pytest.mark.parametrize(("mem_util", "power_w", "bps", "sig"), [
    (0.0, 118.0, 3 * GIB, "spin"),  # the memory controller idle: traffic is not asked
    (45.0, 118.0, 0.0, "busy"),  # moving memory: working, whatever the power
    (0.0, 600.0, 0.0, "busy"),  # drawing power: working
    (0.0, None, 3 * GIB, "spin"),  # power unsupported: the memory controller alone tells
    (None, None, 0.0, "busy"),  # neither: utilization alone is not a spin
])
def test_the_memory_controller_tells_a_spin_from_work(mem_util: float | None, power_w: float | None,
                                                       bps: float, sig: str) -> None:
    (d,) = samples_of("nccl-hang")[1].devices
    d = dataclasses.replace(d, mem_util_percent=mem_util, power_w=power_w)
    assert device_signature(d, CFG8, bps, frozenset()) == sig


# -- the captures as other machines would show them -----------------------------------------------------------
def _scaled_pcie(factor: float) -> Callable[[int, DeviceSample], DeviceSample]:
    """Polling ``factor`` times faster: the counters grow ``factor`` times as much per tick (32-bit wraps)."""
    def fn(i: int, d: DeviceSample) -> DeviceSample:
        tx = int((d.pcie_tx_bytes_total or 0) * factor) % (1 << 32)
        rx = int((d.pcie_rx_bytes_total or 0) * factor) % (1 << 32)
        return dataclasses.replace(d, pcie_tx_bytes_total=tx, pcie_rx_bytes_total=rx)
    return fn


def _on_nvlink(rate: float) -> Callable[[int, DeviceSample], DeviceSample]:
    """NCCL polling over NVLink (P2P transport): PCIe quiet, NVLink counters growing at ``rate``."""
    def fn(i: int, d: DeviceSample) -> DeviceSample:
        return dataclasses.replace(d, pcie_tx_bytes_total=0, pcie_rx_bytes_total=0,
                                   nvlink_tx_bytes_total=int(i * rate), nvlink_rx_bytes_total=int(i * rate))
    return fn


def _unsupported(i: int, d: DeviceSample) -> DeviceSample:
    return dataclasses.replace(d, pcie_tx_bytes_total=None, pcie_rx_bytes_total=None,
                               unsupported=("traffic",))


def _mem_idle_heavy_polling(i: int, d: DeviceSample) -> DeviceSample:
    """A newer NVML reports the memory controller: idle while spinning, however much the link polls."""
    return dataclasses.replace(d, mem_util_percent=0.0, nvlink_tx_bytes_total=int(i * 3 * GIB),
                               nvlink_rx_bytes_total=int(i * 3 * GIB))


VARIANTS = {"polling x3": _scaled_pcie(3.0), "polling x0.2": _scaled_pcie(0.2), "nvlink polling": _on_nvlink(250 * MIB),
            "counters unsupported": _unsupported, "memory controller idle": _mem_idle_heavy_polling}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_same_verdicts_on_other_machines(variant: str) -> None:
    fn = VARIANTS[variant]
    (f,) = replay(devices(samples_of("nccl-hang"), fn))[0]
    assert f.signature == "spin" and f.confirmed_at - f.onset == pytest.approx(8.0, abs=0.05)
    findings, states = replay(devices(samples_of("slow-save"), fn))
    assert findings == [] and the_job(states).waiting_on == (0,)
    assert replay(devices(samples_of("big-allreduce"), fn))[0] == []


def test_a_gpu_that_draws_power_is_working_so_the_same_hosts_are_no_stall() -> None:
    """The control: the hang's hosts with a GPU at 85 % of its power limit (a long kernel that really works)
    is rank 0 computing while rank 1 waits — waiting, not a stall within the capture."""
    findings, states = replay(devices(samples_of("nccl-hang"), lambda i, d: dataclasses.replace(d, power_w=600.0)))
    assert findings == [] and the_job(states).state == WAITING


def test_big_all_reduces_with_the_memory_controller_busy_are_never_a_spin() -> None:
    samples = devices(samples_of("big-allreduce"), lambda i, d: dataclasses.replace(d, mem_util_percent=35.0))
    assert all(device_signature(s.devices[0], CFG8, None, frozenset()) == "busy" for s in samples
               if (s.devices[0].util_percent or 0) > 5)


# -- NCCL's counts (RAS) ---------------------------------------------------------------------------------------
def _ras(samples: Sequence[NodeSample], state: str, behind: tuple[int, ...] = (), every: int = 2,
         start: int = 0) -> dict[int, list[CommProgress]]:
    return {i: [CommProgress(JOB, s.t, state, behind, "NCCL RAS at test")]
            for i, s in enumerate(samples) if i >= start and (i - start) % every == 0}


def run_with(samples: list[NodeSample], comm: dict[int, list[CommProgress]],
             cfg: DetectConfig = CFG8) -> tuple[list[Finding], list[DetectorState]]:
    state, findings, states = DetectorState(), [], []
    for i, s in enumerate(samples):
        state, new = step(state, s, cfg, (), comm.get(i, ()))
        findings += new
        states.append(state)
    return findings, states


def _culprit_blocked_peers_busy(node: Node, k: int) -> list[NodeSample]:
    """Rank 1 blocked (no CPU, its GPU idle), ranks 0, 2, 3 busy-waiting at 2 cores on GPUs that look working (no
    memory-controller reading, real-looking power and traffic): without NCCL's counts the job waits on ranks 0, 2, 3
    until waiting_timeout_s."""
    return [node.tick(util=[100.0, 0.0, 100.0, 100.0], power_w=[400.0, 70.0, 400.0, 400.0],
                      cpu_cores=[2.0, 0.0, 2.0, 2.0], traffic_bps=[2e9, 0, 2e9, 2e9]) for _ in range(k)]


def test_without_counts_a_busy_waiting_peer_hides_the_hang() -> None:
    node = Node()
    samples = node.healthy(3) + _culprit_blocked_peers_busy(node, 30)
    findings, states = run_with(samples, {})
    assert findings == [] and states[-1].jobs[JOB].state == WAITING


def test_frozen_unequal_counts_name_the_rank_behind_and_the_others_cpu_is_no_progress() -> None:
    node = Node()
    samples = node.healthy(3) + _culprit_blocked_peers_busy(node, 30)
    findings, states = run_with(samples, _ras(samples, "frozen_unequal", (1,), start=3))
    (f,) = stall_findings_of(findings)
    assert f.culprit_ranks == (1,) and "rank(s) 1 behind" in f.detail, f
    assert f.onset == samples[2].t and f.confirmed_at - f.onset <= 8.05
    assert any(st.jobs[JOB].state == SUSPECT for st in states)


def stall_findings_of(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.kind == "stall"]


def test_frozen_unequal_with_the_rank_behind_writing_is_waiting_on_it() -> None:
    """The slow save: rank 0 behind (it writes a checkpoint), the others inside the next all-reduce."""
    node = Node()
    healthy = node.healthy(3)
    busy = [node.tick(util=[0.0, 100.0, 100.0, 100.0], power_w=[70.0, 400.0, 400.0, 400.0],
                      cpu_cores=[0.01, 2.0, 2.0, 2.0], io_bps=[1.2e6, 0, 0, 0], traffic_bps=[0, 2e9, 2e9, 2e9])
            for _ in range(40)]
    samples = healthy + busy
    findings, states = run_with(samples, _ras(samples, "frozen_unequal", (0,), start=3))
    assert findings == []
    js = states[-1].jobs[JOB]
    assert js.state == WAITING and js.waiting_on == (0,), js


def test_moving_counts_are_progress_whatever_the_hosts_and_gpus_show() -> None:
    node = Node()
    samples = node.healthy(3) + node.spin(40)  # every GPU spins, no host moves: a stall without the counts
    assert stall_findings(run(samples, CFG8))
    findings, states = run_with(samples, _ras(samples, "moving", every=1))
    assert findings == [] and states[-1].jobs[JOB].state == RUNNING


def test_frozen_equal_counts_with_spinning_gpus_are_a_hang_inside_the_collective() -> None:
    """Every rank launched the same collectives and none completes (a transport hang): their 2 cores of
    busy-waiting are no progress, and the finding says where the hang is."""
    node = Node()
    samples = node.healthy(3) + [node.tick(util=100.0, power_w=100.0, cpu_cores=2.0, traffic_bps=0.0)
                                 for _ in range(30)]
    findings, _ = run_with(samples, _ras(samples, "frozen_equal", start=3))
    (f,) = stall_findings_of(findings)
    assert f.signature == "spin" and f.culprit_ranks == () and "inside a launched collective" in f.detail


def test_frozen_equal_counts_on_working_gpus_are_a_compute_phase() -> None:
    """Between two collectives the counts are equal and still: with GPUs at real power that is compute."""
    node = Node()
    samples = node.healthy(3) + [node.tick(util=100.0, power_w=600.0, cpu_cores=1.0) for _ in range(30)]
    findings, states = run_with(samples, _ras(samples, "frozen_equal", start=3))
    assert findings == [] and states[-1].jobs[JOB].state == RUNNING


def test_old_counts_are_no_evidence() -> None:
    node = Node()
    samples = node.healthy(3) + _culprit_blocked_peers_busy(node, 40)
    cfg = dataclasses.replace(CFG8, comm_progress_max_age_s=5.0)
    findings, states = run_with(samples, {3: [CommProgress(JOB, samples[3].t, "frozen_unequal", (1,))]}, cfg)
    assert findings == [] and states[-1].jobs[JOB].state == WAITING


# -- step heartbeats --------------------------------------------------------------------------------------------
def test_a_heartbeat_that_stops_makes_the_busy_waiting_job_stall() -> None:
    """In-job client heartbeats every tick, then none while every rank busy-waits at 2 cores on GPUs that look
    working: after 5 step times the CPU is no longer progress and two quiet stack dumps would confirm it —
    without stacks, a GPU that looks busy is never confirmed by time alone."""
    node = Node()
    healthy = node.healthy(2)
    beating = [node.tick(util=100.0, power_w=400.0, cpu_cores=2.0, heartbeat=True) for _ in range(10)]
    stuck = [node.tick(util=100.0, power_w=400.0, cpu_cores=2.0) for _ in range(40)]
    r = run(healthy + beating + stuck, CFG8)
    states = [st.jobs[JOB].state for st in r.states]
    assert states[11] == RUNNING and SUSPECT in states[12 + 5:12 + 9], states
    assert r.findings == []  # a busy-looking GPU: stacks decide, not time
    assert r.job().needs_stacks or r.job().state == SUSPECT


def test_a_heartbeat_that_stops_on_an_idle_gpu_is_a_stall_by_time() -> None:
    node = Node()
    healthy = node.healthy(2)
    beating = [node.tick(util=0.0, power_w=70.0, cpu_cores=1.0, traffic_bps=0.0, heartbeat=True)
               for _ in range(10)]
    stuck = [node.tick(util=0.0, power_w=70.0, cpu_cores=1.0, traffic_bps=0.0) for _ in range(40)]
    r = run(healthy + beating + stuck, CFG8)
    (f,) = stall_findings(r)
    assert f.onset >= stuck[0].t and f.confirmed_at - stuck[0].t <= 5 * 1.0 + 8 + 1


def test_a_slow_step_within_its_rhythm_is_not_stale() -> None:
    """Steps of 4 s (a heartbeat every fourth tick) with the host busy between them: never suspect."""
    node = Node()
    samples = node.healthy(2)
    for i in range(40):
        samples.append(node.tick(util=0.0, power_w=70.0, cpu_cores=1.0, traffic_bps=0.0, heartbeat=(i % 4 == 0)))
    r = run(samples, CFG8)
    assert r.findings == [] and all(st.jobs[JOB].state == RUNNING for st in r.states)


def test_the_captures_are_copied_unchanged() -> None:
    shared = Path(TESTS).parent.parent / "shared" / "real-gpu"
    if not shared.is_dir():
        pytest.skip("../shared/real-gpu is not beside this checkout")
    for name in ("nccl-hang", "slow-save", "big-allreduce"):
        assert (CAPTURES / name / "nvml.trace").read_bytes() == (shared / name / "nvml.trace").read_bytes()
