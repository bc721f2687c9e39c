"""gpu_watchdog.export.http: the endpoint on prometheus_client's WSGI app, through real HTTP requests."""

from __future__ import annotations

import gzip
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from gpu_watchdog.config.load import config_from_dict
from gpu_watchdog.errors import EXIT_UNAVAILABLE, UsageError
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.export.http import (
    DEFAULT_PORT,
    MetricsServeError,
    MetricsServer,
    parse_addr,
    serve,
    start_metrics,
)
from gpu_watchdog.export.metrics import AgentMetrics
from gpu_watchdog.model import DeviceSample, NodeSample
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @property
    def text(self) -> str:
        return self.body.decode()


def get(url: str, method: str = "GET", **headers: str) -> Response:
    req = urllib.request.Request(url, method=method, headers={k.replace("_", "-"): v for k, v in headers.items()})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return Response(r.status, dict(r.headers), r.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, dict(e.headers), e.read())


def sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def metrics() -> AgentMetrics:
    m = AgentMetrics()
    d = DeviceSample(0, "GPU-0", "NVIDIA H100", util_percent=50.0, mem_used_bytes=1 << 30)
    m.update(NodeSample(t=1_700_000_000.0, hostname="node1", backend="nvml", devices=(d,)), {}, {})
    return m


@pytest.fixture
def server(metrics: AgentMetrics) -> Iterator[MetricsServer]:
    health = LoopHealth(10.0)
    health.tick_ok()
    with serve("127.0.0.1:0", metrics.registry, health) as srv:
        yield srv


# -- /metrics: what make_wsgi_app brings ------------------------------------------------------------------
def test_metrics_plain_text_by_default(server: MetricsServer) -> None:
    r = get(f"{server.url}/metrics")
    assert r.status == 200
    assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "Content-Encoding" not in r.headers
    assert "gpu_watchdog_up 1.0\n" in r.text
    assert 'gpu_watchdog_gpu_utilization_ratio{Hostname="node1",UUID="GPU-0",gpu="0"} 0.5' in r.text


