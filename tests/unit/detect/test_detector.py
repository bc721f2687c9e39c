"""The detector as a pure function: hand-built NodeSamples in, states and findings out. No processes, no clock."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import pytest
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.detector import (
    RUNNING,
    STALLED,
    SUSPECT,
    WAITING,
    DetectorState,
    device_signature,
    stacks_show_progress,
    step,
)
from gpu_watchdog.model import (
    DeviceSample,
    Finding,
    GpuFault,
    GpuProcess,
    JobIdentity,
    JobStatus,
    NodeSample,
    ProcessSample,
    RankStack,
    StackEvidence,
    unknown_rank,
)

GIB = 1 << 30
T0 = 1_700_000_000.0
CFG = DetectConfig()
JOB = "job-a"


@dataclass
class Node:
    """A node running one job, one rank per GPU; each tick advances the counters by the given rates."""

    n: int = 4
    dt: float = 1.0
    t: float = T0
    cpu: list[float] = field(default_factory=list)
    io: list[int] = field(default_factory=list)
    traffic: list[int] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    steps: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cpu = [10.0] * self.n
        self.io = [0] * self.n
        self.traffic = [0] * self.n
        self.pids = [1000 + r for r in range(self.n)]
        self.steps = [None] * self.n

    def tick(self, util: float | Sequence[float] = 95.0, power_w: float | Sequence[float] = 500.0,
             cpu_cores: float | Sequence[float] = 1.0, io_bps: float | Sequence[float] = 0.0,
             traffic_bps: float | Sequence[float] = 5e9, mem: int = 40 * GIB, limit_w: float | None = 700.0,
             present: Iterable[int] | None = None, faults: dict[int, GpuFault] | None = None,
             status: str = "sleeping", virtual: bool = False, heartbeat: bool = False) -> NodeSample:
        self.t += self.dt
        ranks = list(range(self.n)) if present is None else list(present)
        devices, procs = [], []
        for r in range(self.n):
            self.cpu[r] += _at(cpu_cores, r) * self.dt
            self.io[r] += int(_at(io_bps, r) * self.dt)
            self.traffic[r] += int(_at(traffic_bps, r) * self.dt)
            if heartbeat:
                self.steps[r] = (self.steps[r] or 0) + 1
            here = r in ranks
            fault = (faults or {}).get(r)
            devices.append(DeviceSample(
                index=r, uuid=f"GPU-{r}", name="H100", util_percent=None if fault else _at(util, r),
                mem_used_bytes=mem if here else 0, mem_total_bytes=80 * GIB,
                power_w=_at(power_w, r), power_limit_w=limit_w,
                pcie_tx_bytes_total=self.traffic[r], pcie_rx_bytes_total=self.traffic[r],
                processes=(GpuProcess(self.pids[r], mem),) if here else (), fault=fault, virtual=virtual))
            if here:
                procs.append(ProcessSample(
                    pid=self.pids[r], create_time=T0 - 1000 + r, ppid=1, status=status, cpu_time_s=self.cpu[r],
                    io_bytes=self.io[r], rss_bytes=2 * GIB, job=JobIdentity(JOB, r, r, self.n), is_rank=True,
                    heartbeat_step=self.steps[r]))
        return NodeSample(t=self.t, hostname="node", backend="nvml", devices=tuple(devices),
                          processes=tuple(procs))

    def healthy(self, k: int) -> list[NodeSample]:
        return [self.tick() for _ in range(k)]

    def idle_held(self, k: int) -> list[NodeSample]:
        return [self.tick(util=0.0, power_w=70.0, cpu_cores=0.0, traffic_bps=0.0) for _ in range(k)]

    def spin(self, k: int) -> list[NodeSample]:
        return [self.tick(util=99.0, power_w=20.0, cpu_cores=0.0, traffic_bps=0.0) for _ in range(k)]


def _at(v: float | Sequence[float], i: int) -> float:
    return v if isinstance(v, (int, float)) else v[i]


@dataclass
class Run:
    states: list[DetectorState]
    findings: list[Finding]

    def job(self, i: int = -1) -> JobStatus:
        return self.states[i].jobs[JOB]


def run(samples: Sequence[NodeSample], cfg: DetectConfig = CFG,
        stacks: dict[int, list[StackEvidence]] | None = None, state: DetectorState | None = None) -> Run:
    """Step through samples; ``stacks`` maps a sample index to the evidence passed in with it."""
    state = state or DetectorState()
    states, findings = [], []
    for i, s in enumerate(samples):
        state, new = step(state, s, cfg, (stacks or {}).get(i, ()))
        states.append(state)
        findings.extend(new)
    return Run(states, findings)


def stall_findings(r: Run) -> list[Finding]:
    return [f for f in r.findings if f.kind == "stall"]


# -- device signatures ------------------------------------------------------------------------------------
def dev(util: float | None, power: float | None = 500.0, limit: float | None = 700.0, mem: int = 40 * GIB,
        virtual: bool = False) -> DeviceSample:
    return DeviceSample(0, "GPU-0", "H100", util_percent=util, mem_used_bytes=mem, power_w=power,
                        power_limit_w=limit, processes=(GpuProcess(1, mem),), virtual=virtual)


@pytest.mark.parametrize(("d", "bps", "sig"), [
    (dev(0.0), None, "idle_held"),
    (dev(5.0), None, "idle_held"),
    (dev(0.0, mem=100 << 20), None, "busy"),  # idle but holding nothing: not a stalled job's GPU
    (dev(99.0, power=20.0), 0.0, "spin"),  # signature B: util 99 at 20 W of 700 W, no traffic
    (dev(99.0, power=20.0), None, "spin"),  # traffic counters unsupported: power decides
    (dev(99.0, power=500.0), 0.0, "busy"),  # same util at real power: working
    (dev(99.0, power=20.0), 1e9, "busy"),  # same util with traffic: moving data
    (dev(99.0, power=20.0, limit=None), 0.0, "busy"),  # no limit known and no absolute threshold
    (dev(50.0, power=20.0), 0.0, "busy"),
    (dev(None), 0.0, None),
])
def test_device_signature(d: DeviceSample, bps: float | None, sig: str | None) -> None:
    assert device_signature(d, CFG, bps, frozenset({1})) == sig


def test_device_signature_absolute_power_threshold() -> None:
    cfg = dataclasses.replace(CFG, spin_power_max_w=80.0)
    assert device_signature(dev(99.0, power=60.0, limit=None), cfg, 0.0, frozenset({1})) == "spin"
    assert device_signature(dev(99.0, power=90.0, limit=None), cfg, 0.0, frozenset({1})) == "busy"


def test_device_signature_counts_only_the_jobs_memory() -> None:
    d = DeviceSample(0, "GPU-0", "H100", util_percent=0.0, mem_used_bytes=60 * GIB,
                     processes=(GpuProcess(1, 10 << 20), GpuProcess(2, 59 * GIB)))
    assert device_signature(d, CFG, None, frozenset({1})) == "busy"  # pid 1 holds 10 MiB only
    assert device_signature(d, CFG, None, frozenset({2})) == "idle_held"
    unknown = dataclasses.replace(d, processes=(GpuProcess(1, None),))  # per-process memory not available
    assert device_signature(unknown, CFG, None, frozenset({1})) == "idle_held"  # the device total decides


def test_virtual_devices_use_the_rss_threshold() -> None:
    assert device_signature(dev(0.0, mem=20 << 20, virtual=True), CFG, None, frozenset()) == "idle_held"
    assert device_signature(dev(0.0, mem=5 << 20, virtual=True), CFG, None, frozenset()) == "busy"


# -- healthy ------------------------------------------------------------------------------------------
def test_a_healthy_job_never_stalls() -> None:
    node = Node()
    r = run(node.healthy(120))
    assert r.findings == [] and {s.jobs[JOB].state for s in r.states} == {RUNNING}
    assert r.job().ranks == (0, 1, 2, 3) and r.job().devices == ("GPU-0", "GPU-1", "GPU-2", "GPU-3")


def test_a_job_that_starts_idle_gets_the_benefit_of_the_doubt() -> None:
    r = run(Node().idle_held(1))  # first sight: nothing to compare, counts as progress
    assert r.findings == [] and r.job().state == RUNNING and r.job().onset is None


# -- signature A and B --------------------------------------------------------------------------------
@pytest.mark.parametrize(("phase", "sig"), [("idle_held", "idle_held"), ("spin", "spin")])
def test_signature_detected_with_onset_at_the_last_progress(phase: str, sig: str) -> None:
    node = Node()
    samples = node.healthy(10) + getattr(node, phase)(60)
    last_progress = samples[9].t
    r = run(samples)
    (f,) = r.findings
    assert (f.kind, f.signature, f.job_id, f.basis) == ("stall", sig, JOB, "time")
    assert f.onset == last_progress
    assert f.confirmed_at == last_progress + CFG.confirm_after_s
    assert f.ranks == (0, 1, 2, 3) and f.culprit_ranks == () and f.devices == ("GPU-0", "GPU-1", "GPU-2", "GPU-3")
    # The way there: running, then suspect (asking for stacks) after suspect_after_s, then stalled.
    by_t = {s.t: s.jobs[JOB] for s in r.states}
    assert by_t[last_progress + 1].state == RUNNING and by_t[last_progress + 1].onset == last_progress
    assert by_t[last_progress + CFG.suspect_after_s].state == SUSPECT
    assert by_t[last_progress + CFG.suspect_after_s].needs_stacks
    assert by_t[f.confirmed_at - 1].state == SUSPECT and by_t[f.confirmed_at].state == STALLED
    assert r.job().state == STALLED and not r.job().needs_stacks


@pytest.mark.parametrize("kwargs", [
    {"util": 99.0, "power_w": 450.0, "traffic_bps": 0.0},  # high power: real compute
    {"util": 99.0, "power_w": 20.0, "traffic_bps": 2e9},  # high traffic: a real collective
    {"util": 99.0, "power_w": 450.0, "traffic_bps": 2e9},
])
def test_high_util_with_power_or_traffic_is_not_a_stall(kwargs: dict) -> None:
    node = Node()
    samples = node.healthy(5) + [node.tick(cpu_cores=0.0, **kwargs) for _ in range(120)]
    r = run(samples)
    assert r.findings == [] and r.job().state == RUNNING


def test_cpu_io_or_heartbeat_progress_keeps_an_idle_gpu_job_running() -> None:
    for kwargs in ({"cpu_cores": 0.5}, {"cpu_cores": 0.0, "io_bps": 1e6}, {"cpu_cores": 0.0, "heartbeat": True}):
        node = Node()
        samples = node.healthy(3) + [node.tick(util=0.0, power_w=70.0, traffic_bps=0.0, **kwargs)
                                     for _ in range(60)]
        r = run(samples)
        assert r.findings == [] and r.job().state == RUNNING, kwargs


def test_below_threshold_cpu_is_not_progress() -> None:
    node = Node()
    samples = node.healthy(3) + [node.tick(util=0.0, power_w=70.0, traffic_bps=0.0, cpu_cores=0.05)
                                 for _ in range(40)]
    assert [f.signature for f in run(samples).findings] == ["idle_held"]


def test_a_zombie_rank_makes_no_progress() -> None:
    node = Node(n=1)
    samples = node.healthy(3) + [node.tick(util=0.0, cpu_cores=1.0, status="zombie") for _ in range(40)]
    assert [f.signature for f in run(samples).findings] == ["idle_held"]


def test_a_restarted_rank_with_a_new_pid_counts_as_progress_once() -> None:
    node = Node(n=2)
    samples = node.healthy(3) + node.idle_held(5)
    node.pids[1] = 5555  # rank 1 restarted: the counters of another process are not comparable
    samples += node.idle_held(1)
    r = run(samples)
    assert r.job(-2).onset == samples[2].t and r.job().state == WAITING  # rank 1 "progressed"
    r = run(samples + node.idle_held(40))
    assert [f.signature for f in r.findings] == ["idle_held"]


# -- waiting on a rank --------------------------------------------------------------------------------
def _waiting(node: Node, k: int) -> list[NodeSample]:
    """Rank 0 busy (a checkpoint save / an eval), the others idle in a barrier with memory held."""
    return [node.tick(util=[90.0] + [0.0] * (node.n - 1), power_w=[400.0] + [70.0] * (node.n - 1),
                      cpu_cores=[1.0] + [0.0] * (node.n - 1), traffic_bps=0.0) for _ in range(k)]


def test_waiting_on_a_busy_rank_is_no_finding_until_the_timeout() -> None:
    node = Node()
    samples = node.healthy(5) + _waiting(node, 120)
    r = run(samples)
    assert r.findings == []
    js = r.job()
    assert js.state == WAITING and js.waiting_on == (0,) and js.waiting_since == samples[4].t
    cfg = dataclasses.replace(CFG, waiting_timeout_s=60.0)
    r = run(samples, cfg)
    (f,) = r.findings
    assert (f.kind, f.signature, f.culprit_ranks) == ("stall", "waiting_timeout", (0,))
    assert f.onset == samples[4].t and f.confirmed_at == samples[4].t + 60.0
    assert "rank(s) 0" in f.detail


def test_waiting_then_resuming_is_healthy() -> None:
    node = Node()
    r = run(node.healthy(5) + _waiting(node, 45) + node.healthy(20))
    assert r.findings == [] and r.job().state == RUNNING and r.job().waiting_since is None


def test_waiting_rank_then_everyone_stops() -> None:
    node = Node()
    samples = node.healthy(5) + _waiting(node, 20) + node.idle_held(40)
    r = run(samples)
    (f,) = r.findings
    assert f.signature == "idle_held" and f.onset == samples[24].t  # the busy rank's last progress


def _rank_unknown(samples: list[NodeSample], r: int) -> list[NodeSample]:
    """Rank ``r`` as a member whose rank no source gave (model.unknown_rank), off the GPUs: a helper that joined
    the group, or an actor that hands init_process_group its rank as an argument."""
    out = []
    for s in samples:
        procs = tuple(dataclasses.replace(p, job=dataclasses.replace(p.job, rank=unknown_rank(p.pid)))
                      if p.job is not None and p.job.rank == r else p for p in s.processes)
        devs = tuple(d for d in s.devices if d.index != r)
        out.append(dataclasses.replace(s, processes=procs, devices=devs))
    return out


def test_a_member_of_unknown_rank_that_idles_never_makes_the_job_wait() -> None:
    """Ranks 0 and 1 train, the member of unknown rank idles (it may be no rank at all): no waiting, so no
    waiting_timeout restart however long it lasts."""
    node = Node(n=3)
    samples = _rank_unknown([node.tick(cpu_cores=[1.0, 1.0, 0.0]) for _ in range(120)], 2)
    r = run(samples, dataclasses.replace(CFG, waiting_timeout_s=60.0))
    assert r.findings == [] and r.job().state == RUNNING
    assert unknown_rank(node.pids[2]) in r.job().ranks


def test_a_member_of_unknown_rank_is_watched_and_named_when_the_job_stops() -> None:
    """Every rank idle with its GPU held: the job stalls; the member of unknown rank is one of its ranks, and the
    one named when it is the one that exited."""
    node = Node(n=3)
    samples = _rank_unknown(node.healthy(10) + [node.tick(util=0.0, power_w=70.0, cpu_cores=0.0, traffic_bps=0.0,
                                                          present=(0, 1)) for _ in range(40)], 2)
    (f,) = run(samples).findings
    gone = unknown_rank(node.pids[2])
    assert (f.signature, f.culprit_ranks, f.ranks) == ("rank_exited", (gone,), (gone, 0, 1))
    assert f"rank(s) unknown (pid {node.pids[2]}) exited" in f.detail


# -- rank exited ----------------------------------------------------------------------------------------
def test_a_rank_that_exits_while_peers_idle_is_the_culprit() -> None:
    node = Node()
    samples = node.healthy(10) + [node.tick(util=[0.0, 0.0, 0.0, 0.0], power_w=70.0, cpu_cores=0.0,
                                            traffic_bps=0.0, present=(0, 1, 2)) for _ in range(40)]
    r = run(samples)
    (f,) = r.findings
    assert (f.signature, f.culprit_ranks, f.ranks) == ("rank_exited", (3,), (0, 1, 2, 3))
    assert f.onset == samples[9].t and "rank(s) 3 exited" in f.detail
    assert f.devices == ("GPU-0", "GPU-1", "GPU-2")  # the exited rank's GPU is no longer the job's


def test_a_job_whose_ranks_all_exit_simply_ends() -> None:
    node = Node()
    samples = node.healthy(10) + [node.tick(util=0.0, present=()) for _ in range(40)]
    r = run(samples)
    assert r.findings == [] and JOB not in r.states[-1].jobs


# -- GPU faults -----------------------------------------------------------------------------------------
def test_a_gpu_fault_is_reported_at_once_and_once() -> None:
    node = Node()
    lost = {2: GpuFault("gpu_lost", "GPU 2 is lost (fell off the bus?)")}
    samples = node.healthy(5) + [node.tick(faults=lost) for _ in range(10)]
    r = run(samples)
    (f,) = r.findings
    assert (f.kind, f.signature, f.devices, f.basis) == ("gpu_fault", "gpu_lost", ("GPU-2",), "fault")
    assert f.onset == f.confirmed_at == samples[5].t and f.job_id == JOB and "lost" in f.detail
    assert r.states[-1].faulted == frozenset({"GPU-2"})
    # Healed and lost again: a new fault.
    r2 = run(node.healthy(1) + [node.tick(faults=lost)], state=r.states[-1])
    assert [f.kind for f in r2.findings] == ["gpu_fault"]


def test_a_fault_on_an_unused_gpu_names_no_job() -> None:
    node = Node()
    s = node.tick(present=(0, 1), faults={3: GpuFault("xid", "Xid 79", 79)})
    (f,) = run([s]).findings
    assert f.signature == "xid" and f.job_id is None and "jobs: none" in f.detail


# -- hysteresis -----------------------------------------------------------------------------------------
def test_a_single_busy_tick_resets_a_suspect() -> None:
    node = Node()
    samples = node.healthy(10) + node.idle_held(20) + node.healthy(1) + node.idle_held(29)
    r = run(samples)
    assert r.job(29).state == SUSPECT and r.job(30).state == RUNNING and r.job(30).onset is None
    assert r.findings == [] and r.job().state == SUSPECT and r.job().onset == samples[30].t
    r = run(samples + node.idle_held(1))
    (f,) = r.findings
    assert f.onset == samples[30].t


def test_a_confirmed_stall_clears_only_after_clear_after_s() -> None:
    node = Node()
    samples = node.healthy(10) + node.idle_held(40)  # confirmed at index 39
    n = len(samples)
    samples += node.healthy(1) + node.idle_held(3)  # a blip of progress does not clear it
    samples += node.healthy(5)
    r = run(samples)
    assert len(r.findings) == 1
    assert [r.job(i).state for i in range(n, n + 4)] == [STALLED] * 4
    # progress for clear_after_s (2 s): the first progress tick plus two more
    states = [r.job(i).state for i in range(n + 4, n + 9)]
    assert states == [STALLED, STALLED, RUNNING, RUNNING, RUNNING]
    # a new hang after clearing is a new finding
    r = run(node.idle_held(40), state=r.states[-1])
    assert len(r.findings) == 1 and r.findings[0].onset == samples[-1].t


# -- stack evidence -------------------------------------------------------------------------------------
def stacks(t: float, sigs: dict[int, str], state: str = "collective", active: bool = False) -> StackEvidence:
    return StackEvidence(JOB, t, tuple(RankStack(r, 1000 + r, state, s, active, where=f"{s} (x.py:1)")
                                       for r, s in sorted(sigs.items())))


HUNG = {0: "main;step;all_reduce", 1: "main;step;sleep", 2: "main;step;all_reduce", 3: "main;step;all_reduce"}


def run_with_caller(samples: Sequence[NodeSample], sigs_at: Callable[[float], dict[int, str]],
                    cfg: DetectConfig = CFG, **kw: object) -> tuple[Run, list[float]]:
    """Like the agent: when a tick asks for stacks, dump them (0.2 s later) and pass them in with the next tick."""
    state, states, findings, dumps = DetectorState(), [], [], []
    pending: list[StackEvidence] = []
    for s in samples:
        state, new = step(state, s, cfg, pending)
        pending = []
        states.append(state)
        findings.extend(new)
        js = state.jobs.get(JOB)
        if js is not None and js.needs_stacks:
            dumps.append(s.t + 0.2)
            pending = [stacks(s.t + 0.2, sigs_at(s.t + 0.2), **kw)]  # type: ignore[arg-type]
    return Run(states, findings), dumps


def test_two_unchanged_dumps_confirm_early() -> None:
    node = Node()
    samples = node.healthy(10) + node.idle_held(30)
    onset = samples[9].t
    r, dumps = run_with_caller(samples, lambda t: HUNG)
    (f,) = r.findings
    # asked at suspect_after_s, again stack_confirm_gap_s after the first dump; confirmed on its arrival
    assert dumps == [onset + 2.2, onset + 6.2]
    assert f.basis == "stacks" and f.onset == onset and f.confirmed_at == onset + 7.0
    assert f.confirmed_at - f.onset < CFG.confirm_after_s


def test_dumps_closer_than_the_gap_do_not_confirm() -> None:
    node = Node()
    samples = node.healthy(10) + node.idle_held(12)
    ev = {13: [stacks(samples[12].t + 0.1, HUNG)], 14: [stacks(samples[13].t + 0.1, HUNG)]}  # 1 s apart
    r = run(samples, stacks=ev)
    assert r.findings == [] and r.job().state == SUSPECT


def test_dumps_from_before_the_streak_are_ignored() -> None:
    node = Node()
    samples = node.healthy(10) + node.idle_held(12)
    ev = {3: [stacks(samples[2].t, HUNG)], 13: [stacks(samples[12].t + 0.1, HUNG)]}
    r = run(samples, stacks=ev)
    assert r.findings == [] and len(r.job().evidence) == 1


def test_a_rank_whose_stack_changes_is_waited_on_not_stalled() -> None:
    """No CPU or I/O progress shows, but rank 1's Python stack moves between dumps: slow, not stuck."""
    node = Node()
    samples = node.healthy(10) + node.idle_held(60)

    def slow_reader(t: float) -> dict[int, str]:
        return {**HUNG, 1: f"main;step;load_batch;read_chunk_{int(t)}"}

    r, dumps = run_with_caller(samples, slow_reader)
    assert r.findings == []
    js = r.job()
    assert js.state == WAITING and js.waiting_on == (1,) and "rank 1" in js.waiting_doing
    assert js.waiting_since == samples[9].t
    assert len(dumps) >= 4  # it keeps checking, every waiting_stack_interval_s


