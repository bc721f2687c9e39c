"""The node daemon's own config sections: ``[daemon]`` (control socket, who may use it, housekeeping) and
``[hooks.NAME]`` (restart hooks). Both live in the same root-owned TOML file as the rest of the config.

``config.config_from_dict`` validates these sections too (so ``gpu-watchdog config show`` rejects a bad
hook), but only ``gpu-watchdog run`` uses them: ``load_daemon_config`` returns (Config, DaemonSettings).

Hooks: the control API selects a hook by *name*; the command is only ever the argv template written here.
Each argv element may contain the placeholders ``{job_id} {node} {level} {incident}``; they are substituted
per element, never through a shell, so a value can never add or split argv elements. Types:
``command`` (argv required), ``slurm-requeue`` (default argv ``scontrol requeue {job_id}``) and
``k8s-delete-pod`` (default argv ``kubectl delete pod {job_id} --wait=false``: register the pod name as the
job id).
"""

from __future__ import annotations

import grp
import os
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpu_watchdog.config.schema import Config, config_from_dict, read_config_data
from gpu_watchdog.errors import ConfigError

PLACEHOLDERS = ("job_id", "node", "level", "incident")
HOOK_TYPES: dict[str, tuple[str, ...]] = {
    "command": (),
    "slurm-requeue": ("scontrol", "requeue", "{job_id}"),
    "k8s-delete-pod": ("kubectl", "delete", "pod", "{job_id}", "--wait=false"),
}
DEFAULT_SOCKET = "/run/gpu-watchdog/control.sock"


@dataclass(frozen=True)
class HookSpec:
    name: str
    type: str
    argv: tuple[str, ...]
    timeout_s: float = 60.0


@dataclass(frozen=True)
class DaemonSettings:
    control_socket: str = DEFAULT_SOCKET  # empty: no control API
    socket_group: str = "gpu-watchdog"  # group of the socket (mode 0660); empty: the daemon's group
    allowed_uids: tuple[int, ...] = ()  # peers allowed besides root
    allowed_gids: tuple[int, ...] = ()  # peers whose primary or supplementary group is one of these
    allow_root: bool = True  # root (uid 0) is always allowed; false only for tests
    max_request_bytes: int = 65536
    preempt_timeout_s: float = 60.0  # longest wait for a job's checkpoint acknowledgement
    stop_unregistered: bool = False  # stop stalled jobs nobody registered (there is no way to restart them)
    incident_max_age_days: float = 30.0  # housekeeping: incident directories older than this are removed
    incident_max_total_mb: float = 2048.0  # ... and the oldest go until all incidents fit in this
    housekeeping_interval_s: float = 600.0
    hooks: Mapping[str, HookSpec] = field(default_factory=dict)


_DAEMON_KEYS = {"control_socket", "socket_group", "allowed_uids", "allowed_gids", "allow_root",
                "max_request_bytes", "preempt_timeout_s", "stop_unregistered", "incident_max_age_days",
                "incident_max_total_mb", "housekeeping_interval_s"}


def validate_template(key: str, element: str) -> None:
    """Only the known placeholders, no format specs, conversions, indexing or attribute access."""
    try:
        parsed = list(string.Formatter().parse(element))
    except ValueError as e:
        raise ConfigError(f"config: {key}: bad placeholder syntax in {element!r} ({e})") from None
    for _lit, name, spec, conv in parsed:
        if name is None:
            continue
        if name not in PLACEHOLDERS or spec or conv:
            raise ConfigError(f"config: {key}: unknown placeholder {{{name}}} in {element!r}; allowed: "
                              + " ".join(f"{{{p}}}" for p in PLACEHOLDERS))


def _parse_hook(name: str, table: Any) -> HookSpec:
    key = f"hooks.{name}"
    if not name.replace("-", "").replace("_", "").isalnum() or len(name) > 64:
        raise ConfigError(f"config: {key}: hook names use letters, digits, - and _")
    if not isinstance(table, dict):
        raise ConfigError(f"config: [{key}] must be a table")
    unknown = set(table) - {"type", "argv", "timeout_s"}
    if unknown:
        raise ConfigError(f"config: unknown key {key}.{sorted(unknown)[0]}")
    htype = table.get("type", "command")
    if htype not in HOOK_TYPES:
        raise ConfigError(f"config: {key}.type must be one of {', '.join(HOOK_TYPES)}, got {htype!r}")
    argv = table.get("argv", list(HOOK_TYPES[htype]))
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ConfigError(f"config: {key}.argv must be a non-empty array of strings")
    if not argv[0] or "{" in argv[0]:
        raise ConfigError(f"config: {key}.argv[0] must be a fixed program name or path")
    for i, a in enumerate(argv):
        if "\0" in a:
            raise ConfigError(f"config: {key}.argv[{i}] contains a NUL byte")
        validate_template(f"{key}.argv[{i}]", a)
    timeout = table.get("timeout_s", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise ConfigError(f"config: {key}.timeout_s must be a number of seconds in (0, 86400], got {timeout!r}")
    return HookSpec(name, htype, tuple(argv), float(timeout))


def _id_list(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value):
        raise ConfigError(f"config: {key} must be an array of non-negative integers")
    return tuple(value)


def parse_daemon_sections(data: Mapping[str, Any]) -> DaemonSettings:
    """Validate ``[daemon]`` and ``[hooks.*]`` of a parsed config; ConfigError names the key."""
    d = DaemonSettings()
    table = data.get("daemon", {})
    if not isinstance(table, dict):
        raise ConfigError("config: [daemon] must be a table")
    for key in table:
        if key not in _DAEMON_KEYS:
            raise ConfigError(f"config: unknown key daemon.{key}")
    values: dict[str, Any] = {}
    for key, v in table.items():
        dk = f"daemon.{key}"
        default = getattr(d, key)
        if key in ("allowed_uids", "allowed_gids"):
            values[key] = _id_list(dk, v)
        elif isinstance(default, bool):
            if not isinstance(v, bool):
                raise ConfigError(f"config: {dk} must be true or false, got {v!r}")
            values[key] = v
        elif isinstance(default, str):
            if not isinstance(v, str):
                raise ConfigError(f"config: {dk} must be a string, got {v!r}")
            if key == "control_socket" and v and not v.startswith("/"):
                raise ConfigError(f"config: {dk} must be an absolute path (or empty), got {v!r}")
            if key == "control_socket" and len(v.encode()) > 100:
                raise ConfigError(f"config: {dk} is longer than a unix socket path may be")
            values[key] = v
        else:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"config: {dk} must be a number > 0, got {v!r}")
            values[key] = type(default)(v)
    hooks_t = data.get("hooks", {})
    if not isinstance(hooks_t, dict):
        raise ConfigError("config: [hooks] must be a table of [hooks.NAME] tables")
    values["hooks"] = {name: _parse_hook(name, t) for name, t in hooks_t.items()}
    return DaemonSettings(**{**d.__dict__, **values})


def socket_gid(settings: DaemonSettings) -> int | None:
    if not settings.socket_group:
        return None
    try:
        return grp.getgrnam(settings.socket_group).gr_gid
    except KeyError:
        return None


def load_daemon_config(path: str | os.PathLike[str] | None,
                       overrides: Mapping[str, Any] | None = None) -> tuple[Config, DaemonSettings]:
    data = read_config_data(path, overrides)
    settings = parse_daemon_sections(data)
    cfg = config_from_dict(data)  # also checks [faults] drain_hook against [hooks]
    return cfg, settings
