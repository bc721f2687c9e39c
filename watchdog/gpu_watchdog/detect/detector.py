"""The stall detector: a pure function of (previous state, new sample, stack evidence) → (state, findings).

Per job, each tick:
- every rank's progress is judged from its process tree's CPU time and I/O deltas, its main thread's wakeups
  (voluntary context switches: a loop that sleeps or polls at one line keeps waking, a thread blocked for good
  does not) and the in-job client's step heartbeat; a rank seen for the first time counts as progressing;
- device evidence overrides the host: a rank that busy-waits on its device — its GPU spins, or NCCL's counts
  say it sits inside a launched collective (frozen, and it is not behind), or its step heartbeat has been
  still for several of its own step times — burns CPU in a device sync and NCCL's proxy thread, so its CPU time
  is not progress; its own I/O, its heartbeat and a stack that moves still are. A
  rank the kernel shows waiting on storage or a pipe write is being waited on (slow is not stuck); a stopped
  rank (SIGSTOP) makes no progress and is the culprit;
- NCCL's own counts (``CommProgress``, from NCCL RAS) that rose since the last poll are progress for the whole
  job, whatever its hosts and GPUs show; frozen counts with ranks behind name those ranks as the candidates;
- every GPU the job uses shows signature A (utilization ~0 with memory held), signature B (the NCCL spin:
  SMs ~100 % with the memory controller idle at low power; polling traffic is not data), or real work;
- no progress anywhere → the no-progress streak starts at the previous tick (the last time progress was
  seen: the onset); after ``suspect_after_s`` the job is *suspect*; it is *stalled* (a finding) when two
  stack dumps ``stack_confirm_gap_s`` apart show no rank moving, or after ``confirm_after_s`` without stacks;
- some ranks progressing while the others are idle → *waiting* on those ranks (a checkpoint save, an eval);
  that becomes a stall only after ``waiting_timeout_s``, or when stacks show the "busy" ranks never move
  (host-side spin in a device sync);
- a rank that exited while its peers sit idle makes the stall's signature ``rank_exited``;
- a GPU fault (lost, reset required, Xid) is a ``gpu_fault`` finding at once.

Stack evidence is the seam to gpu_watchdog.evidence.stacks.dump: the caller dumps stacks when ``JobStatus.needs_stacks``
and passes the classified result back in on a later tick.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.deadline import deadline_applies, wait_limit_s
from gpu_watchdog.detect.states import RUNNING, STALLED, SUSPECT, WAITING, Event, transition
from gpu_watchdog.evidence.stacks.classify import kernel_wait
from gpu_watchdog.evidence.stacks.diagnosis import RankContext, stacks_progressed
from gpu_watchdog.model import (
    CommProgress,
    Deadline,
    DeviceSample,
    Finding,
    JobState,
    JobStatus,
    NodeSample,
    ProcessSample,
    StackEvidence,
    rank_known,
    rank_label,
)


@dataclass(frozen=True)
class _RankObs:
    pid: int
    create_time: float
    t: float
    cpu_time_s: float
    io_bytes: int | None
    heartbeat_step: int | None
    wakeups: int | None = None
    progressing: bool = True  # the verdict for the window that ended at ``t``
    host_busy_t: float | None = None  # the last time its tree used CPU or did I/O (a data wait's producer)
    step_t: float | None = None  # the last time its step heartbeat moved
    step_s: float | None = None  # its own step time, learned from the heartbeat (seconds per step)
    device: str | None = None  # its GPU's signature this tick (None: no GPU, proc backend)
    doing: str = ""  # what the kernel shows it waiting on: "io wait (pipe_write)"
    stopped: bool = False  # SIGSTOP / job-control stop (T): it cannot make progress until continued
    stale: bool = False  # its step heartbeat has been still for several of its own step times
    io_t: float | None = None  # the last time its tree read or wrote at the progress rate


@dataclass(frozen=True)
class DetectorState:
    t: float | None = None
    ranks: Mapping[tuple[str, int], _RankObs] = field(default_factory=dict)
    traffic: Mapping[str, tuple[float, Counters]] = field(default_factory=dict)  # uuid → (t, counters)
    jobs: Mapping[str, JobStatus] = field(default_factory=dict)
    faulted: frozenset[str] = frozenset()  # GPU UUIDs with a fault in the last sample
    fault_keys: frozenset[str] = frozenset()  # "uuid/kind/xid" of the faults already reported (see step)


Counters = tuple[int | None, int | None, int | None, int | None]


def _counters(d: DeviceSample) -> Counters:
    return (d.pcie_tx_bytes_total, d.pcie_rx_bytes_total, d.nvlink_tx_bytes_total, d.nvlink_rx_bytes_total)


def traffic_rate(d: DeviceSample, old: tuple[float, Counters] | None, t: float) -> float | None:
    """At least this many PCIe + NVLink bytes/s moved since ``old``; None when no counter tells.

    A counter that went down wrapped (or was reset): no rate from it, ever. One that went up may still have wrapped
    unseen — NVML's 32-bit PCIe counters wrap at 4 GiB, several times a second at real data rates — so the sum is
    a lower bound. That is all the spin test needs: traffic only vetoes a spin, and a lower bound above the limit
    proves data moved, while one below it proves nothing (as no counter at all)."""
    if old is None or t <= old[0]:
        return None
    deltas = [now - before for now, before in zip(_counters(d), old[1], strict=True)
              if now is not None and before is not None and now >= before]
    return sum(deltas) / (t - old[0]) if deltas else None


def _quiet_link(d: DeviceSample, traffic_bps: float | None, cfg: DetectConfig) -> bool:
    """Polling is not data: NCCL's proxy polls at a few hundred MiB/s while nothing moves, so the link is quiet
    below the larger of an absolute rate and a share of what the PCIe link carries."""
    if traffic_bps is None:
        return True
    link_share = cfg.spin_traffic_max_link_ratio * d.pcie_link_bytes_per_s if d.pcie_link_bytes_per_s else 0.0
    return traffic_bps <= max(cfg.spin_traffic_max_bytes_per_s, link_share)


def device_signature(d: DeviceSample, cfg: DetectConfig, traffic_bps: float | None,
                     job_pids: frozenset[int]) -> str | None:
    """'idle_held', 'spin', 'busy', or None when utilization is unknown."""
    if d.util_percent is None:
        return None
    # A proc-backend device is a rank's CPU use: it is idle exactly when the rank makes no CPU progress.
    idle_max = cfg.progress_cpu_min_cores * 100.0 if d.virtual else cfg.util_idle_max_percent
    if d.util_percent <= idle_max:
        if d.virtual:
            held = (d.mem_used_bytes or 0) >= cfg.proc_rss_held_min_bytes
        else:
            job_mem = [p.used_memory_bytes for p in d.processes if p.pid in job_pids]
            known = [m for m in job_mem if m is not None]
            held = (sum(known) if known else (d.mem_used_bytes or 0)) >= cfg.mem_held_min_bytes
        return "idle_held" if held else "busy"
    if d.util_percent >= cfg.spin_util_min_percent and not d.virtual:
        # The NCCL spin (measured on an H200): SMs at 100 % running a kernel that polls a flag, the memory
        # controller idle, power low. Real work draws power or moves memory — data sent or received over any link
        # passes the memory controller, so where NVML reports it, link traffic (polling included) is not asked.
        # Without power an idle memory controller alone tells; without either, utilization is not a spin.
        mem_idle = None if d.mem_util_percent is None else d.mem_util_percent <= cfg.spin_mem_util_max_percent
        low_power = None if d.power_w is None else d.power_w <= (
            cfg.spin_power_max_w or (cfg.spin_power_max_ratio * d.power_limit_w if d.power_limit_w else 0.0))
        if low_power is False or mem_idle is False or (low_power is None and mem_idle is None):
            return "busy"
        if mem_idle or _quiet_link(d, traffic_bps, cfg):
            return "spin"
    return "busy"


def _rank_facts(p: ProcessSample, prev: _RankObs | None, t: float, device: str | None,
                  cfg: DetectConfig, in_collective: bool = False) -> _RankObs:
    """The rank's progress verdict and the baseline for the next one.

    CPU time moves in 10 ms clock ticks, so a window much shorter than a tick interval (an early tick right
    after a stack dump) turns noise into a "busy" rate: such a window keeps the previous baseline and verdict.
    """
    same = prev is not None and prev.pid == p.pid and prev.create_time == p.create_time
    wait = kernel_wait(p.wchan, p.status)
    doing = _kernel_doing(p, wait)
    stopped = p.status == "stopped"
    if same and prev is not None and p.status != "zombie" and t - prev.t < cfg.progress_min_window_s \
            and p.heartbeat_step == prev.heartbeat_step:
        return replace(prev, device=device, doing=doing, stopped=stopped)  # (stale: judged on a full window)
    old = prev if same else None
    stale = _heartbeat_stale(p, old, t, cfg)
    device_wait = device == "spin" or in_collective or stale
    progressing, host_busy, did_io = _rank_progress(p, old, t, device_wait, wait, cfg)
    host_busy_t = t if host_busy else (old.host_busy_t if old is not None else None)
    io_t = t if did_io else (old.io_t if old is not None else None)
    step_t, step_s = _step_timing(p, old, t)
    return _RankObs(p.pid, p.create_time, t, p.cpu_time_s, p.io_bytes, p.heartbeat_step, p.wakeups, progressing,
                    host_busy_t, step_t, step_s, device, doing, stopped, stale, io_t)


def _kernel_doing(p: ProcessSample, wait: str | None) -> str:
    """What the kernel shows the rank waiting on, for the operator ("io wait (pipe_write)"); "" when nothing."""
    where = f"uninterruptible, {p.wchan}" if p.status == "disk-sleep" and p.wchan else (p.wchan or p.status)
    return f"{wait} ({where})" if wait else ""


def _step_timing(p: ProcessSample, old: _RankObs | None, t: float) -> tuple[float | None, float | None]:
    """(the last time the rank's step heartbeat moved, its own step time in seconds per step) as of ``t``; ``old``
    is the same process's previous observation (None: a new process, nothing learned yet)."""
    stepped = old is not None and p.heartbeat_step is not None and p.heartbeat_step != old.heartbeat_step
    step_t = t if stepped else (old.step_t if old is not None else None)
    step_s = old.step_s if old is not None else None
    if stepped and old is not None and old.step_t is not None and old.heartbeat_step is not None \
            and p.heartbeat_step is not None and p.heartbeat_step > old.heartbeat_step:
        # Seconds per step, smoothed: heartbeats arrive at tick resolution, several steps per tick on a fast job.
        per_step = (t - old.step_t) / (p.heartbeat_step - old.heartbeat_step)
        step_s = per_step if step_s is None else 0.7 * step_s + 0.3 * per_step
    return step_t, step_s


def _heartbeat_stale(p: ProcessSample, prev: _RankObs | None, t: float, cfg: DetectConfig) -> bool:
    """The rank's step heartbeat has been still for ``heartbeat_stale_steps`` of its own step times (and at least
    ``suspect_after_s``): whatever its host shows, it is not stepping."""
    if prev is None or p.heartbeat_step is None or prev.step_t is None or prev.step_s is None \
            or p.heartbeat_step != prev.heartbeat_step:
        return False
    return t - prev.step_t >= max(cfg.heartbeat_stale_steps * prev.step_s, cfg.suspect_after_s)


# A blocking py-spy attach (stacks.native) wakes a thread twice: fewer wakeups than this in one window prove nothing.
_MIN_WAKEUPS = 3


def _rank_progress(p: ProcessSample, prev: _RankObs | None, t: float, device_wait: bool, wait: str | None,
                   cfg: DetectConfig) -> tuple[bool, bool, bool]:
    """(progressing, host busy, did I/O) for one rank over the window since ``prev``.

    Host counters mean different things on a device: a rank that waits on its device (``device_wait``: its GPU
    spins, NCCL shows it inside a launched collective, its heartbeat went still) busy-waits in a device sync
    while NCCL's proxy thread polls — 2 cores and no wakeups measured on an H200 — so its CPU time is not
    progress, nor are its wakeups; its own I/O still is: a rank writing a checkpoint on a GPU its peers spin on
    is alive. A rank waiting in a file-system or pipe write is being waited on, whatever its byte
    counters show."""
    if p.status == "zombie" or p.status == "stopped":
        return False, False, False
    if prev is None or t <= prev.t:
        return True, False, False  # nothing to compare with yet: assume it works
    dt = t - prev.t
    cpu = (p.cpu_time_s - prev.cpu_time_s) / dt >= cfg.progress_cpu_min_cores
    io = p.io_bytes is not None and prev.io_bytes is not None \
        and (p.io_bytes - prev.io_bytes) / dt >= cfg.progress_io_min_bytes_per_s
    busy = cpu or io
    if p.heartbeat_step is not None and p.heartbeat_step != prev.heartbeat_step:
        return True, busy, io
    if wait == "io":
        return True, busy, io
    woke = p.wakeups is not None and prev.wakeups is not None and p.wakeups - prev.wakeups >= _MIN_WAKEUPS \
        and (p.wakeups - prev.wakeups) / dt >= cfg.progress_wakeups_min_per_s
    if device_wait:
        # Not its wakeups either: a loop polling a collective's completion (``is_completed()`` and a short
        # sleep) wakes all the time and waits all the same.
        return io, busy, io
    return busy or woke, busy, io


def stacks_show_progress(a: StackEvidence, b: StackEvidence,
                         context: Mapping[int, RankContext] | None = None) -> dict[int, str]:
    """Ranks whose stacks moved between two dumps (diagnosis.stacks_progressed), with what they are doing."""
    now = {r.rank: r for r in b.ranks}
    return {rank: f"{now[rank].state} at {now[rank].where}" if now[rank].where else now[rank].state
            for rank, moved in stacks_progressed(a, b, context).items() if moved}


def _rank_device(pid: int, devs: Sequence[DeviceSample], sigs: Sequence[str | None]) -> str | None:
    """The signature of the real GPU(s) a rank process is on: busy wins (it works somewhere), then spin."""
    mine = {s for d, s in zip(devs, sigs, strict=True) if not d.virtual and s is not None and pid in d.pids}
    return next((s for s in ("busy", "spin", "idle_held") if s in mine), None)


# Ticks come from a wall clock that jitters by milliseconds: a tick 1 ms short of "suspect for 2 s" must not
# cost a whole interval (it made the same hang confirm 5, 6 or 7 s after its onset, at random).
CLOCK_SLACK_S = 0.05


def _lasted(elapsed: float, threshold: float) -> bool:
    """Has ``elapsed`` reached ``threshold``, give or take the sampling clock's jitter?"""
    return elapsed >= threshold - CLOCK_SLACK_S


def _fmt_ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) if rank_known(r) else rank_label(r)[len("rank "):] for r in sorted(ranks))


