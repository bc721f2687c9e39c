"""Argument helpers shared by every sub-command module (``cli.main``, ``cli.daemon``).

They live apart from ``cli.main`` so that a command module can use them without importing the module that
registers it (which would be an import cycle).
"""

from __future__ import annotations

import argparse
from typing import Any


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def pid_arg(text: str) -> int:
    """argparse type: a process id."""
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"not a pid: {text!r}")
    return int(text)


def add_common_options(p: argparse.ArgumentParser, backend: bool = False, state_dir: bool = False,
                       metrics: bool = False) -> None:
    """``--config`` and, when asked, the options that override ``agent.*`` keys (see ``config_overrides``)."""
    p.add_argument("--config", metavar="F", help="TOML config file (default: built-in defaults)")
    if state_dir:
        p.add_argument("--state-dir", metavar="D", help="where incidents and state live")
    if backend:
        p.add_argument("--backend", choices=("auto", "nvml", "proc"),
                       help="auto: NVML when a GPU is present, else proc")
    if metrics:
        p.add_argument("--metrics-addr", metavar="HOST:PORT", help="serve /metrics and /healthz here")


# The command-line options that override config keys: option → dotted key.
OVERRIDE_OPTIONS = {"--backend": "agent.backend", "--state-dir": "agent.state_dir",
                    "--metrics-addr": "agent.metrics_addr"}


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted config keys that ``add_common_options``' options override, for ``load_config``."""
    overrides: dict[str, Any] = {}
    for option, key in OVERRIDE_OPTIONS.items():
        value = getattr(args, option[2:].replace("-", "_"), None)
        if value is not None and (value != "" or option == "--metrics-addr"):  # an empty address turns /metrics off
            overrides[key] = value
    return overrides


def checked_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``config_overrides``, checked on their own first: a bad value given on the command line (``--metrics-addr
    bogus``) is a usage error (exit 64) naming the option, not a bad config file (78)."""
    from gpu_watchdog.config.load import load_config
    from gpu_watchdog.errors import ConfigError, UsageError

    overrides = config_overrides(args)
    try:
        load_config(None, overrides)
    except ConfigError as e:
        option = next((o for o, k in OVERRIDE_OPTIONS.items() if k in overrides and k in str(e)), "command line")
        raise UsageError(f"{option}: {str(e).removeprefix('config: ')}") from None
    return overrides
