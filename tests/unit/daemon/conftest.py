"""Fixtures of the daemon's unit tests: a short base directory (a Unix socket path must stay under 108 bytes) and
in-process daemons on it."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import short_dir
from gpu_watchdog.config.schema import Config, DaemonSettings
from gpu_watchdog.daemon.service import Daemon
from gpu_watchdog.export.sdnotify import Notifier

MakeDaemon = Callable[..., Daemon]


@pytest.fixture
def base() -> Iterator[Path]:
    d = short_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_daemon(base: Path) -> MakeDaemon:
    """``make_daemon(settings={...}, **config_sections)``: a daemon on ``base`` whose control socket is
    ``base/c.sock``, with no socket group and no systemd notifier."""
    def make(settings: dict[str, Any] | None = None, **sections: Any) -> Daemon:
        cfg = Config(daemon=DaemonSettings(control_socket=str(base / "c.sock"), socket_group="", **(settings or {})),
                     **sections)
        return Daemon(cfg, cfg.daemon, base / "state", notifier=Notifier(None))

    return make