def step(state: DetectorState, sample: NodeSample, cfg: DetectConfig,
         stacks: Sequence[StackEvidence] = (),
         comm: Sequence[CommProgress] = (),
         deadlines: Mapping[str, Deadline] = {}) -> tuple[DetectorState, list[Finding]]:  # noqa: B006 (read only)
    """Advance the detector by one sample. Pure. ``stacks``, ``comm``: the stack dumps and NCCL counts that finished
    since the last call; ``deadlines``: the jobs' own deadlines for their current waits, as learnt so far."""
    t = sample.t
    prev_t = state.t if state.t is not None else t
    faulted, fault_keys, findings = _gpu_faults(state, sample)

    traffic, traffic_bps = _traffic(state, sample)
    by_job: dict[str, list[tuple[int, ProcessSample]]] = {}
    for p in sample.processes:
        if p.is_rank and p.job is not None and p.job.rank is not None:
            by_job.setdefault(p.job.job_id, []).append((p.job.rank, p))

    ev_by_job: dict[str, list[StackEvidence]] = {}
    for ev in stacks:
        ev_by_job.setdefault(ev.job_id, []).append(ev)
    comm_by_job: dict[str, CommProgress] = {}
    for c in sorted(comm, key=lambda c: c.t):
        comm_by_job[c.job_id] = c

    ranks_obs: dict[tuple[str, int], _RankObs] = {}
    jobs: dict[str, JobStatus] = {}
    for job_id, ranked in by_job.items():
        pids = frozenset(p.pid for _, p in ranked)
        devs = [d for d in sample.devices if d.pids & pids and d.fault is None]
        sigs = [device_signature(d, cfg, traffic_bps.get(d.uuid), pids) for d in devs]
        prev = state.jobs.get(job_id) or JobStatus(job_id, since=t)
        counts = _comm_now(prev.comm, comm_by_job.get(job_id), t, cfg)
        obs_of: dict[int, _RankObs] = {}
        for rank, p in ranked:
            obs = _rank_facts(p, state.ranks.get((job_id, rank)), t, _rank_device(p.pid, devs, sigs), cfg,
                                _inside_collective(counts, rank, "spin" in sigs))
            ranks_obs[(job_id, rank)] = obs_of[rank] = obs
        prev = replace(prev, comm=comm_by_job.get(job_id) or prev.comm)
        js = _advance_job(prev, t, prev_t, ranked, obs_of, devs, sigs, ev_by_job.get(job_id, []), cfg,
                          counts, comm_by_job.get(job_id), deadlines.get(job_id))
        jobs[job_id] = js
        if js.state == STALLED and prev.state != STALLED:
            findings.append(_stall_finding(js, t, counts))
    # Jobs whose ranks are all gone simply end; a stall that ended with them was already reported.
    return DetectorState(t, ranks_obs, traffic, jobs, frozenset(faulted), frozenset(fault_keys)), findings


