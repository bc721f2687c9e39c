"""Value objects for one tick of the node picture. Frozen, with units in the field names.

Everything downstream (detector, trace, metrics) consumes these; only the sampling backends create them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gpu_watchdog.errors import UsageError


def unknown_rank(pid: int) -> int:
    """The stand-in rank of a process that joined its job's process group but whose number no source gives: minus
    its pid, unique on the node for the process's life and never a real rank. Watched like a rank, shown as
    ``rank unknown (pid N)``, written as the negative number itself, with ``unknown_ranks`` naming the process
    (docs/json-contract.md); never a guessed number."""
    return -pid


def rank_known(rank: int) -> bool:
    return rank >= 0


def rank_label(rank: int) -> str:
    """``rank 3``, or ``rank unknown (pid 1234)`` for a stand-in."""
    return f"rank {rank}" if rank >= 0 else f"rank unknown (pid {-rank})"


def rank_tag(rank: int) -> str:
    """A rank in one word (the incident list): ``3``, or ``unknown-pid1234``."""
    return str(rank) if rank >= 0 else f"unknown-pid{-rank}"


@dataclass(frozen=True)
class JobIdentity:
    """Who a process belongs to, read from its environment once per (pid, create_time)."""

    job_id: str
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class ProcessSample:
    """psutil's view of one process. Counters are cumulative; the detector takes deltas."""

    pid: int
    create_time: float  # unix seconds; (pid, create_time) guards against pid reuse
    ppid: int
    status: str  # psutil status string: running, sleeping, disk-sleep, zombie, ...
    cpu_time_s: float  # the process tree (self + children, live and reaped), user + system
    io_bytes: int | None  # the process tree's read_chars + write_chars; None when not readable
    rss_bytes: int
    cmdline: tuple[str, ...] = ()
    job: JobIdentity | None = None
    is_rank: bool = False  # topmost process of its (job, rank): the rank itself, not a dataloader worker
    heartbeat_step: int | None = None  # last step reported by the in-job client, when it runs
    # The main thread's voluntary context switches (cumulative): how often it blocked and woke again. A rank
    # blocked for good in a collective or a lock does not wake; a loop that sleeps or polls at one line does.
    wakeups: int | None = None
    wchan: str = ""  # the main thread's kernel wait channel ("" unknown, "0" running), e.g. "pipe_write"
    exit_status: int | None = None  # a zombie's wait status (waitpid form) while its parent has not reaped it


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU as NVML reports it."""

    pid: int
    used_memory_bytes: int | None  # None: NVML says "not available" (containers, MIG)
    util_percent: float | None = None  # per-process SM utilization where supported


@dataclass(frozen=True)
class GpuFault:
    """A hardware-level problem seen on a device: lost, reset required, or a critical Xid."""

    kind: str  # "gpu_lost" | "reset_required" | "xid" | "xid_application" (faults.application_xids: no drain)
    detail: str
    xid: int | None = None


@dataclass(frozen=True)
class DeviceSample:
    """One GPU (nvml backend) or one rank process shown as a virtual device (proc backend)."""

    index: int
    uuid: str
    name: str
    util_percent: float | None = None
    # NVML utilization.memory: the share of the last sample period the memory controller was busy. An NCCL kernel
    # spinning on a flag keeps the SMs at 100 % with the memory controller at 0 % (measured on an H200).
    mem_util_percent: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    # The SM clock's maximum (NVML max clock info, read once per GPU): the current clock over it is how far the GPU
    # runs below full speed. None when NVML does not tell (proc backend, traces recorded before these fields).
    sm_clock_max_mhz: float | None = None
    # NVML's clocks event reasons (formerly "throttle reasons"), a bitmask of nvmlClocksEventReason* values read every
    # tick: why the clocks are where they are (gpu_watchdog.sample.nvml.clock_slowdowns names the slowdowns).
    clock_event_reasons: int | None = None
    # Cumulative traffic counters (NVML field values); None when not supported.
    pcie_tx_bytes_total: int | None = None
    pcie_rx_bytes_total: int | None = None
    nvlink_tx_bytes_total: int | None = None
    nvlink_rx_bytes_total: int | None = None
    # What the PCIe link can carry per direction (its maximum generation x width: the current ones drop while the
    # GPU idles), to judge traffic against; None when NVML does not tell (proc backend, old traces).
    pcie_link_bytes_per_s: float | None = None
    # The PCIe link: its current generation and width (per tick; they drop while the GPU idles, and a link that
    # trained below its maximum, e.g. a bad riser at x8, stays below under load) and their maxima (read once).
    pcie_link_gen: int | None = None
    pcie_link_width: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_width_max: int | None = None
    # Cumulative PCIe replays (NVML field NVML_FI_DEV_PCIE_REPLAY_COUNTER): link-level retransmissions, each one a
    # corrupted packet sent again; a counter that climbs marks a bad link.
    pcie_replay_total: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    fault: GpuFault | None = None
    unsupported: tuple[str, ...] = ()  # metrics this device could not report (NotSupported)
    virtual: bool = False  # True for proc-backend devices

    @property
    def pids(self) -> frozenset[int]:
        return frozenset(p.pid for p in self.processes)


@dataclass(frozen=True)
class SampleError:
    """A non-fatal problem met while sampling: the error's class (for counting) and where it happened."""

    error_class: str  # e.g. "NVMLError_Unknown", "AccessDenied"
    where: str  # e.g. "nvmlDeviceGetPowerUsage gpu 0", "pid 4242"

    @property
    def from_nvml(self) -> bool:
        """NVML errors are named after the NVML call that failed; the process scan's after the pid."""
        return self.where.startswith("nvml")