def test_moving_stacks_then_still_again_is_a_stall() -> None:
    node = Node()
    samples = node.healthy(10) + node.idle_held(60)
    stuck_at = samples[9].t + 20.0

    def reader_then_stuck(t: float) -> dict[int, str]:
        return {**HUNG, 1: f"main;step;load_batch;read_chunk_{int(min(t, stuck_at))}"}

    r, dumps = run_with_caller(samples, reader_then_stuck)
    (f,) = r.findings
    assert f.basis == "stacks" and f.onset >= stuck_at - CFG.waiting_stack_interval_s
    assert f.confirmed_at - f.onset < CFG.confirm_after_s


def test_a_hang_after_a_wait_is_judged_by_dumps_taken_since_the_job_went_quiet() -> None:
    """Seen in a clean-clone run (hf_trainer desync, confirmed 29.3 s after its onset): the job waited on rank 0
    at start-up and its two dumps then showed rank 0 moving; when every rank hung, those old dumps kept it
    "waiting on slow movers" and it was re-dumped only every waiting_stack_interval_s. Dumps from before the
    quiet stretch say what the ranks did then: the hang is suspect at once and confirmed by fresh dumps."""
    node = Node()
    samples = node.healthy(3) + _waiting(node, 12) + node.idle_held(40)
    quiet_from = samples[14].t

    def startup_then_hung(t: float) -> dict[int, str]:
        return {**HUNG, 0: f"main;init;step_{int(t)}"} if t < quiet_from else HUNG

    r, dumps = run_with_caller(samples, startup_then_hung)
    (f,) = r.findings
    assert f.basis == "stacks" and f.onset == quiet_from
    assert f.confirmed_at - f.onset <= 8.0, (f, dumps)