def _traffic(state: DetectorState, sample: NodeSample) -> tuple[dict[str, tuple[float, Counters]],
                                                                  dict[str, float | None]]:
    """(each GPU's counters now, kept for the next tick; each GPU's traffic rate since the last tick)."""
    traffic: dict[str, tuple[float, Counters]] = {}
    traffic_bps: dict[str, float | None] = {}
    for d in sample.devices:
        traffic_bps[d.uuid] = traffic_rate(d, state.traffic.get(d.uuid), sample.t)
        if any(c is not None for c in _counters(d)):
            traffic[d.uuid] = (sample.t, _counters(d))
    return traffic, traffic_bps


def _gpu_faults(state: DetectorState, sample: NodeSample) -> tuple[set[str], set[str], list[Finding]]:
    """GPU faults: each reported once while it lasts. Keyed by GPU, kind and Xid, so a lost GPU seen every tick is
    one finding, while a new Xid right after another (an application Xid, then Xid 79) is news. Returns (faulted
    GPUs, fault keys, findings)."""
    t = sample.t
    faulted, fault_keys, findings = set(), set(), []
    for d in sample.devices:
        if d.fault is None:
            continue
        key = f"{d.uuid}/{d.fault.kind}/{d.fault.xid}"
        faulted.add(d.uuid)
        fault_keys.add(key)
        if key not in state.fault_keys:
            hit = sorted({p.job.job_id for p in sample.processes if p.job and p.pid in d.pids})
            findings.append(Finding("gpu_fault", d.fault.kind, hit[0] if hit else None, (), (), t, t,
                                    (d.uuid,), f"{d.fault.detail}; jobs: {', '.join(hit) or 'none'}", "fault"))
    return faulted, fault_keys, findings