@dataclass(frozen=True)
class NodeSample:
    """Everything sampled in one tick."""

    t: float  # unix seconds (wall clock, for records and replay)
    hostname: str
    backend: str  # "nvml" | "proc" | "replay"
    devices: tuple[DeviceSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    errors: tuple[SampleError, ...] = ()  # non-fatal sampling problems this tick

    def process(self, pid: int) -> ProcessSample | None:
        for p in self.processes:
            if p.pid == pid:
                return p
        return None


@dataclass(frozen=True)
class RankStack:
    """Stack evidence for one rank from one dump: the classified state of its main thread."""

    rank: int
    pid: int
    state: str  # see gpu_watchdog.evidence.stacks.classify.STATES
    signature: str  # the main thread's frames joined, for grouping and "did it move?"
    active: bool  # py-spy's flag: the thread was on CPU
    op: str | None = None  # collective name when state == "collective"
    where: str = ""  # "Queue.get (data.py:88)"
    # The main thread's voluntary context switches just before and just after the dump (py-spy's own attach
    # wakes the thread, so "did it wake between two dumps" compares one dump's after with the next's before).
    wakeups_before: int | None = None
    wakeups_after: int | None = None
    # The thread waits in a call that ends by itself (a sleep, a poll or futex wait with a timeout): a polling
    # loop, waiting rather than hung (evidence.stacks.syscalls).
    timed: bool = False
    io_before: int | None = None  # the main thread's own bytes read + written just before the dump ...
    io_after: int | None = None  # ... and just after it


@dataclass(frozen=True)
class CommProgress:
    """NCCL's own progress for one job: its collective counts (NCCL RAS) compared over two polls.

    ``moving``: some count rose between the polls — the job progresses, whatever its hosts and GPUs look like.
    ``frozen_unequal``: nothing rose and some ranks are behind the others' counts (``behind``: global ranks, on
    this node or another) — the others wait for them. ``frozen_equal``: nothing rose and every rank launched the
    same collectives (between collectives, or every rank inside one that never completes).
    """

    job_id: str
    t: float  # the later poll (unix seconds, the sampling clock)
    state: str  # "moving" | "frozen_unequal" | "frozen_equal"
    behind: tuple[int, ...] = ()
    source: str = ""  # where the counts came from, for the finding's wording ("NCCL RAS at localhost:28028")
    desync: bool = False  # frozen_unequal: the ranks launched different collectives; ``behind`` are the odd ones


COMM_STATES = ("moving", "frozen_unequal", "frozen_equal")

# Where a job's deadline came from, most authoritative first (evidence.deadline; docs/evidence.md).
DEADLINE_SOURCES = ("flight_recorder", "client", "default", "unknown")


@dataclass(frozen=True)
class Deadline:
    """The job's own deadline for the collective its ranks wait in: its backend's timeout ends the job then
    (gloo raises in the waiting ranks, NCCL's watchdog aborts them), so waiting past it is never the agent's call.

    ``timeout_s`` None: no source told it (``source`` "unknown", ``detail`` says what was tried). ``started_at``: when
    the pending collective was enqueued (the Flight Recorder's ``time_created_ns``); None: the wait's own start."""

    timeout_s: float | None
    source: str  # one of DEADLINE_SOURCES
    detail: str  # exactly where: "timeout_ms 900000 of gloo:all_gather in group 0 (default_pg), rank 1's dump"
    started_at: float | None = None  # unix seconds
    collective: str | None = None  # the pending collective the deadline is of, when the source names it

    @property
    def known(self) -> bool:
        return self.timeout_s is not None

    def due_at(self, waiting_since: float) -> float | None:
        """When the job's own timeout ends a wait that began at ``waiting_since`` (None: unknown)."""
        if self.timeout_s is None:
            return None
        return (self.started_at if self.started_at is not None else waiting_since) + self.timeout_s

    def to_json(self) -> dict[str, object]:
        return {"timeout_s": self.timeout_s, "source": self.source, "detail": self.detail,
                "started_at": self.started_at, "collective": self.collective}


@dataclass(frozen=True)
class StackEvidence:
    """One stack dump of one job's ranks, fed back to the detector as evidence."""

    job_id: str
    t: float
    ranks: tuple[RankStack, ...] = field(default_factory=tuple)


# A job's id: a file name in the state directory and a label value, so a narrow alphabet.
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")


def validate_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID_RE.fullmatch(job_id) or ".." in job_id:
        raise UsageError(f"invalid job id {job_id!r}: use letters, digits and ._:@+- (no '/', '..' or control "
                         "characters, at most 128)")
    return job_id


class JobState(str, Enum):
    """What the detector believes about a job (the strings are the CLI/JSON contract's and the metrics')."""

    RUNNING = "running"  # its ranks progress
    SUSPECT = "suspect"  # nothing progressed for detect.suspect_after_s: stacks are being taken
    STALLED = "stalled"  # confirmed: stacks unchanged with nothing moving, or quiet for confirm_after_s
    WAITING = "waiting"  # some ranks progress, the others wait for them (or a judged stall is held)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Finding:
    kind: str  # "stall" | "gpu_fault" | "config_mismatch" | "rank_exited" | "straggler"
    signature: str  # stall: idle_held | spin | rank_exited | waiting_timeout; fault: gpu_lost | ...
    job_id: str | None
    ranks: tuple[int, ...]  # the job's ranks seen on this node
    culprit_ranks: tuple[int, ...]  # what the detector alone can tell; stacks refine it
    onset: float
    confirmed_at: float
    devices: tuple[str, ...] = ()  # GPU UUIDs involved
    detail: str = ""
    basis: str = "time"  # what the confirmation rests on: "stacks" | "time" | "fault" | "process" (JSON: "evidence")
    # A kind's own section of its incident (``straggler``: rank, score, causes); not part of the finding's identity.
    facts: Mapping[str, object] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "signature": self.signature, "job": self.job_id, "ranks": list(self.ranks),
                "culprit_ranks": list(self.culprit_ranks), "onset": self.onset,
                "confirmed_at": self.confirmed_at, "devices": list(self.devices), "detail": self.detail,
                "evidence": self.basis}