def test_metrics_openmetrics_by_accept(server: MetricsServer) -> None:
    r = get(f"{server.url}/metrics", Accept="application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert r.text.endswith("# EOF\n")
    assert "gpu_watchdog_up 1.0\n" in r.text


def test_metrics_gzip_by_accept_encoding(server: MetricsServer) -> None:
    r = get(f"{server.url}/metrics", Accept_Encoding="gzip")
    assert r.status == 200 and r.headers["Content-Encoding"] == "gzip"
    assert r.body[:2] == b"\x1f\x8b"  # urllib does not decode: these are the gzip bytes on the wire
    text = gzip.decompress(r.body).decode()
    assert "gpu_watchdog_up 1.0\n" in text
    assert len(r.body) < len(text)


def test_metrics_name_filter(server: MetricsServer) -> None:
    r = get(f"{server.url}/metrics?name[]=gpu_watchdog_up&name[]=gpu_watchdog_incidents_total")
    assert r.status == 200
    assert sample_names(r.text) == {"gpu_watchdog_up", "gpu_watchdog_incidents_total"}
    assert "gpu_watchdog_gpu_utilization_ratio" in get(f"{server.url}/metrics").text


def test_metrics_answers_only_get(server: MetricsServer) -> None:
    r = get(f"{server.url}/metrics", method="POST")
    assert r.status == 405 and "GET" in r.headers["Allow"]


# -- /healthz, /, 404 -------------------------------------------------------------------------------------
def test_healthz_answers_from_loop_health(metrics: AgentMetrics) -> None:
    clock = FakeClock(100.0)
    health = LoopHealth(10.0, clock=clock)
    with serve("127.0.0.1:0", metrics.registry, health) as srv:
        url = f"{srv.url}/healthz"
        r = get(url)
        assert (r.status, r.text) == (200, "starting: no sample yet\n")
        assert r.headers["Content-Type"] == "text/plain; charset=utf-8"
        clock.t = 110.0
        assert (get(url).status, get(url).text) == (503, "no sample in the 10 s since start (limit 10 s)\n")
        health.tick_ok()
        assert (get(url).status, get(url).text) == (200, "ok\n")
        health.tick_failed("NVMLError_GpuIsLost")
        assert (get(url).status, get(url).text) == (503, "sampling failed: NVMLError_GpuIsLost\n")
        health.busy(60.0)
        assert (get(url).status, get(url).text) == (200, "recovering a job (sampling paused)\n")
        health.busy(None)
        health.tick_ok()
        clock.t = 122.0
        assert (get(url).status, get(url).text) == (503, "last sample 12.0 s ago (limit 10 s)\n")
        assert get(url, method="POST").status == 405


def test_index_and_not_found(server: MetricsServer) -> None:
    r = get(f"{server.url}/")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
    assert 'href="/metrics"' in r.text and 'href="/healthz"' in r.text
    for path in ("/nope", "/metrics/x", "/healthz/", "/favicon.ico"):
        r = get(f"{server.url}{path}")
        assert (r.status, r.text) == (404, "not found\n"), path


# -- robustness -------------------------------------------------------------------------------------------
class Switchable:
    """A collector that raises, or blocks until released, when told to."""

    def __init__(self) -> None:
        self.broken = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def collect(self) -> Iterator[Metric]:
        self.entered.set()
        self.release.wait(10)
        if self.broken:
            raise RuntimeError("collector exploded\nwith a second line " + "x" * 1000)
        g = GaugeMetricFamily("test_value", "a test gauge")
        g.add_metric([], 7.0)
        yield g


def test_a_broken_collector_answers_500_and_the_server_lives_on() -> None:
    reg, c = CollectorRegistry(), Switchable()
    reg.register(c)
    health = LoopHealth(10.0)
    health.tick_ok()
    with serve("127.0.0.1:0", reg, health) as srv:
        c.broken = True
        r = get(f"{srv.url}/metrics")
        assert r.status == 500 and r.headers["Content-Type"].startswith("text/plain")
        assert r.text.startswith("collect failed: RuntimeError: collector exploded with a second line")
        assert r.text.count("\n") == 1 and len(r.body) < 300
        assert get(f"{srv.url}/healthz").status == 200
        c.broken = False
        r = get(f"{srv.url}/metrics")
        assert r.status == 200 and "test_value 7.0" in r.text


def test_a_slow_scrape_does_not_block_healthz() -> None:
    reg, c = CollectorRegistry(), Switchable()
    reg.register(c)
    health = LoopHealth(10.0)
    health.tick_ok()
    with serve("127.0.0.1:0", reg, health) as srv:
        c.release.clear()
        c.entered.clear()
        got: list[Response] = []
        scraper = threading.Thread(target=lambda: got.append(get(f"{srv.url}/metrics")))
        scraper.start()
        try:
            assert c.entered.wait(5)  # the scrape is inside collect(), blocked
            assert get(f"{srv.url}/healthz").text == "ok\n"  # served by another thread meanwhile
        finally:
            c.release.set()
            scraper.join(10)
        assert got and got[0].status == 200


def test_the_server_thread_is_a_daemon_and_stop_frees_the_port(metrics: AgentMetrics) -> None:
    srv = serve("127.0.0.1:0", metrics.registry, LoopHealth(10.0))
    assert srv.port != 0
    threads = [t for t in threading.enumerate() if t.name == "gpu-watchdog-metrics"]
    assert threads and all(t.daemon for t in threads)
    srv.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{srv.url}/healthz", timeout=5)
    with serve(f"127.0.0.1:{srv.port}", metrics.registry, LoopHealth(10.0)) as again:
        assert again.port == srv.port


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("addr,url_host", [("0.0.0.0:0", "127.0.0.1"), (":0", "127.0.0.1"),
                                           ("[::1]:0", "[::1]"), ("[::]:0", "[::1]")])
def test_ipv4_and_ipv6_hosts(metrics: AgentMetrics, addr: str, url_host: str) -> None:
    if "[" in url_host and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    health = LoopHealth(10.0)
    health.tick_ok()
    with serve(addr, metrics.registry, health) as srv:
        assert srv.url == f"http://{url_host}:{srv.port}"
        assert get(f"{srv.url}/healthz").text == "ok\n"
        assert "gpu_watchdog_up 1.0" in get(f"{srv.url}/metrics").text


def test_bind_error_is_one_clear_line(server: MetricsServer, metrics: AgentMetrics) -> None:
    with pytest.raises(MetricsServeError) as ei:
        serve(f"127.0.0.1:{server.port}", metrics.registry, LoopHealth(10.0))
    msg = str(ei.value)
    assert msg.startswith(f"--metrics-addr 127.0.0.1:{server.port}: cannot listen: ")
    assert "\n" not in msg and "in use" in msg
    assert ei.value.exit_code == EXIT_UNAVAILABLE
    assert get(f"{server.url}/healthz").status == 200  # the first server is unharmed


def test_unknown_host_is_a_serve_error(metrics: AgentMetrics) -> None:
    with pytest.raises(MetricsServeError, match=r"^--metrics-addr no-such-host\.invalid:0: cannot listen: "):
        serve("no-such-host.invalid:0", metrics.registry, LoopHealth(10.0))


# -- addresses and wiring ---------------------------------------------------------------------------------
@pytest.mark.parametrize("addr,expected", [
    ("127.0.0.1:9408", ("127.0.0.1", 9408)), (":9408", ("0.0.0.0", 9408)), ("[::1]:0", ("::1", 0)),
    ("localhost:1", ("localhost", 1)), (" 10.0.0.1:80 ", ("10.0.0.1", 80)),
])
def test_parse_addr(addr: str, expected: tuple[str, int]) -> None:
    assert parse_addr(addr) == expected


@pytest.mark.parametrize("addr", ["9408", "host:", "host:port", "host:70000", "::1:9408", ""])
def test_parse_addr_rejects(addr: str) -> None:
    with pytest.raises(UsageError, match="--metrics-addr"):
        parse_addr(addr)


def test_default_port_is_not_dcgm_exporters() -> None:
    assert DEFAULT_PORT == 9408


def test_start_metrics_off_without_an_address() -> None:
    assert start_metrics(config_from_dict({}), LoopHealth(10.0)) == (None, None)


def test_start_metrics_serves_the_agent_metrics_and_the_given_health() -> None:
    cfg = config_from_dict({"agent": {"metrics_addr": "127.0.0.1:0", "interval_s": 2.0}})
    clock = FakeClock(100.0)
    health = LoopHealth(20.0, clock=clock)
    m, srv = start_metrics(cfg, health)
    assert isinstance(m, AgentMetrics) and srv is not None
    try:
        assert m.interval_s == 2.0
        m.set_up(False)
        assert "gpu_watchdog_up 0.0" in get(f"{srv.url}/metrics").text  # this AgentMetrics' registry
        health.tick_failed("backend down")
        r = get(f"{srv.url}/healthz")
        assert (r.status, r.text) == (503, "sampling failed: backend down\n")  # this LoopHealth
    finally:
        srv.stop()