def test_a_busy_rank_whose_stack_moves_is_waited_on() -> None:
    node = Node()
    samples = node.healthy(5) + _waiting(node, 40)
    save = {0: "main;save;write", 1: "main;barrier", 2: "main;barrier", 3: "main;barrier"}
    save2 = {**save, 0: "main;save;serialize"}
    ev = {10: [stacks(samples[9].t, save)], 14: [stacks(samples[13].t, save2)]}
    r = run(samples, stacks=ev)
    assert r.findings == [] and r.job().state == WAITING and r.job().waiting_on == (0,)
    assert "rank 0" in r.job().waiting_doing


def test_a_busy_rank_whose_stack_never_moves_is_a_host_spin_stall() -> None:
    """Rank 0 burns CPU, but its stack sits in a device sync (its GPU spins in NCCL): no progress."""
    node = Node()
    samples = node.healthy(5) + [node.tick(util=[99.0, 0.0, 0.0, 0.0], power_w=[20.0, 70.0, 70.0, 70.0],
                                           cpu_cores=[1.0, 0.0, 0.0, 0.0], traffic_bps=0.0) for _ in range(40)]
    spin = {0: "main;step;synchronize", 1: "main;barrier", 2: "main;barrier", 3: "main;barrier"}
    ev = {10: [stacks(samples[9].t, spin, active=True)], 14: [stacks(samples[13].t, spin, active=True)]}
    r = run(samples, stacks=ev)
    (f,) = r.findings
    assert f.basis == "stacks" and f.confirmed_at == samples[14].t and f.onset == samples[4].t


