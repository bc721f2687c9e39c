"""One TOML config file; every key has a documented default (docs/config.md) and is validated by name.

A bad value raises ConfigError naming the key (exit 78). ``gpu-watchdog config show`` prints the result.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_watchdog.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class AgentConfig:
    interval_s: float = 1.0  # sampling period; one NVML/psutil read per tick
    backend: str = "auto"  # auto | nvml | proc
    state_dir: str = ""  # empty: /var/lib/gpu-watchdog as root, else ~/.local/state/gpu-watchdog
    hostname: str = ""  # empty: socket.gethostname()
    metrics_addr: str = ""  # HOST:PORT for /metrics and /healthz (conventional port 9408); empty: off


@dataclass(frozen=True)
class DetectConfig:
    util_idle_max_percent: float = 5.0  # signature A: utilization at or below this ...
    mem_held_min_bytes: int = 1 * GIB  # ... while at least this much GPU memory is held
    proc_rss_held_min_bytes: int = 10 * MIB  # proc backend: the rank's RSS counts as "memory held"
    spin_util_min_percent: float = 90.0  # signature B: utilization at or above this ...
    spin_power_max_ratio: float = 0.3  # ... at power below this fraction of the enforced limit ...
    spin_power_max_w: float = 0.0  # ... or below this many watts when > 0 (overrides the ratio)
    spin_traffic_max_bytes_per_s: float = 10.0 * MIB  # ... and PCIe+NVLink traffic below this
    progress_cpu_min_cores: float = 0.1  # a rank tree using this much CPU is making progress
    progress_io_min_bytes_per_s: float = 256.0 * 1024  # or doing this much I/O
    progress_wakeups_min_per_s: float = 3.0  # or whose main thread blocks and wakes this often (a sleep/poll loop)
    progress_min_window_s: float = 0.5  # rates need a window this long (CPU time moves in 10 ms ticks)
    suspect_after_s: float = 2.0  # no progress anywhere in the job for this long → suspect
    confirm_after_s: float = 30.0  # suspect this long → confirmed, when stack proof is unavailable
    stack_confirm_gap_s: float = 3.0  # two unchanged stack dumps this far apart confirm a suspect
    waiting_timeout_s: float = 600.0  # "waiting on rank r" this long → a stall
    clear_after_s: float = 2.0  # a confirmed stall clears after progress for this long
    waiting_stack_interval_s: float = 15.0  # re-dump stacks this often while a job waits on one rank


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
DRAIN_PLACEHOLDERS = ("node", "reason", "job_id", "incident", "gpu", "xid")


@dataclass(frozen=True)
class FaultsConfig:
    xid_events: bool = True  # watch NVML Xid events on a thread (nvml backend only)
    event_wait_ms: int = 500  # one nvmlEventSetWait call; bounds how long stopping the watcher takes
    application_xids: tuple[int, ...] = DEFAULT_APPLICATION_XIDS  # incident only, no drain
    drain_command: tuple[str, ...] = DEFAULT_DRAIN_COMMAND  # argv, no shell; empty: no drain command
    drain_hook: str = ""  # name of a [hooks.NAME] to run instead of drain_command
    drain_timeout_s: float = 60.0  # drain_command's timeout (a drain_hook has its own timeout_s)


@dataclass(frozen=True)
class Config:
    agent: AgentConfig = field(default_factory=AgentConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    stacks: StacksConfig = field(default_factory=StacksConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)


SECTIONS: dict[str, type] = {
    "agent": AgentConfig,
    "detect": DetectConfig,
    "stacks": StacksConfig,
    "recovery": RecoveryConfig,
}

_CHOICES = {"agent.backend": ("auto", "nvml", "proc")}
# Keys that may be zero; every other number must be > 0.
_MAY_BE_ZERO = {"detect.spin_power_max_w", "detect.util_idle_max_percent", "detect.proc_rss_held_min_bytes",
                "detect.mem_held_min_bytes", "recovery.max_restarts", "detect.progress_io_min_bytes_per_s",
                "recovery.checkpoint_grace_s", "detect.spin_traffic_max_bytes_per_s"}
_RATIOS = {"detect.spin_power_max_ratio"}


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) <= 65535)


def _is_signal_name(text: str) -> bool:
    return text.startswith("SIG") and not text.startswith("SIG_") and isinstance(
        getattr(signal, text, None), signal.Signals)


# Non-empty strings with a format: (check, what the message says it must be).
_STRING_CHECKS = {
    "agent.metrics_addr": (_is_host_port, "HOST:PORT (or empty)"),
    "recovery.checkpoint_signal": (_is_signal_name, "a signal name such as SIGUSR1 (or empty)"),
}
_PERCENTS = {"detect.util_idle_max_percent", "detect.spin_util_min_percent"}


def _check_value(key: str, value: Any, default: Any) -> Any:
    """Type- and range-check one scalar key against the type of its default."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"config: {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config: {key} must be an integer, got {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config: {key} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"config: {key} must be a finite number, got {value!r}")
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"config: {key} must be a string, got {value!r}")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"config: {key} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
        if key in _STRING_CHECKS and value and not _STRING_CHECKS[key][0](value):
            raise ConfigError(f"config: {key} must be {_STRING_CHECKS[key][1]}, got {value!r}")
        return value
    if value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
        raise ConfigError(f"config: {key} must be {'>= 0' if key in _MAY_BE_ZERO else '> 0'}, got {value!r}")
    if key in _RATIOS and value > 1:
        raise ConfigError(f"config: {key} must be between 0 and 1, got {value!r}")
    if key in _PERCENTS and value > 100:
        raise ConfigError(f"config: {key} must be a percentage (0-100), got {value!r}")
    return value