@dataclass(frozen=True)
class JobStatus:
    """What the detector believes about one job right now (also what metrics export)."""

    job_id: str
    state: JobState = JobState.RUNNING
    since: float = 0.0  # when ``state`` began
    onset: float | None = None  # start of the current no-progress streak
    waiting_since: float | None = None
    waiting_on: tuple[int, ...] = ()  # ranks still making progress while the others wait
    waiting_doing: str = ""  # what they do, from stacks when known ("io at write (ckpt.py:12)")
    signature: str = ""
    ranks: tuple[int, ...] = ()
    rank_pids: Mapping[int, int] = field(default_factory=dict)
    ranks_seen: frozenset[int] = frozenset()
    devices: tuple[str, ...] = ()
    evidence: tuple[StackEvidence, ...] = ()  # stack dumps taken during the current streak
    progress_since: float | None = None  # for clearing a confirmed stall
    needs_stacks: bool = False
    stopped: tuple[int, ...] = ()  # ranks in the stopped state (SIGSTOP): culprits from process state alone
    # Why a confirmed stall was not acted on (no communication evidence: hold_waiting): the job waits, and only
    # ``waiting_timeout_s`` after the onset is it a stall again ("waiting_timeout"). Cleared when it runs again.
    held: str = ""
    comm: CommProgress | None = None  # NCCL's counts as last observed (NCCL RAS), fresh or not
    quiet_since: float | None = None  # since when no counter of the job moved (None: one moved this tick)
    # A wait in communication on ranks that progress: the job's own deadline for it (detect.deadline), which the
    # wait is given before it becomes a stall. None: no deadline governs the wait (unknown, or not in communication).
    deadline: Deadline | None = None