def test_stacks_show_progress_unit() -> None:
    a = stacks(T0, {0: "x", 1: "y"})
    assert stacks_show_progress(a, stacks(T0 + 5, {0: "x", 1: "y"})) == {}
    assert set(stacks_show_progress(a, stacks(T0 + 5, {0: "x", 1: "z"}))) == {1}
    busy = StackEvidence(JOB, T0 + 5, (RankStack(0, 1000, "compute", "x", True, where="mm (m.py:3)"),
                                       RankStack(1, 1001, "collective", "y", True)))
    assert stacks_show_progress(a, busy) == {0: "compute at mm (m.py:3)"}


# -- determinism ------------------------------------------------------------------------------------------
def _mixed_run() -> tuple[list[NodeSample], dict[int, list[StackEvidence]]]:
    node = Node()
    samples = (node.healthy(10) + node.idle_held(35) + node.healthy(5) + _waiting(node, 10) + node.spin(40)
               + [node.tick(faults={1: GpuFault("reset_required", "GPU 1 requires a reset")})])
    return samples, {15: [stacks(samples[14].t, HUNG)], 19: [stacks(samples[18].t, HUNG)]}


def test_same_inputs_same_outputs() -> None:
    a = run(_mixed_run()[0], stacks=_mixed_run()[1])
    b = run(_mixed_run()[0], stacks=_mixed_run()[1])
    assert a.findings == b.findings and a.states == b.states
    assert [f.to_json() for f in a.findings] == [f.to_json() for f in b.findings]
    assert [(f.kind, f.signature) for f in a.findings] == [("stall", "idle_held"), ("stall", "spin"),
                                                           ("gpu_fault", "reset_required")]


