"""The config schema: every section's dataclass with its documented default (docs/config.md).

Only data lives here, so every other module (the loader, the renderer, the stages that read a section) can
import it without importing each other. Validation is in ``config.load``, rendering in ``config.render``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class AgentConfig:
    interval_s: float = 1.0  # sampling period; one NVML/psutil read per tick
    backend: str = "auto"  # auto | nvml | proc
    state_dir: str = ""  # empty: /var/lib/gpu-watchdog as root, else ~/.local/state/gpu-watchdog
    hostname: str = ""  # empty: socket.gethostname()
    metrics_addr: str = ""  # HOST:PORT for /metrics and /healthz (conventional port 9408); empty: off
    incident_trace_s: float = 120.0  # every incident keeps this much of the node's recent samples; 0: none
    no_rank_warning_s: float = 60.0  # a started or registered job with no rank found this long after: one warning


@dataclass(frozen=True)
class DetectConfig:
    util_idle_max_percent: float = 5.0  # signature A: utilization at or below this ...
    mem_held_min_bytes: int = 1 * GIB  # ... while at least this much GPU memory is held
    proc_rss_held_min_bytes: int = 10 * MIB  # proc backend: the rank's RSS counts as "memory held"
    spin_util_min_percent: float = 90.0  # signature B: utilization at or above this ...
    spin_power_max_ratio: float = 0.3  # ... at power below this fraction of the enforced limit ...
    spin_power_max_w: float = 0.0  # ... or below this many watts when > 0 (overrides the ratio)
    spin_mem_util_max_percent: float = 10.0  # ... with the memory controller at or below this (when NVML tells) ...
    # ... and PCIe+NVLink traffic below this, or below spin_traffic_max_link_ratio of what the PCIe link carries
    # when NVML tells (the larger): NCCL's polling moves ~120 MiB/s while nothing progresses (measured, H200).
    # Traffic is consulted only when NVML does not report the memory controller.
    spin_traffic_max_bytes_per_s: float = 512.0 * MIB
    spin_traffic_max_link_ratio: float = 0.05
    progress_cpu_min_cores: float = 0.1  # a rank tree using this much CPU is making progress
    progress_io_min_bytes_per_s: float = 256.0 * 1024  # or doing this much I/O
    progress_wakeups_min_per_s: float = 3.0  # or whose main thread blocks and wakes this often (a sleep/poll loop)
    progress_min_window_s: float = 0.5  # rates need a window this long (CPU time moves in 10 ms ticks)
    suspect_after_s: float = 2.0  # no progress anywhere in the job for this long → suspect
    confirm_after_s: float = 30.0  # suspect this long → confirmed, when stack proof is unavailable
    stack_confirm_gap_s: float = 3.0  # two unchanged stack dumps this far apart confirm a suspect
    # A wait with nothing moving (held: no communication evidence), or one whose job's own deadline is unknown,
    # this long → a stall. A wait in a collective on ranks that progress ends at the job's deadline instead.
    waiting_timeout_s: float = 600.0
    # A wait in a collective on ranks that visibly progress: no action before the job's own deadline (its collective
    # timeout, evidence.deadline) plus this margin — the job's timeout ends it first (docs/evidence.md).
    deadline_margin_s: float = 60.0
    deadline_warn_ratio: float = 0.5  # such a wait past this share of the deadline → a `deadline` warning
    # ... while a waited-on rank's CPU, I/O or heartbeat moved within this (an NFS flush can sit a minute in one
    # write()); still longer, nothing visibly moves and waiting_timeout_s stands again
    deadline_still_max_s: float = 60.0
    clear_after_s: float = 2.0  # a confirmed stall clears after progress for this long
    waiting_stack_interval_s: float = 15.0  # re-dump stacks this often while a job waits on one rank
    # A step heartbeat (in-job client) still for this many of the rank's own step times: its CPU is not progress.
    heartbeat_stale_steps: float = 5.0
    comm_progress_max_age_s: float = 15.0  # an NCCL RAS observation older than this no longer counts


@dataclass(frozen=True)
class StacksConfig:
    enabled: bool = True
    py_spy: str = ""  # path to py-spy; empty: next to the Python running the agent, then PATH
    timeout_s: float = 5.0  # per-pid py-spy timeout
    concurrency: int = 16
    native: bool = False
    # Read the stacks without pausing the process (py-spy --nonblocking). A paused process has its blocking
    # system calls interrupted: a write(2) into a pipe or socket returns short, so every dump would change what
    # the job does. A blocked rank's stack is static, so nothing is lost for it. Ignored with ``native``.
    nonblocking: bool = True


@dataclass(frozen=True)
class FallbackLevel:
    name: str
    env: Mapping[str, str]
    advice: str = ""


DEFAULT_FALLBACK_LEVELS: tuple[FallbackLevel, ...] = (
    FallbackLevel("p2p-nvls-off", {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"},
                  "P2P hangs on PCIe boxes (H20, 4090) and NVLS init hangs; costs ~7-10% throughput"),
    FallbackLevel("no-ll128", {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_PROTO": "^LL128"},
                  "hangs after long runs traced to the LL128 protocol"),
    FallbackLevel("simple-proto", {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_PROTO": "Simple"},
                  "last resort: only the Simple protocol"),
)


@dataclass(frozen=True)
class FallbackConfig:
    levels: tuple[FallbackLevel, ...] = DEFAULT_FALLBACK_LEVELS
    network_env: Mapping[str, str] = field(default_factory=dict)  # site-specific (NCCL_SOCKET_IFNAME, ...)
    diagnostics_env: Mapping[str, str] = field(
        default_factory=lambda: {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH,ENV"}
    )
    healthy_reset_s: float = 1800.0  # a job healthy this long drops back to level 0
    # A directory every node mounts at the same path (multi-node jobs): the job-wide record of each run's level and
    # settings, written once by the agent that restarts the job (store.job_runs). Empty: per-node state only.
    shared_dir: str = ""
    # With shared_dir: the agent of the node that runs global rank 0 decides a hang's next run; another node's agent
    # waits this long for that decision before making it itself (rank 0's agent may be down or slower).
    actor_grace_s: float = 20.0


@dataclass(frozen=True)
class RecoveryConfig:
    enabled: bool = True
    checkpoint_signal: str = ""  # e.g. "SIGUSR1": the job handles it (only then is it ever sent)
    checkpoint_grace_s: float = 60.0
    stop_grace_s: float = 30.0  # SIGTERM → wait → SIGKILL
    memory_release_timeout_s: float = 60.0
    max_restarts: int = 3  # restarts allowed within restart_window_s
    restart_window_s: float = 3600.0
    max_no_progress_restarts: int = 2  # consecutive restarts that hang again without passing the last hang step
    # Consecutive restarts (each within fallback.healthy_reset_s of the previous) are spaced by this, doubling
    # up to restart_backoff_max_s: a budget is never spent in a minute. 0: no backoff.
    restart_backoff_s: float = 10.0
    restart_backoff_max_s: float = 300.0
    client_boundary_s: float = 5.0  # the in-job client saves at a step boundary within this, else aborts
    restart_on_crash: bool = False  # launch: restart (within the budget) after a rank exits non-zero / on a signal


# Xids that NVIDIA's Xid catalogue files under "restart the application": the fault is confined to the
# contexts of the process that caused it and the GPU keeps serving others, so the node is not drained.
#   13 graphics engine exception (illegal instruction / out-of-range access in a kernel)
#   31 GPU memory page fault (MMU fault: the application touched an unmapped address)
#   43 GPU stopped processing (the channel of a faulting application was reset; others go on)
#   45 preemptive cleanup (channels torn down after an earlier error or a killed process; a consequence)
#   68 NVDEC video processor exception (the decoder engine of one context)
#   94 contained ECC error (the driver contained it to the contexts using that memory: restart them; the
#      row is remapped at the next GPU reset, which can wait for a maintenance window)
# Everything else drains: 48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus,
# 92 high single-bit ECC rate, 95 uncontained ECC, 119/120 GSP errors, and any Xid not listed here.
DEFAULT_APPLICATION_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 94)
DEFAULT_DRAIN_COMMAND: tuple[str, ...] = ("scontrol", "update", "nodename={node}", "state=drain",
                                          "reason=gpu-watchdog: {reason}")
# The placeholders an argv template may use (config.argv_templates checks them; act.hooks / act.faults fill them).
DRAIN_PLACEHOLDERS = ("node", "reason", "job_id", "incident", "gpu", "xid")
HOOK_PLACEHOLDERS = ("job_id", "node", "level", "incident")


@dataclass(frozen=True)
class FaultsConfig:
    xid_events: bool = True  # watch NVML Xid events on a thread (nvml backend only)
    event_wait_ms: int = 500  # one nvmlEventSetWait call; bounds how long stopping the watcher takes
    application_xids: tuple[int, ...] = DEFAULT_APPLICATION_XIDS  # incident only, no drain
    drain_command: tuple[str, ...] = DEFAULT_DRAIN_COMMAND  # argv, no shell; empty: no drain command
    drain_hook: str = ""  # name of a [hooks.NAME] to run instead of drain_command
    drain_timeout_s: float = 60.0  # drain_command's timeout (a drain_hook has its own timeout_s)


@dataclass(frozen=True)
class RasConfig:
    """``[ras]``: NCCL's RAS socket: watched for the jobs whose rank 0 runs here, asked about every suspect or
    stalled job (docs/nccl-ras.md)."""

    enabled: str = "auto"  # auto: jobs with a rank listening on the RAS port | on: every job | off: never
    addr: str = ""  # HOST:PORT; empty: the ranks' NCCL_RAS_ADDR, else localhost:28028 (NCCL's default)
    timeout_s: float = 10.0  # one query end to end (connect, handshake, report); RAS is asked for 40% of it
    poll_interval_s: float = 5.0  # at most one query this often per suspect or stalled job
    # Every NCCL job whose rank 0 runs on this node, all the time: NCCL's own counts are its progress (0: off).
    watch_interval_s: float = 2.0
    confirm_gap_s: float = 2.0  # the two queries an incident compares are at least this far apart


@dataclass(frozen=True)
class FlightRecorderConfig:
    """``[flight_recorder]``: PyTorch's Flight Recorder on every job ``launch`` starts or the TaskProlog registers, and
    its dumps asked for when a job turns suspect (docs/evidence.md)."""

    # Add TORCH_FR_BUFFER_SIZE (and TORCH_NCCL_TRACE_BUFFER_SIZE), the dump file prefix and NCCL's dump pipe, under
    # the run's control directory, to every job's environment; a variable the job set itself is never changed.
    enabled: bool = True
    buffer_size: int = 2000  # entries per rank (about 1 KB each, measured)
    dump_on_suspect: bool = True  # ask the ranks for their dumps once when a job turns suspect


MIN_SLICE_SAMPLES = 4  # samples of a rank a straggler slice needs; fewer and the slice says nothing


@dataclass(frozen=True)
class StragglerConfig:
    """``[straggler]``: low-rate stack samples of every running job's ranks name the rank the others keep waiting
    for, with its cause where the node sees one: an incident and metrics, never an action (docs/stragglers.md)."""

    enabled: bool = True
    interval_s: float = 30.0  # one nonblocking stack sample of each rank at most this often (~10 ms CPU per rank)
    window_s: float = 900.0  # the scores cover this long; a straggler is named after one whole window
    # What the sampling may cost, node-wide, in % of one core (py-spy's own CPU included): where rounds cost more
    # (many ranks, big processes) they are spaced further apart and the window stretches with them, so every window
    # holds the same number of samples and only detection takes longer.
    cpu_budget_percent: float = 0.05
    # The window's parts: a rank is the straggler only when it is one in every part, so no single slow phase
    # up to window_s - 2 x window_s / slices long (9 min by default) ever makes one.
    slices: int = 5
    min_peer_wait_share: float = 0.2  # its peers wait at least this share of their samples (the job loses time) ...
    max_share_ratio: float = 0.5  # ... and it waits at most this times their median share
    # The cheap signal: every tick, each rank's main-thread scheduler clocks and wait channel (and its GPU's
    # signature), a few tens of µs per rank. Its own window, in its own slices (the same rule): 150 s in 15 names a
    # persistent straggler 2.5 min after its onset, and no single slow phase up to 130 s makes one.
    signals: bool = True
    signal_window_s: float = 150.0
    signal_slices: int = 15


DEFAULT_SOCKET = "/run/gpu-watchdog/control.sock"


@dataclass(frozen=True)
class DaemonSettings:
    """``[daemon]``: the node daemon's control socket, who may use it, and housekeeping (``run`` only)."""

    control_socket: str = DEFAULT_SOCKET  # empty: no control API
    socket_group: str = "gpu-watchdog"  # group of the socket (mode 0660); empty: the daemon's group
    allowed_uids: tuple[int, ...] = ()  # peers allowed besides root
    allowed_gids: tuple[int, ...] = ()  # peers whose primary or supplementary group is one of these
    allow_root: bool = True  # root (uid 0) is always allowed; false only for tests
    max_request_bytes: int = 65536
    preempt_timeout_s: float = 60.0  # longest wait for a job's checkpoint acknowledgement
    peer_timeout_s: float = 30.0  # a control-socket peer silent this long (mid-request or idle) is dropped
    stop_unregistered: bool = False  # stop stalled jobs nobody registered (there is no way to restart them)
    give_up_hook: str = ""  # a [hooks.NAME] run once when a job's restart budget is spent (e.g. slurm-give-up)
    incident_max_age_days: float = 30.0  # housekeeping: incident directories older than this are removed
    incident_max_total_mb: float = 2048.0  # ... and the oldest go until all incidents fit in this
    housekeeping_interval_s: float = 600.0


