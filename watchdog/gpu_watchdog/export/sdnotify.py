"""A dependency-free sd_notify(3) client.

``Notifier.from_env()`` reads ``NOTIFY_SOCKET`` (an absolute path, or ``@name`` for the abstract
namespace); without it every call is a no-op, so the daemon code never checks whether it runs under
systemd. Send errors are never raised: the first failure of an outage is logged at warning, the
rest at debug, and the methods return ``False``.

The systemd watchdog must prove that the *sampling loop* is alive, not merely that some thread of the
process still runs, so ``WATCHDOG=1`` is sent by export/health.py's ``Pinger``, gated on
``LoopHealth.loop_alive()``; a wedged loop stops the pings and systemd restarts the daemon ``WatchdogSec``
later.

Typical wiring in ``gpu-watchdog run``::

    notifier = Notifier.from_env(unset_environment=True)   # children (hooks, py-spy) don't inherit it
    health = LoopHealth.for_interval(cfg.agent.interval_s)
    if notifier.watchdog_interval_s:
        pinger = Pinger(health, notifier.watchdog, notifier.watchdog_interval_s)
    ... each tick: health.tick_ok() or health.tick_failed(why)
    ... first good tick: notifier.ready("watching 8 GPUs")
    ... pinger.start() ... on SIGHUP: notifier.reloading(); reload; notifier.ready()
    ... shutdown: notifier.stopping(); pinger.stop()
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

__all__ = ["Notifier", "watchdog_interval_s"]

_KEY_RE = re.compile(r"[A-Z][A-Z0-9_]*\Z")
_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
SEND_TIMEOUT_S = 2.0  # a full systemd notify queue must not hang the caller for long


def watchdog_interval_s(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``WATCHDOG_USEC``, in seconds, or None.

    None when the systemd watchdog is off for this process: ``WATCHDOG_USEC`` unset, zero or not a
    number, or ``WATCHDOG_PID`` set to another pid (the variables were inherited from a parent).
    """
    env = os.environ if environ is None else environ
    raw = env.get("WATCHDOG_USEC", "").strip()
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    wpid = env.get("WATCHDOG_PID", "").strip()
    if wpid:
        try:
            if int(wpid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return usec / 2_000_000.0


def _format_value(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    # One field is one line: a newline inside STATUS (e.g. from an exception text) would start a
    # bogus field, so fold line breaks into spaces.
    return " ".join(str(value).splitlines())


class Notifier:
    """Sends sd_notify messages to ``address``; with no address every method is a no-op returning False.

    Thread-safe: each message is one datagram on one shared socket.
    """

    def __init__(self, address: str | None, *, watchdog_interval_s: float | None = None) -> None:
        self.address = address or None
        self.watchdog_interval_s = watchdog_interval_s  # half of WatchdogSec=, None when off
        self._sockaddr: str | bytes | None = None
        if self.address is not None:
            if self.address.startswith("@"):
                # Abstract namespace: a leading NUL, no trailing NUL (as systemd binds it).
                self._sockaddr = b"\0" + self.address[1:].encode()
            elif self.address.startswith("/"):
                self._sockaddr = self.address
            else:
                # e.g. "vsock:…" (systemd ≥ 254 in VMs): not supported here, say so once.
                log.warning("NOTIFY_SOCKET=%r is not a unix socket path; systemd notifications are off",
                            self.address)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None, *,
                 unset_environment: bool = False) -> Notifier:
        """Build from ``NOTIFY_SOCKET`` (and ``WATCHDOG_USEC``/``WATCHDOG_PID``).

        ``unset_environment=True`` removes the three variables afterwards (like sd_notify's argument),
        so child processes (hooks, py-spy, supervised jobs) do not inherit them.
        """
        env = os.environ if environ is None else environ
        notifier = cls(env.get("NOTIFY_SOCKET") or None, watchdog_interval_s=watchdog_interval_s(env))
        if unset_environment:
            for key in _ENV_KEYS:
                env.pop(key, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self._sockaddr is not None

    def send(self, **fields: object) -> bool:
        """Send one message, ``KEY=value`` per field (``send(READY=1, STATUS="up")``).

        Returns True when the datagram was sent. Keys must be upper-case sd_notify field names
        (a wrong key is a programming error and raises ValueError); send failures never raise.
        """
        for key in fields:
            if not _KEY_RE.match(key):
                raise ValueError(f"sd_notify field name must be upper case: {key!r}")
        if self._sockaddr is None or not fields:
            return False
        data = "".join(f"{k}={_format_value(v)}\n" for k, v in fields.items()).encode()
        try:
            with self._lock:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    sock.settimeout(SEND_TIMEOUT_S)
                    self._sock = sock
                self._sock.sendto(data, self._sockaddr)
        except OSError as e:
            if not self._failing:
                log.warning("sd_notify to %s failed: %s (further failures logged at debug)", self.address, e)
                self._failing = True
            else:
                log.debug("sd_notify to %s failed: %s", self.address, e)
            return False
        if self._failing:
            log.info("sd_notify to %s works again", self.address)
            self._failing = False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Start-up (or a reload) is complete: ``READY=1``, optionally with a status line."""
        if status is None:
            return self.send(READY=1)
        return self.send(READY=1, STATUS=status)

    def reloading(self) -> bool:
        """A reload (SIGHUP) began; send ``ready()`` when it is done."""
        return self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def watchdog(self) -> bool:
        """Keep-alive ping: ``WATCHDOG=1``. Send it from export.health.Pinger, which checks the loop first."""
        return self.send(WATCHDOG=1)

    def status(self, line: str) -> bool:
        """The one-line status shown by ``systemctl status``."""
        return self.send(STATUS=line)

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown began: ``STOPPING=1``."""
        if status is None:
            return self.send(STOPPING=1)
        return self.send(STOPPING=1, STATUS=status)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start/stop timeout fires (slow NVML init, draining)."""
        return self.send(EXTEND_TIMEOUT_USEC=max(0, int(seconds * 1_000_000)))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __repr__(self) -> str:
        return f"Notifier({self.address!r}, watchdog_interval_s={self.watchdog_interval_s!r})"