def test_step_does_not_mutate_its_inputs() -> None:
    samples, ev = _mixed_run()
    state = DetectorState()
    for i, s in enumerate(samples):
        before = (state, s)
        new_state, _ = step(state, s, CFG, ev.get(i, ()))
        assert before == (state, s)
        if i % 7 == 0:  # replaying the same tick from the same state gives the same answer
            assert step(state, s, CFG, ev.get(i, ())) == step(state, s, CFG, ev.get(i, ()))
        state = new_state


def test_findings_serialise() -> None:
    node = Node()
    (f,) = run(node.healthy(3) + node.spin(40)).findings
    j = f.to_json()
    assert j["kind"] == "stall" and j["signature"] == "spin" and j["job"] == JOB and j["ranks"] == [0, 1, 2, 3]
    assert isinstance(j["onset"], float) and j["confirmed_at"] - j["onset"] == CFG.confirm_after_s


def test_an_early_tick_cannot_turn_clock_tick_noise_into_progress() -> None:
    """An early tick 50 ms after the last one (the launcher wakes when a stack dump finishes) sees one 10 ms CPU
    clock tick of a blocked rank: 0.2 cores over that window. It must not reset the stall's onset."""
    node = Node()
    samples = node.healthy(5) + node.idle_held(3)
    node.dt = 0.05
    samples.append(node.tick(util=0.0, power_w=70.0, cpu_cores=0.2, traffic_bps=0.0))  # 10 ms in 50 ms
    node.dt = 0.95
    samples += node.idle_held(40)
    r = run(samples)
    (f,) = r.findings
    assert f.onset == samples[4].t  # the last healthy tick, not the early one