def _comm_now(old: CommProgress | None, new: CommProgress | None, t: float,
              cfg: DetectConfig) -> CommProgress | None:
    """The job's NCCL counts as they stand now: the newest observation while it is under
    ``comm_progress_max_age_s`` old (RAS went quiet or away: no longer evidence either way)."""
    latest = new or old
    return latest if latest is not None and t - latest.t <= cfg.comm_progress_max_age_s else None


def _inside_collective(counts: CommProgress | None, rank: int, spinning: bool) -> bool:
    """NCCL's frozen counts say this rank launched a collective that has not completed: every rank not behind
    the others when some are behind, or every rank when the counts are equal and the job's GPUs spin."""
    if counts is None:
        return False
    if counts.state == "frozen_unequal":
        return bool(counts.behind) and rank not in counts.behind
    return counts.state == "frozen_equal" and spinning


@dataclass(frozen=True)
class _JobFacts:
    """What one tick shows of a job, before any state is decided (``_job_facts``)."""

    base: JobStatus  # the previous status with this tick's ranks, pids, devices and stopped ranks
    evidence: tuple[StackEvidence, ...]  # the streak's last two stack dumps
    quiet: bool  # nothing moved (counters, NCCL counts, stacks)
    onset: float  # when the quiet streak began
    signature: str  # what a stall now would be called: rank_exited | spin | idle_held
    stack_quiet: bool  # two dumps stack_confirm_gap_s apart show no rank moving
    devices_busy: bool  # a GPU the job waits on works
    partial: bool = False  # not quiet, but some ranks wait on others (or moved only in their stacks)
    waiting_since: float | None = None  # partial: since when
    waiting_on: tuple[int, ...] = ()  # partial: the ranks the others wait on
    waiting_doing: str = ""  # partial: what those do
    deadline: Deadline | None = None  # partial: the job's own deadline for the wait, when it governs the wait