def _load_section(name: str, cls: type, table: Any) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"config: [{name}] must be a table")
    defaults = cls()
    known = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(f"config: unknown key {name}.{key}")
    values = {k: _check_value(f"{name}.{k}", v, getattr(defaults, k)) for k, v in table.items()}
    return dataclasses.replace(defaults, **values)


def _env_table(key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"config: {key} must be a table of NAME = \"value\"")
    for name, v in value.items():
        if not name or not name.replace("_", "").isalnum() or name[0].isdigit():
            raise ConfigError(f"config: {key}.{name} is not a valid environment variable name")
        if not isinstance(v, str):
            raise ConfigError(f"config: {key}.{name} must be a string, got {v!r}")
    return dict(value)


def _load_fallback(table: Any) -> FallbackConfig:
    if not isinstance(table, dict):
        raise ConfigError("config: [fallback] must be a table")
    default = FallbackConfig()
    known = {"levels", "network_env", "diagnostics_env", "healthy_reset_s"}
    for key in table:
        if key not in known:
            raise ConfigError(f"config: unknown key fallback.{key}")
    levels = default.levels
    if "levels" in table:
        raw = table["levels"]
        if not isinstance(raw, list):
            raise ConfigError("config: fallback.levels must be an array of tables")
        parsed = []
        for i, lvl in enumerate(raw):
            key = f"fallback.levels[{i}]"
            if not isinstance(lvl, dict) or set(lvl) - {"name", "env", "advice"}:
                raise ConfigError(f"config: {key} must be a table with name, env and optional advice")
            if not isinstance(lvl.get("name"), str) or not lvl["name"]:
                raise ConfigError(f"config: {key}.name must be a non-empty string")
            advice = lvl.get("advice", "")
            if not isinstance(advice, str):
                raise ConfigError(f"config: {key}.advice must be a string")
            parsed.append(FallbackLevel(lvl["name"], _env_table(f"{key}.env", lvl.get("env", {})), advice))
        levels = tuple(parsed)
    return FallbackConfig(
        levels=levels,
        network_env=_env_table("fallback.network_env", table.get("network_env", {})),
        diagnostics_env=_env_table("fallback.diagnostics_env", table["diagnostics_env"])
        if "diagnostics_env" in table else default.diagnostics_env,
        healthy_reset_s=_check_value("fallback.healthy_reset_s", table.get("healthy_reset_s",
                                                                         default.healthy_reset_s), 1.0),
    )


def _validate_drain_element(key: str, element: str) -> None:
    """Only the known placeholders, no format specs, conversions, indexing or attribute access."""
    import string

    try:
        parsed = list(string.Formatter().parse(element))
    except ValueError as e:
        raise ConfigError(f"config: {key}: bad placeholder syntax in {element!r} ({e})") from None
    for _lit, name, spec, conv in parsed:
        if name is not None and (name not in DRAIN_PLACEHOLDERS or spec or conv):
            raise ConfigError(f"config: {key}: unknown placeholder {{{name}}} in {element!r}; allowed: "
                              + " ".join(f"{{{p}}}" for p in DRAIN_PLACEHOLDERS))