@dataclass(frozen=True)
class RegisteredPid:
    """A process a job was registered with; its create time tells it from a later process that reuses the pid."""

    pid: int
    create_time: float
    uid: int

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid, "create_time": self.create_time, "uid": self.uid}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RegisteredPid:
        return cls(int(data["pid"]), float(data["create_time"]), int(data.get("uid", -1)))


@dataclass(frozen=True)
class Registration:
    """A job registered with the daemon (scheduler prolog, preStop hook, ``gpu-watchdog register``)."""

    job_id: str
    pids: tuple[RegisteredPid, ...] = ()
    cgroup: str | None = None  # re-read every tick: it may still be empty at registration (Slurm's prolog)
    restart_hook: str | None = None  # the name of a hook of the daemon's config
    checkpoint_opt_in: bool = False  # the job may be sent recovery.checkpoint_signal
    registered_by_uid: int = 0  # a non-root registrant's job holds only that user's processes
    run: int | None = None  # the scheduler's run of the job (Slurm's restart count)
    registered_at: float = 0.0


@dataclass(frozen=True)
class LevelRecord:
    """A fallback record as the judgement and the recovery read it: the level a run starts at, its NCCL settings
    and why. Either a node's own (``<state_dir>/jobs/<job>.json``, store.fallback_levels) or the job-wide record of
    one run (``<shared_dir>/<job>/run-<N>.json``, store.job_runs), which also says which node decided it, from
    which incident, and whether the job was given up instead. The files keep docs/json-contract.md's format; a key
    a file lacks reads as its default here."""

    level: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    name: str | None = None
    reason: str = ""
    advice: str = ""
    hang_place: str = ""
    run: int | None = None  # job-wide records: the run it configures
    decided_by: str = "?"  # job-wide records: the node whose agent wrote it
    incident: str | None = None  # job-wide records: the incident that decided it
    give_up: str = ""  # job-wide records: why the job gets no next run ("" when it does)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LevelRecord:
        run = data.get("run")
        return cls(int(data.get("level") or 0), {str(k): str(v) for k, v in (data.get("env") or {}).items()},
                   data.get("name"), str(data.get("reason") or ""), str(data.get("advice") or ""),
                   str(data.get("hang_place") or ""), None if run is None else int(run),
                   str(data.get("decided_by") or "?"), data.get("incident"), str(data.get("give_up") or ""))


@dataclass(frozen=True)
class FallbackSection:
    """An incident's ``fallback`` section (docs/json-contract.md): the level the next run starts at, the settings
    that level adds and why."""

    level: int
    name: str | None
    env: Mapping[str, str]
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"level": self.level, "name": self.name, "env": dict(self.env), "reason": self.reason}


@dataclass(frozen=True)
class RestartedBy:
    """An incident's ``restarted_by`` section: another agent restarts the job (its host, its incident when known,
    the run it starts); this one stood down."""

    host: str
    incident: str | None
    run: int | None

    def to_json(self) -> dict[str, object]:
        return {"host": self.host, "incident": self.incident, "run": self.run}


@dataclass(frozen=True)
class GivenUpBy:
    """An incident's ``given_up_by`` section: another agent gave the job up (its host, its incident, why)."""

    host: str
    incident: str | None
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"host": self.host, "incident": self.incident, "reason": self.reason}