def _advance_job(prev: JobStatus, t: float, prev_t: float, ranked: Sequence[tuple[int, ProcessSample]],
                 obs: Mapping[int, _RankObs], devs: Sequence[DeviceSample], sigs: Sequence[str | None],
                 evidence_in: Sequence[StackEvidence], cfg: DetectConfig,
                 counts: CommProgress | None = None, counts_new: CommProgress | None = None,
                 deadline: Deadline | None = None) -> JobStatus:
    """Observe the job's facts, reduce them to one event, move by the table (detect.states), enter the state."""
    facts = _job_facts(prev, t, prev_t, ranked, obs, devs, sigs, evidence_in, cfg, counts, counts_new)
    if facts.partial:
        moved = [m for r in facts.waiting_on if r in obs for m in (obs[r].host_busy_t, obs[r].step_t) if m is not None]
        still_s = t - max(moved) if moved else None
        governed = prev.deadline if prev.waiting_since == facts.waiting_since else None
        facts = replace(facts, deadline=deadline_applies(deadline, facts.waiting_on, facts.evidence, still_s, cfg,
                                                         governed))
    event = _event(prev, facts, t, cfg)
    return _enter(transition(prev.state, event), event, prev, facts, t, cfg)


def _job_facts(prev: JobStatus, t: float, prev_t: float, ranked: Sequence[tuple[int, ProcessSample]],
                 obs: Mapping[int, _RankObs], devs: Sequence[DeviceSample], sigs: Sequence[str | None],
                 evidence_in: Sequence[StackEvidence], cfg: DetectConfig, counts: CommProgress | None,
                 counts_new: CommProgress | None) -> _JobFacts:
    ranks = tuple(sorted(rank for rank, _ in ranked))
    progressing, devices_busy = _progress_and_devices(ranks, obs, sigs, counts, counts_new)
    seen = prev.ranks_seen | frozenset(ranks)
    missing = seen - frozenset(ranks)
    device_sig = "spin" if "spin" in sigs else "idle_held"
    base = replace(prev, ranks=ranks, ranks_seen=seen, devices=tuple(d.uuid for d in devs),
                   rank_pids={rank: p.pid for rank, p in ranked},
                   stopped=tuple(r for r in ranks if obs[r].stopped))

    evidence, moving, stack_quiet = _stack_progress(prev, evidence_in, obs, cfg)

    quiet, quiet_since, onset = _quiet_streak(prev, prev_t, ranks, obs, progressing, devices_busy, stack_quiet)
    base = replace(base, quiet_since=quiet_since)
    # Stacks that moved count only from two dumps taken while the counters were quiet: a pair from before (a job
    # that waited on a slow rank at start-up, then hung) says what the ranks did then, not now.
    slow_movers = quiet and bool(moving) and prev.state != STALLED and quiet_since is not None \
        and evidence[0].t >= quiet_since
    if slow_movers:
        # No counter moved, but these ranks' stacks did between two dumps: they progress too slowly for the
        # counters to show (a slow read, a sleep-poll loop). The job waits on them; it is not stalled.
        # (A confirmed stall clears only on counter progress, never on old dumps.)
        quiet, progressing = False, sorted(moving)
    facts = _JobFacts(base, evidence, quiet, onset, "rank_exited" if missing else device_sig, stack_quiet,
                      devices_busy)
    known_pids = {p.pid for rank, p in ranked if rank_known(rank)}
    known_sigs = [s for d, s in zip(devs, sigs, strict=True) if d.pids & known_pids]
    if quiet or not _some_wait(ranks, progressing, slow_movers, devices_busy, known_sigs):
        return facts
    waiting_since = prev.waiting_since if prev.waiting_since is not None else (onset if slow_movers else prev_t)
    return _waiting_facts(facts, prev, waiting_since, progressing, moving, obs, devs, sigs)