def _load_faults(table: Any, hooks: Any) -> FaultsConfig:
    if not isinstance(table, dict):
        raise ConfigError("config: [faults] must be a table")
    default = FaultsConfig()
    known = {f.name for f in dataclasses.fields(FaultsConfig)}
    for key in table:
        if key not in known:
            raise ConfigError(f"config: unknown key faults.{key}")
    values: dict[str, Any] = {}
    for key in ("xid_events", "event_wait_ms", "drain_hook", "drain_timeout_s"):
        if key in table:
            values[key] = _check_value(f"faults.{key}", table[key], getattr(default, key))
    if "application_xids" in table:
        xids = table["application_xids"]
        if not isinstance(xids, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 < x < 1 << 16 for x in xids):
            raise ConfigError(f"config: faults.application_xids must be an array of Xid numbers, got {xids!r}")
        values["application_xids"] = tuple(sorted(set(xids)))
    if "drain_command" in table:
        argv = table["drain_command"]
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ConfigError(f"config: faults.drain_command must be an array of strings, got {argv!r}")
        if argv and (not argv[0] or "{" in argv[0]):
            raise ConfigError("config: faults.drain_command[0] must be a fixed program name or path")
        for i, a in enumerate(argv):
            if "\0" in a:
                raise ConfigError(f"config: faults.drain_command[{i}] contains a NUL byte")
            _validate_drain_element(f"faults.drain_command[{i}]", a)
        values["drain_command"] = tuple(argv)
    cfg = dataclasses.replace(default, **values)
    if cfg.drain_hook and (not isinstance(hooks, dict) or cfg.drain_hook not in hooks):
        raise ConfigError(f"config: faults.drain_hook names no [hooks.{cfg.drain_hook}] table")
    return cfg


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build a validated Config from parsed TOML (or any mapping of the same shape)."""
    for section in data:
        if section not in SECTIONS and section not in ("fallback", "faults", "daemon", "hooks"):
            raise ConfigError(f"config: unknown section [{section}]")
    if "daemon" in data or "hooks" in data:  # the node daemon's sections (used by `gpu-watchdog run` only)
        from gpu_watchdog.config.daemon import parse_daemon_sections

        parse_daemon_sections(data)
    parts = {name: _load_section(name, cls, data[name]) for name, cls in SECTIONS.items() if name in data}
    if "fallback" in data:
        parts["fallback"] = _load_fallback(data["fallback"])
    if "faults" in data:
        parts["faults"] = _load_faults(data["faults"], data.get("hooks", {}))
    cfg = dataclasses.replace(Config(), **parts)
    if cfg.detect.spin_util_min_percent <= cfg.detect.util_idle_max_percent:
        raise ConfigError("config: detect.spin_util_min_percent must be above detect.util_idle_max_percent")
    return cfg


def resolve_state_dir(cfg: Config) -> Path:
    """agent.state_dir, or the per-user default when it is empty."""
    if cfg.agent.state_dir:
        return Path(cfg.agent.state_dir)
    if os.geteuid() == 0:
        return Path("/var/lib/gpu-watchdog")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpu-watchdog"


def load_config(path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Load ``path`` (None: defaults only) and apply dotted-key overrides from the command line."""
    return config_from_dict(read_config_data(path, overrides))


def read_config_data(path: str | os.PathLike[str] | None,
                     overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The parsed TOML of ``path`` (empty when None) with dotted-key overrides applied; not yet validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config: file not found: {p}") from None
        except OSError as e:
            raise ConfigError(f"config: cannot read {p}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config: {p} is not valid TOML: {e}") from None
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".", 1)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config: [{section}] must be a table")
        table[key] = value
    return data


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        # A JSON string is a TOML basic string once DEL is escaped too (raw non-ASCII: TOML has no surrogates).
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def render_toml(cfg: Config) -> str:
    """The effective config as TOML that load_config reads back to the same Config."""
    lines: list[str] = []
    for name in SECTIONS:
        lines.append(f"[{name}]")
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            lines.append(f"{f.name} = {_toml_value(getattr(section, f.name))}")
        lines.append("")
    fb = cfg.fallback
    lines += ["[fallback]", f"healthy_reset_s = {fb.healthy_reset_s!r}",
              f"network_env = {_toml_value(fb.network_env)}",
              f"diagnostics_env = {_toml_value(fb.diagnostics_env)}", ""]
    for lvl in fb.levels:
        lines += ["[[fallback.levels]]", f"name = {_toml_value(lvl.name)}", f"env = {_toml_value(lvl.env)}",
                  f"advice = {_toml_value(lvl.advice)}", ""]
    fa = cfg.faults
    lines += ["[faults]"] + [
        f"{f.name} = " + ("[" + ", ".join(_toml_value(x) for x in getattr(fa, f.name)) + "]"
                          if isinstance(getattr(fa, f.name), tuple) else _toml_value(getattr(fa, f.name)))
        for f in dataclasses.fields(fa)] + [""]
    return "\n".join(lines)
