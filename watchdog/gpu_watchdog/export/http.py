"""The agent's HTTP endpoint: ``/metrics`` from prometheus_client's WSGI app, ``/healthz`` from LoopHealth.

Default listen address: ``0.0.0.0:9408`` for the daemon (``agent.metrics_addr`` / ``--metrics-addr``);
9408 rather than dcgm-exporter's 9400 so both run side by side on a node. ``launch`` serves nothing unless
``--metrics-addr`` is given. IPv4 and IPv6 hosts (``[::1]:9408``); port 0 takes any free port.

Endpoints:
- ``/metrics``: ``prometheus_client.make_wsgi_app``, so Prometheus text or OpenMetrics by ``Accept``, gzip
  by ``Accept-Encoding``, and ``?name[]=...`` filtering behave as in every prometheus_client exporter. A
  collector that raises answers 500 with a one-line body; the server keeps serving.
- ``/healthz``: 200 ``ok`` or 503 with the reason, from ``LoopHealth.status()`` (the same loop health that
  gates the systemd watchdog pings).
- ``/``: a tiny index page; anything else 404.

Requests are served by a thread each (wsgiref, as prometheus_client's ``start_wsgi_server``) behind a daemon
thread, so a slow scraper never delays the sampling loop and the endpoint never keeps the process alive.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from gpu_watchdog.errors import EXIT_UNAVAILABLE, UsageError, WatchdogError
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.export.metrics import AgentMetrics

if TYPE_CHECKING:
    from gpu_watchdog.config.schema import Config

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_ADDR", "DEFAULT_PORT", "MetricsServeError", "MetricsServer", "parse_addr", "serve",
           "start_metrics"]

DEFAULT_PORT = 9408
DEFAULT_ADDR = f"0.0.0.0:{DEFAULT_PORT}"

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

_TEXT = "text/plain; charset=utf-8"
_INDEX = (b'<html><head><title>gpu-watchdog</title></head><body><h1>gpu-watchdog</h1>'
          b'<a href="/metrics">/metrics</a> <a href="/healthz">/healthz</a></body></html>\n')
_MAX_ERROR_LEN = 200  # a 500's body names the error, not a traceback
_POLL_S = 0.1  # how often the accept loop checks for stop(): bounds stop()'s wait, costs ~nothing idle


class MetricsServeError(WatchdogError):
    """The metrics endpoint cannot listen (address in use, not allowed, unknown host)."""

    exit_code = EXIT_UNAVAILABLE


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9408``, ``:9408`` = all interfaces) → (host, port); UsageError naming the flag."""
    text = addr.strip()
    host, sep, port_s = text.rpartition(":")
    if not sep or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise UsageError(f"--metrics-addr must be HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}), got {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise UsageError(f"--metrics-addr: write an IPv6 host in brackets ([::1]:{DEFAULT_PORT}), got {addr!r}")
    return host or "0.0.0.0", int(port_s)


def _respond(start_response: Callable[..., Any], status: str, body: bytes, ctype: str = _TEXT,
             extra: Iterable[tuple[str, str]] = (), exc_info: Any = None) -> list[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body))), *extra], exc_info)
    return [body]


def _make_app(registry: CollectorRegistry, health: LoopHealth) -> WSGIApp:
    """The endpoint as a WSGI app: routes /metrics, /healthz and / (see the module docstring)."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            try:
                return metrics_app(environ, start_response)  # type: ignore[no-any-return]
            except Exception as e:  # a broken collector must not take the endpoint down
                log.exception("metrics: collect failed")
                why = " ".join(f"{type(e).__name__}: {e}".split())[:_MAX_ERROR_LEN]
                return _respond(start_response, "500 Internal Server Error", f"collect failed: {why}\n".encode(),
                                exc_info=sys.exc_info())
        if path not in ("/healthz", "/"):
            return _respond(start_response, "404 Not Found", b"not found\n")
        if environ.get("REQUEST_METHOD") != "GET":
            return _respond(start_response, "405 Method Not Allowed", b"use GET\n", extra=[("Allow", "GET")])
        if path == "/":
            return _respond(start_response, "200 OK", _INDEX, "text/html; charset=utf-8")
        ok, reason = health.status()
        return _respond(start_response, "200 OK" if ok else "503 Service Unavailable", f"{reason}\n".encode())

    return app


class _Handler(WSGIRequestHandler):
    """Logs requests at debug (wsgiref writes each to stderr)."""

    disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms delayed-ACK stall

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (signature of the base class)
        log.debug("metrics http: " + format, *args)


class _Server(ThreadingWSGIServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A request that broke outside the app (client gone mid-request, bad request line): debug, not stderr."""
        log.debug("metrics http: request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """A running WSGI server on ``host:port`` (port 0: any free port, ``.port`` says which), served from a
    daemon thread. ``stop()`` (or leaving the ``with`` block) closes it."""

    def __init__(self, host: str, port: int, app: WSGIApp, origin: str = "--metrics-addr") -> None:
        try:
            family, *_, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
            server_cls = _Server6 if family == socket.AF_INET6 else _Server
            self._httpd = make_server(str(sockaddr[0]), port, app, server_cls, handler_class=_Handler)
        except OSError as e:  # in use, not allowed, unknown host (gaierror)
            why = e.strerror or str(e)
            raise MetricsServeError(f"{origin} {_fmt(host, port)}: cannot listen: {why}") from None
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": _POLL_S},
                                        name="gpu-watchdog-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where a client on this host reaches the server (the wildcard hosts map to loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{_fmt(host, self.port)}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(addr: str, registry: CollectorRegistry, health: LoopHealth,
          origin: str = "--metrics-addr") -> MetricsServer:
    """Serve /metrics (``registry``) and /healthz (``health``) on ``HOST:PORT``; ``origin`` names where the address
    came from in the error when it cannot listen."""
    host, port = parse_addr(addr)
    server = MetricsServer(host, port, _make_app(registry, health), origin)
    log.info("metrics: serving /metrics and /healthz on %s", server.url)
    return server


def start_metrics(cfg: Config, health: LoopHealth, *, config_path: str | None = None,
                  overrides: Mapping[str, Any] | None = None) -> tuple[AgentMetrics | None, MetricsServer | None]:
    """AgentMetrics and its server when ``agent.metrics_addr`` (``--metrics-addr``) is set, else (None, None). A port
    that cannot be had is reported under the name the user gave it: the option, or the config file's key."""
    if not cfg.agent.metrics_addr:
        return None, None
    origin = ("--metrics-addr" if "agent.metrics_addr" in (overrides or {})
              else f"agent.metrics_addr in {config_path}" if config_path else "agent.metrics_addr")
    metrics = AgentMetrics(interval_s=cfg.agent.interval_s)
    return metrics, serve(cfg.agent.metrics_addr, metrics.registry, health, origin)


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