def _quiet_streak(prev: JobStatus, prev_t: float, ranks: Sequence[int], obs: Mapping[int, _RankObs],
                  progressing: Sequence[int], devices_busy: bool,
                  stack_quiet: bool) -> tuple[bool, float | None, float]:
    """(whether nothing moved this tick, since when no counter moved (None: one did), the quiet streak's onset).

    ``quiet_since`` rests on the counters alone: a job made quiet only by stacks that never moved keeps it None."""
    # Every rank's heartbeat went still for several of its own step times: the job is suspect whatever its GPUs
    # show; a GPU that looks busy then needs stack proof, never time alone (a long evaluation keeps it busy).
    stale_all = all(obs[r].stale for r in ranks)
    quiet = not progressing and (not devices_busy or stale_all)
    quiet_since = (prev.quiet_since if prev.quiet_since is not None else prev_t) if quiet else None
    onset = prev.onset if prev.onset is not None else prev_t  # the last tick that saw progress
    if not quiet and stack_quiet and not devices_busy:
        quiet = True  # the CPU "progress" was a host-side spin: the stacks never moved
        onset = prev.onset if prev.onset is not None else (prev.waiting_since or prev_t)
    return quiet, quiet_since, onset


def _progress_and_devices(ranks: Sequence[int], obs: Mapping[int, _RankObs], sigs: Sequence[str | None],
                          counts: CommProgress | None, counts_new: CommProgress | None) -> tuple[list[int], bool]:
    """(the ranks whose counters moved, whether a GPU the job waits on works)."""
    progressing = [r for r in ranks if obs[r].progressing]
    if counts_new is not None and counts_new.state == "moving":
        # NCCL's counts rose since its last poll: the job progresses, whatever its hosts and GPUs show.
        progressing = list(ranks)
    devices_busy = any(s == "busy" for s in sigs)
    if counts is not None and counts.state == "frozen_unequal" and counts.behind:
        # NCCL's frozen counts put the other ranks inside a collective that cannot complete: only the GPUs of the
        # ranks behind can be doing work the job waits for.
        devices_busy = any(obs[r].device == "busy" for r in counts.behind if r in obs)
    return progressing, devices_busy


def _some_wait(ranks: Sequence[int], progressing: Sequence[int], slow_movers: bool, devices_busy: bool,
               known_sigs: Sequence[str | None]) -> bool:
    """Whether a job that is not quiet waits on some of its ranks: some progress while others idle, ranks that only
    moved slowly (stacks, not counters: a job that polls or reads slowly everywhere waits, until
    waiting_timeout_s, it is not running), or a busy GPU beside idle ones (``known_sigs``: the GPUs of ranks whose
    number is known). A member whose rank no source gave idling (or its idle GPU) does not make the job wait: it may
    be no rank at all (a helper that joined), and a wait times out into a restart; its hang still shows when the
    others stop too."""
    idle = [r for r in ranks if r not in progressing and rank_known(r)]
    return bool((idle and progressing and len(ranks) > 1) or slow_movers
                or (devices_busy and any(s != "busy" for s in known_sigs)))


