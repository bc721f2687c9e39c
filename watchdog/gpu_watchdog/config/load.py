"""The one config loader: TOML file + command-line overrides → a validated ``Config``.

Every command, the daemon and its SIGHUP reload go through ``load_config``, so a key is checked the same way
wherever it is read. A bad value raises ConfigError with one line naming the key (the CLI exits 78).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpu_watchdog.config.argv_templates import validate_argv
from gpu_watchdog.config.schema import (
    DRAIN_PLACEHOLDERS,
    HOOK_MAX_TIMEOUT_S,
    HOOK_PLACEHOLDERS,
    HOOK_TYPES,
    MIN_SLICE_SAMPLES,
    SECTIONS,
    Config,
    FallbackLevel,
    HookSpec,
)
from gpu_watchdog.errors import ConfigError, NoInputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_CHOICES = {"agent.backend": ("auto", "nvml", "proc"), "ras.enabled": ("auto", "on", "off")}
# Keys that may be zero; every other number must be > 0.
_MAY_BE_ZERO = {"detect.spin_power_max_w", "detect.util_idle_max_percent", "detect.proc_rss_held_min_bytes",
                "detect.mem_held_min_bytes", "recovery.max_restarts", "detect.progress_io_min_bytes_per_s",
                "recovery.checkpoint_grace_s", "detect.spin_traffic_max_bytes_per_s",
                "detect.spin_mem_util_max_percent", "detect.spin_traffic_max_link_ratio", "agent.incident_trace_s",
                "agent.no_rank_warning_s",
                "recovery.restart_backoff_s", "fallback.actor_grace_s", "ras.watch_interval_s"}
_RATIOS = {"detect.spin_power_max_ratio", "detect.spin_traffic_max_link_ratio", "detect.deadline_warn_ratio",
           "straggler.min_peer_wait_share", "straggler.max_share_ratio"}
_PERCENTS = {"detect.util_idle_max_percent", "detect.spin_util_min_percent", "detect.spin_mem_util_max_percent",
             "straggler.cpu_budget_percent"}


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) <= 65535)


def _is_signal_name(text: str) -> bool:
    return text.startswith("SIG") and not text.startswith("SIG_") and isinstance(
        getattr(signal, text, None), signal.Signals)


def _is_socket_path(text: str) -> bool:
    return text.startswith("/") and len(text.encode()) <= 100  # sun_path holds 108 bytes; keep a margin


# Non-empty strings with a format: (check, what the message says it must be).
_STRING_CHECKS = {
    "agent.metrics_addr": (_is_host_port, "HOST:PORT (or empty)"),
    "ras.addr": (_is_host_port, "HOST:PORT (or empty)"),
    "fallback.shared_dir": (os.path.isabs, "an absolute path (or empty)"),
    "recovery.checkpoint_signal": (_is_signal_name, "a signal name such as SIGUSR1 (or empty)"),
    "daemon.control_socket": (_is_socket_path, "an absolute path of at most 100 bytes (or empty)"),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_value(key: str, value: Any, default: Any) -> Any:
    """Type- and range-check one scalar key against the type of its default."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"config: {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if not _is_int(value):
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


# -- the keys that are not scalars: each has a parser (key, value) -> value ----------------------------------
def _env_table(key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"config: {key} must be a table of NAME = \"value\"")
    for name, v in value.items():
        if not name or not name.replace("_", "").isalnum() or name[0].isdigit():
            raise ConfigError(f"config: {key}.{name} is not a valid environment variable name")
        if not isinstance(v, str):
            raise ConfigError(f"config: {key}.{name} must be a string, got {v!r}")
    return dict(value)


def _levels(key: str, value: Any) -> tuple[FallbackLevel, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"config: {key} must be an array of tables")
    parsed = []
    for i, lvl in enumerate(value):
        lk = f"{key}[{i}]"
        if not isinstance(lvl, dict) or set(lvl) - {"name", "env", "advice"}:
            raise ConfigError(f"config: {lk} must be a table with name, env and optional advice")
        if not isinstance(lvl.get("name"), str) or not lvl["name"]:
            raise ConfigError(f"config: {lk}.name must be a non-empty string")
        advice = lvl.get("advice", "")
        if not isinstance(advice, str):
            raise ConfigError(f"config: {lk}.advice must be a string")
        parsed.append(FallbackLevel(lvl["name"], _env_table(f"{lk}.env", lvl.get("env", {})), advice))
    return tuple(parsed)


def _xids(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(x) and 0 < x < 1 << 16 for x in value):
        raise ConfigError(f"config: {key} must be an array of Xid numbers, got {value!r}")
    return tuple(sorted(set(value)))


def _ids(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise ConfigError(f"config: {key} must be an array of non-negative integers, got {value!r}")
    return tuple(value)


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "fallback.levels": _levels,
    "fallback.network_env": _env_table,
    "fallback.diagnostics_env": _env_table,
    "faults.application_xids": _xids,
    "faults.drain_command": lambda key, v: validate_argv(key, v, DRAIN_PLACEHOLDERS, may_be_empty=True),
    "daemon.allowed_uids": _ids,
    "daemon.allowed_gids": _ids,
}


def _load_table(name: str, cls: type, table: Any) -> Any:
    """One ``[name]`` table onto the defaults of ``cls``: unknown keys refused, each value checked by key."""
    if not isinstance(table, dict):
        raise ConfigError(f"config: [{name}] must be a table")
    defaults = cls()
    known = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(f"config: unknown key {name}.{key}")
    values = {}
    for key, value in table.items():
        dotted = f"{name}.{key}"
        parse = _PARSERS.get(dotted)
        values[key] = parse(dotted, value) if parse else _check_value(dotted, value, getattr(defaults, key))
    return dataclasses.replace(defaults, **values)


def _load_hook(name: str, table: Any) -> HookSpec:
    key = f"hooks.{name}"
    if not name.replace("-", "").replace("_", "").isalnum() or len(name) > 64:
        raise ConfigError(f"config: {key}: hook names use letters, digits, - and _")
    if not isinstance(table, dict):
        raise ConfigError(f"config: [{key}] must be a table")
    unknown = set(table) - {"type", "argv", "timeout_s"}
    if unknown:
        raise ConfigError(f"config: unknown key {key}.{sorted(unknown)[0]}")
    htype = table.get("type", "command")
    if not isinstance(htype, str) or htype not in HOOK_TYPES:
        raise ConfigError(f"config: {key}.type must be one of {', '.join(HOOK_TYPES)}, got {htype!r}")
    argv = validate_argv(f"{key}.argv", table.get("argv", list(HOOK_TYPES[htype])), HOOK_PLACEHOLDERS,
                         may_be_empty=False)
    default = HookSpec(name, htype, argv)
    timeout = _check_value(f"{key}.timeout_s", table.get("timeout_s", default.timeout_s), default.timeout_s)
    if timeout > HOOK_MAX_TIMEOUT_S:
        raise ConfigError(f"config: {key}.timeout_s must be a number of seconds in (0, {HOOK_MAX_TIMEOUT_S:g}], "
                          f"got {timeout!r}")
    return dataclasses.replace(default, timeout_s=timeout)


def _load_hooks(value: Any) -> dict[str, HookSpec]:
    if not isinstance(value, dict):
        raise ConfigError("config: [hooks] must be a table of [hooks.NAME] tables")
    return {name: _load_hook(name, table) for name, table in value.items()}


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build a validated Config from parsed TOML (or any mapping of the same shape)."""
    for section in data:
        if section not in SECTIONS and section != "hooks":
            raise ConfigError(f"config: unknown section [{section}]")
    parts: dict[str, Any] = {name: _load_table(name, cls, data[name])
                             for name, cls in SECTIONS.items() if name in data}
    if "hooks" in data:
        parts["hooks"] = _load_hooks(data["hooks"])
    cfg = dataclasses.replace(Config(), **parts)
    # Rules across keys.
    if cfg.detect.spin_util_min_percent <= cfg.detect.util_idle_max_percent:
        raise ConfigError("config: detect.spin_util_min_percent must be above detect.util_idle_max_percent")
    st = cfg.straggler
    least = st.slices * MIN_SLICE_SAMPLES * st.interval_s
    if st.window_s < least:
        raise ConfigError(f"config: straggler.window_s must hold {MIN_SLICE_SAMPLES} samples per slice: at least "
                          f"slices x {MIN_SLICE_SAMPLES} x interval_s = {least:g}, got {st.window_s:g}")
    least = st.signal_slices * MIN_SLICE_SAMPLES * cfg.agent.interval_s
    if st.signals and st.signal_window_s < least:
        raise ConfigError(f"config: straggler.signal_window_s must hold {MIN_SLICE_SAMPLES} ticks per slice: at "
                          f"least signal_slices x {MIN_SLICE_SAMPLES} x agent.interval_s = {least:g}, got "
                          f"{st.signal_window_s:g}")
    if cfg.faults.drain_hook and cfg.faults.drain_hook not in cfg.hooks:
        raise ConfigError(f"config: faults.drain_hook names no [hooks.{cfg.faults.drain_hook}] table")
    return cfg


def read_config_data(path: str | os.PathLike[str] | None,
                     overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The parsed TOML of ``path`` (empty when None) with dotted-key overrides applied; not yet validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:  # a missing input (66), not bad content (78)
            raise NoInputError(f"config: file not found: {p}") from None
        except OSError as e:
            raise NoInputError(f"config: cannot read {p}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config: {p} is not UTF-8 text: {e.reason}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config: {p} is not valid TOML: {e}") from None
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".", 1)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config: [{section}] must be a table")
        table[key] = value
    return data


def load_config(path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Load ``path`` (None: defaults only) and apply dotted-key overrides (``agent.backend``, ...) from the
    command line; ``cfg.daemon`` and ``cfg.hooks`` come with it."""
    return config_from_dict(read_config_data(path, overrides))