def test_a_short_window_keeps_a_busy_verdict_too() -> None:
    node = Node()
    samples = node.healthy(5)
    node.dt = 0.05
    samples.append(node.tick(cpu_cores=0.0))  # no CPU in 50 ms says nothing about a busy rank
    node.dt = 1.0
    samples += node.healthy(3)
    r = run(samples)
    assert r.findings == [] and all(s.jobs[JOB].state == "running" for s in r.states)


# -- host evidence by kind of GPU wait (issue: real jobs, not lab hangs) -----------------------------------------
def _with(samples: list[NodeSample], **fields: object) -> list[NodeSample]:
    """The same samples with every rank process's fields replaced (``wakeups`` may be a per-tick callable)."""
    out = []
    for i, s in enumerate(samples):
        procs = tuple(dataclasses.replace(p, **{k: (v(i) if callable(v) else v) for k, v in fields.items()})
                      for p in s.processes)
        out.append(dataclasses.replace(s, processes=procs))
    return out


def test_a_spinning_gpu_makes_its_busy_waiting_host_no_progress() -> None:
    """NCCL: the kernel spins at idle power and the host busy-waits in a device sync at ~1 core. Counting that
    CPU as progress hid every such hang; now the job is suspect after 2 s and stalled (time) after 30 s."""
    node = Node()
    samples = node.healthy(5) + [node.tick(util=100.0, power_w=95.0, cpu_cores=1.05, traffic_bps=0.0)
                                 for _ in range(35)]
    r = run(samples)
    (f,) = stall_findings(r)
    assert f.signature == "spin" and f.basis == "time"
    assert f.onset == samples[4].t and f.confirmed_at - f.onset == pytest.approx(30.0)
    assert r.job(8).state == "suspect" and r.job(8).needs_stacks