def _stack_progress(prev: JobStatus, evidence_in: Sequence[StackEvidence], obs: Mapping[int, _RankObs],
                    cfg: DetectConfig) -> tuple[tuple[StackEvidence, ...], dict[int, str], bool]:
    """(the streak's last two dumps, the ranks whose stacks moved between them with what they do, whether two dumps
    far enough apart show no rank moving)."""
    streak_start = prev.onset if prev.onset is not None else prev.waiting_since
    evidence = tuple(e for e in (*prev.evidence, *evidence_in) if streak_start is not None and
                     e.t >= streak_start)[-2:]
    if not (len(evidence) == 2 and _lasted(evidence[1].t - evidence[0].t, cfg.stack_confirm_gap_s)
            and evidence[1].ranks):
        return evidence, {}, False
    since = evidence[0].t
    context = {r: RankContext(o.device, o.host_busy_t is not None and o.host_busy_t > since,
                              o.step_t is not None and o.step_t > since, o.io_t is not None and o.io_t > since)
               for r, o in obs.items()}
    moving = stacks_show_progress(evidence[0], evidence[1], context)
    return evidence, moving, not moving


def _waiting_facts(facts: _JobFacts, prev: JobStatus, waiting_since: float, progressing: Sequence[int],
                   moving: Mapping[int, str], obs: Mapping[int, _RankObs], devs: Sequence[DeviceSample],
                   sigs: Sequence[str | None]) -> _JobFacts:
    """A job some of whose ranks wait on the others: on whom, doing what, since when."""
    kernel = {r: obs[r].doing for r in progressing if obs[r].doing}
    doing = ", ".join(f"{rank_label(r)}: {moving[r]}" for r in sorted(moving)) if moving else (
        ", ".join(f"{rank_label(r)}: {d}" for r, d in sorted(kernel.items())) or prev.waiting_doing)
    # No rank's process progresses but some GPUs work: the job waits on the ranks on those GPUs.
    busy_pids = {pid for d, s in zip(devs, sigs, strict=True) if s == "busy" for pid in d.pids}
    gpu_busy = tuple(r for r, pid in sorted(facts.base.rank_pids.items()) if pid in busy_pids)
    on = tuple(sorted(moving)) if moving else tuple(progressing) or gpu_busy
    return replace(facts, partial=True, waiting_since=waiting_since, waiting_on=on, waiting_doing=doing)


def _event(prev: JobStatus, f: _JobFacts, t: float, cfg: DetectConfig) -> Event:
    if f.quiet and prev.held and prev.waiting_since is not None:
        return Event.TIMED_OUT if _lasted(t - prev.waiting_since, cfg.waiting_timeout_s) else Event.HELD_QUIET
    if f.quiet:
        if prev.state == STALLED or not _lasted(t - f.onset, cfg.suspect_after_s):
            return Event.QUIET
        by_time = _lasted(t - f.onset, cfg.confirm_after_s) and not f.devices_busy
        return Event.PROVEN if f.stack_quiet or by_time else Event.QUIET_LONG
    if prev.state == STALLED and not _lasted(t - _progress_since(prev, t), cfg.clear_after_s):
        return Event.NOT_CLEARED
    if f.partial:
        assert f.waiting_since is not None
        return Event.TIMED_OUT if _lasted(t - f.waiting_since, wait_limit_s(f.waiting_since, f.deadline, cfg)) \
            else Event.PARTIAL
    return Event.PROGRESS


def _progress_since(prev: JobStatus, t: float) -> float:
    return prev.progress_since if prev.progress_since is not None else t