# [hooks.NAME] types and the argv each one gets when the table gives none ("command" must give one).
HOOK_TYPES: dict[str, tuple[str, ...]] = {
    "command": (),
    "slurm-requeue": ("scontrol", "requeue", "{job_id}"),
    # The job's Slurm reason for a give-up: the job was stopped and is not requeued (squeue/sacct show it).
    "slurm-give-up": ("scontrol", "update", "job={job_id}",
                      "comment=gpu-watchdog: gave up, the job kept hanging (restart budget spent; incident {incident} "
                      "on {node})"),
    "k8s-delete-pod": ("kubectl", "delete", "pod", "{job_id}", "--wait=false"),
}
HOOK_MAX_TIMEOUT_S = 86400.0


@dataclass(frozen=True)
class HookSpec:
    """One ``[hooks.NAME]``: an argv template (never a shell) that the control API or a drain selects by name."""

    name: str
    type: str
    argv: tuple[str, ...]
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Config:
    """The whole file: what ``config.load.load_config`` returns and ``config.render.render_toml`` prints."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    stacks: StacksConfig = field(default_factory=StacksConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    ras: RasConfig = field(default_factory=RasConfig)
    flight_recorder: FlightRecorderConfig = field(default_factory=FlightRecorderConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    hooks: Mapping[str, HookSpec] = field(default_factory=dict)  # [hooks.NAME] by NAME


# The sections that are one table each, in file order; ``[hooks.NAME]`` (a table of tables) comes last.
SECTIONS: dict[str, type] = {
    "agent": AgentConfig,
    "detect": DetectConfig,
    "stacks": StacksConfig,
    "recovery": RecoveryConfig,
    "fallback": FallbackConfig,
    "faults": FaultsConfig,
    "ras": RasConfig,
    "flight_recorder": FlightRecorderConfig,
    "straggler": StragglerConfig,
    "daemon": DaemonSettings,
}


def resolve_state_dir(cfg: Config) -> Path:
    """agent.state_dir, or the per-user default when it is empty (a default of the schema, so it lives here)."""
    if cfg.agent.state_dir:
        return Path(cfg.agent.state_dir)
    if os.geteuid() == 0:
        return Path("/var/lib/gpu-watchdog")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpu-watchdog"