def test_the_same_busy_host_with_an_idle_gpu_is_host_work_not_a_stall() -> None:
    """A rank saving or evaluating on the CPU while its GPU idles: its host counters still count."""
    node = Node()
    busy_host = [1.1, 0.0, 0.0, 0.0]
    samples = node.healthy(5) + [node.tick(util=0.0, power_w=70.0, cpu_cores=busy_host, traffic_bps=0.0)
                                 for _ in range(60)]
    r = run(samples)
    assert not stall_findings(r)
    assert r.job().state == "waiting" and r.job().waiting_on == (0,)


@pytest.mark.parametrize("per_tick, stalls", [(10, False), (3, False), (2, True), (0, True)])
def test_a_main_thread_that_keeps_waking_is_alive(per_tick: int, stalls: bool) -> None:
    """A loop that sleeps at one line uses no CPU but its main thread wakes (voluntary context switches);
    fewer than 3 wakeups a window prove nothing (a blocking py-spy attach alone wakes a thread twice)."""
    node = Node()
    healthy = node.healthy(3)
    r = run(healthy + _with(node.idle_held(40), wakeups=lambda i: 100 + per_tick * i))
    assert bool(stall_findings(r)) is stalls


def test_a_wakeup_does_not_count_when_the_gpu_spins() -> None:
    node = Node()
    healthy = node.healthy(3)
    spin = [node.tick(util=100.0, power_w=95.0, cpu_cores=0.0, traffic_bps=0.0) for _ in range(40)]
    r = run(healthy + _with(spin, wakeups=lambda i: 100 + 50 * i))
    assert [f.signature for f in stall_findings(r)] == ["spin"]