def _enter(state: JobState, event: Event, prev: JobStatus, f: _JobFacts, t: float, cfg: DetectConfig) -> JobStatus:
    """The job's status in ``state``, reached from ``prev`` on ``event``."""
    base, ev = f.base, f.evidence
    if event is Event.TIMED_OUT:  # a held stall (quiet) or a partial wait ran out: a stall to act on
        if not f.quiet:
            base = replace(base, waiting_since=f.waiting_since, waiting_on=f.waiting_on,
                           waiting_doing=f.waiting_doing, deadline=f.deadline)
        return replace(base, state=state, since=t, onset=base.waiting_since, signature="waiting_timeout",
                       evidence=ev, progress_since=None, needs_stacks=False)
    if event is Event.HELD_QUIET:
        return replace(base, state=state, onset=None, evidence=ev, needs_stacks=False)
    if event is Event.QUIET and prev.state == STALLED:
        return replace(base, onset=f.onset, evidence=ev, progress_since=None, needs_stacks=False)
    if event is Event.QUIET:
        return replace(base, state=state, onset=f.onset, evidence=ev, signature=f.signature, needs_stacks=False)
    if event is Event.PROVEN:
        return replace(base, state=state, since=t, onset=f.onset, signature=f.signature, evidence=ev,
                       progress_since=None, needs_stacks=False)
    if event is Event.QUIET_LONG:
        since = prev.since if prev.state == SUSPECT else t
        needs = not ev or _lasted(t - ev[-1].t, cfg.stack_confirm_gap_s)
        return replace(base, state=state, since=since, onset=f.onset, signature=f.signature, evidence=ev,
                       needs_stacks=needs)
    if event is Event.NOT_CLEARED:
        return replace(base, progress_since=_progress_since(prev, t), needs_stacks=False)
    if event is Event.PARTIAL:  # re-dumped at the confirm gap until two dumps exist, then every interval
        needs = not ev or _lasted(t - ev[-1].t, cfg.stack_confirm_gap_s if len(ev) < 2 else
                                  cfg.waiting_stack_interval_s)
        return replace(base, state=state, since=prev.since if prev.state == WAITING else t, onset=None,
                       waiting_since=f.waiting_since, waiting_on=f.waiting_on, waiting_doing=f.waiting_doing,
                       signature="", evidence=ev, progress_since=None, needs_stacks=needs, deadline=f.deadline)
    return replace(base, state=state, since=prev.since if prev.state == RUNNING else t, onset=None,
                   waiting_since=None, waiting_on=(), waiting_doing="", signature="", evidence=(),
                   progress_since=None, needs_stacks=False, held="", deadline=None)


def hold_waiting(state: DetectorState, job_id: str, onset: float, why: str,
                 on: tuple[int, ...] = (), doing: str = "") -> DetectorState:
    """A confirmed stall of ``job_id`` (streak from ``onset``) with no communication evidence: the job is waiting
    (on ranks ``on``, doing ``doing``), not hung in communication. Nothing acts on it before ``waiting_timeout_s``
    after the onset, when the detector reports a ``waiting_timeout`` stall. A job that ran again meanwhile (no
    longer the stall that was judged) is left alone."""
    js = state.jobs.get(job_id)
    if js is None or js.state != STALLED or js.onset is None or abs(js.onset - onset) > 1e-6:
        return state
    held = replace(js, state=WAITING, onset=None, waiting_since=onset, waiting_on=on, waiting_doing=doing,
                   signature="", held=why, needs_stacks=False, progress_since=None)
    return replace(state, jobs={**state.jobs, job_id: held})


def _stall_finding(js: JobStatus, t: float, counts: CommProgress | None = None) -> Finding:
    missing = tuple(sorted(js.ranks_seen - frozenset(js.ranks)))
    if js.signature == "rank_exited":
        culprits, detail = missing, f"rank(s) {_fmt_ranks(missing)} exited; ranks {_fmt_ranks(js.ranks)} idle"
    elif js.signature == "waiting_timeout":
        culprits = js.waiting_on
        detail = (f"ranks waited on rank(s) {_fmt_ranks(js.waiting_on)} for too long" if js.waiting_on else
                  "the job waited for too long")
        if js.held:
            detail += f" (not hung in communication: {js.held})"
        elif js.waiting_doing:
            detail += f" ({js.waiting_doing})"
    else:
        culprits = js.stopped
        detail = ("GPUs spin at idle power with no traffic" if js.signature == "spin"
                  else "no rank makes progress while memory is held")
        if js.stopped:
            detail += f"; rank(s) {_fmt_ranks(js.stopped)} stopped (SIGSTOP or job control: state T)"
        if counts is not None and counts.state == "frozen_unequal" and counts.behind:
            culprits = culprits or counts.behind
            detail += (f"; {counts.source or 'NCCL'}: rank(s) {_fmt_ranks(counts.behind)} "
                       + ("launched other collectives than the others (a desync)" if counts.desync
                          else "behind the others' collective counts") + ", frozen")
        elif counts is not None and counts.state == "frozen_equal" and js.signature == "spin":
            detail += (f"; {counts.source or 'NCCL'}: every rank launched the same collectives and none "
                       "completes (a hang inside a launched collective)")
    evidence = "stacks" if len(js.evidence) == 2 else "time"
    assert js.onset is not None
    return Finding("stall", js.signature, js.job_id, tuple(sorted(js.ranks_seen)), culprits, js.onset, t,
                   js.devices, detail, evidence)

