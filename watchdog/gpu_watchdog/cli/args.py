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


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted config keys that ``add_common_options``' options override, for ``load_config``."""
    overrides: dict[str, Any] = {}
    if getattr(args, "backend", None):
        overrides["agent.backend"] = args.backend
    if getattr(args, "state_dir", None):
        overrides["agent.state_dir"] = args.state_dir
    if getattr(args, "metrics_addr", None) is not None:
        overrides["agent.metrics_addr"] = args.metrics_addr
    return overrides