@pytest.mark.parametrize("wchan, status", [("anon_pipe_write", "sleeping"), ("nfs_wait_bit_killable", "disk-sleep"),
                                           ("0", "disk-sleep")])
def test_a_rank_in_a_kernel_io_wait_is_waited_on_whatever_its_counters(wchan: str, status: str) -> None:
    """No CPU, no byte counted (wchar moves only when write(2) returns), no stack dumps: the kernel still
    shows rank 0 writing. The job waits on it; no stall before waiting_timeout_s."""
    node = Node()
    healthy = node.healthy(3)
    quiet = node.idle_held(60)
    samples = healthy + [dataclasses.replace(s, processes=tuple(
        dataclasses.replace(p, wchan=wchan, status=status) if p.job and p.job.rank == 0 else p
        for p in s.processes)) for s in quiet]
    r = run(samples)
    assert not stall_findings(r)
    assert r.job().state == "waiting" and r.job().waiting_on == (0,) and "io (" in r.job().waiting_doing


def test_a_stopped_rank_is_the_culprit_from_its_state() -> None:
    node = Node()
    healthy = node.healthy(3)
    quiet = node.idle_held(35)
    samples = healthy + [dataclasses.replace(s, processes=tuple(
        dataclasses.replace(p, status="stopped") if p.job and p.job.rank == 2 else p for p in s.processes))
        for s in quiet]
    (f,) = stall_findings(run(samples))
    assert f.culprit_ranks == (2,) and "stopped" in f.detail
