"""Real Prometheus and promtool for tests: find the tools, start a server, query it, always clean up.

    prom_bin = require("prometheus")       # skip when absent; FAIL when GPU_WATCHDOG_REQUIRE_PROMETHEUS=1
    with Prometheus(tmp_path, targets=["127.0.0.1:9408"]) as p:
        p.wait_for("gpu_watchdog_up == 1", timeout=30)
        rows = p.query("gpu_watchdog_job_stalled")   # the API's "result" list

The server listens on 127.0.0.1 at a free port, keeps its TSDB in a tmp dir, scrapes every second and
evaluates rules every second. Debian package: ``prometheus`` (2.42 ships both tools); stop the service the
package starts, the tests start their own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

REQUIRE_ENV = "GPU_WATCHDOG_REQUIRE_PROMETHEUS"
ALERTS = REPO / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO / "prometheus" / "alerts.test.yml"
DASHBOARD = REPO / "grafana" / "dashboards" / "gpu-watchdog.json"
SCRAPE_JOB = "gpu-watchdog"  # the scrape job name the alert rules expect

# Grafana's built-in variables, replaced so an expression becomes plain PromQL.
GRAFANA_VARS = {
    "$__rate_interval": "1m", "${__rate_interval}": "1m", "$__interval": "1m", "${__interval}": "1m",
    "$__range": "1h", "${__range}": "1h", "$__interval_ms": "60000",
}


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes")


def require(tool: str) -> str:
    """Path of ``tool`` (promtool, prometheus); skip the test when absent unless the env var demands it."""
    path = shutil.which(tool)
    if path is None:
        msg = f"{tool} is not installed (Debian package: prometheus)"
        if required():
            pytest.fail(f"{msg}; {REQUIRE_ENV}=1 demands the real Prometheus checks")
        pytest.skip(msg)
    return path


def promtool(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require("promtool"), *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def substitute_grafana_vars(expr: str, variables: dict[str, str] | None = None) -> str:
    """Grafana's built-ins → fixed ranges; ``$name`` / ``${name}`` of dashboard variables → ``.*`` (or given)."""
    for k in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(k, GRAFANA_VARS[k])
    for name, value in sorted((variables or {}).items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


class PrometheusError(RuntimeError):
    pass


class Prometheus:
    """A real Prometheus on 127.0.0.1 scraping ``targets`` every second. Use as a context manager."""

    def __init__(self, tmp_path: Path, targets: Sequence[str] = (), *, job: str = SCRAPE_JOB,
                 rule_files: Sequence[Path] = (), scrape_interval: str = "1s") -> None:
        self.dir = Path(tmp_path) / f"prometheus-{free_port()}"
        self.dir.mkdir(parents=True)
        self.targets = list(targets)
        self.job = job
        self.rule_files = [Path(r).resolve() for r in rule_files]
        self.scrape_interval = scrape_interval
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.dir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        cfg = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval,
                       "scrape_timeout": self.scrape_interval},
            "rule_files": [str(r) for r in self.rule_files],
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": self.targets}]}],
        }
        return json.dumps(cfg, indent=1)  # JSON is YAML

    def start(self, timeout: float = 60) -> Prometheus:
        exe = require("prometheus")
        (self.dir / "prometheus.yml").write_text(self._config())
        for attempt in range(3):  # the free port can be taken between probe and bind
            self.port = free_port()
            argv = [exe, f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1d", "--log.level=warn"]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                             start_new_session=True)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                        if r.status == 200:
                            return self
                except (OSError, urllib.error.URLError):
                    pass
                time.sleep(0.2)
            self.stop()
            if attempt == 2 or "address already in use" not in self.log_path.read_text():
                break
        raise PrometheusError(f"prometheus did not become ready; log:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP API -----------------------------------------------------------------------------------
    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns ``data`` or raises PrometheusError with the server's error text."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                body = json.loads(e.read())
            except ValueError:
                raise PrometheusError(f"{path}: HTTP {e.code}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query: the ``result`` list (for a scalar result, one row ``{"metric": {}, "value": v}``)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        """Range query: the ``result`` matrix (one entry per series, each with ``values``)."""
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        return list(data["result"])

    def values(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Instant query as {sorted label pairs: value}."""
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in self.query(expr)}

    def wait_for(self, expr: str, timeout: float, predicate: Callable[[list[dict[str, Any]]], bool] = bool,
                 poll: float = 0.5) -> list[dict[str, Any]]:
        """Poll ``expr`` until ``predicate(result)`` (default: non-empty); PrometheusError on timeout."""
        deadline = time.monotonic() + timeout
        last: list[dict[str, Any]] = []
        while True:
            last = self.query(expr)
            if predicate(last):
                return last
            if time.monotonic() >= deadline:
                raise PrometheusError(f"{expr!r} not satisfied within {timeout:g} s; last result: {last}")
            time.sleep(poll)

    def targets_health(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])


def dashboard_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """Every PromQL expression of a Grafana dashboard as (where, expr): panel targets (nested rows too),
    annotations, and query variables (``label_values(m, l)`` → ``m``; ``query_result(e)`` → ``e``)."""
    out: list[tuple[str, str]] = []

    def panels(items: list[dict[str, Any]]) -> None:
        for p in items:
            for i, t in enumerate(p.get("targets", [])):
                if t.get("expr"):
                    out.append((f"panel {p.get('title', p.get('id'))!r} target {t.get('refId', i)}", t["expr"]))
            panels(p.get("panels", []))

    panels(dashboard.get("panels", []))
    for a in dashboard.get("annotations", {}).get("list", []):
        expr = a.get("expr") or (a.get("target") or {}).get("expr")
        if expr:
            out.append((f"annotation {a.get('name')!r}", expr))
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if not q:
            continue
        out.append((f"variable {v.get('name')!r}", variable_expr(q)))
    return out


def variable_expr(q: str) -> str:
    """The PromQL inside a Grafana Prometheus variable query."""
    q = q.strip()
    if q.startswith("label_values(") and q.endswith(")"):
        parts = _split_top_level(q[len("label_values("):-1])
        return parts[0].strip() if len(parts) == 2 else ""  # label_values(label) names no metric
    if q.startswith("query_result(") and q.endswith(")"):
        return q[len("query_result("):-1]
    if q.startswith(("label_names(", "metrics(")):
        return ""
    return q


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    quote = ""
    for ch in text:
        if quote:
            cur += ch
            if ch == quote:
                quote = ""
            continue
        if ch in "\"'`":
            quote = ch
        elif ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    parts.append(cur)
    return parts


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def dashboard_variables(dashboard: dict[str, Any]) -> list[str]:
    return [v["name"] for v in dashboard.get("templating", {}).get("list", [])]


_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
             "offset", "inf", "nan", "start", "end", "atan2"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (a careful lexer, not a parser: strings, label matchers,
    ranges, offsets and grouping clauses are removed first; what is left and not called is a metric)."""
    import re

    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)
    s = re.sub(r"\boffset\s+-?[0-9a-zA-Z]+", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.:$])[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        rest = s[m.end():].lstrip()
        if rest.startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def populated_metrics(t: float | None = None) -> Any:
    """An AgentMetrics with every family holding at least one series: two real GPUs with every field, a
    stalled job and a job waiting on rank 3, every counter and histogram touched. For name checks and for
    "every dashboard expression returns data" against a live scrape."""
    from gpu_watchdog.act.events import TimeSaved
    from gpu_watchdog.export.metrics import AgentMetrics
    from gpu_watchdog.model import Deadline, DeviceSample, JobStatus, NodeSample, SampleError

    now = time.time() if t is None else t
    m = AgentMetrics(interval_s=1.0)
    devices = tuple(DeviceSample(i, f"GPU-{i:04d}", "NVIDIA H100 80GB HBM3", util_percent=97.0 - i,
                                 mem_util_percent=40.0 + i, mem_used_bytes=(40 + i) << 30,
                                 mem_total_bytes=80 << 30, power_w=110.0 + i, power_limit_w=700.0,
                                 pcie_link_bytes_per_s=63.0e9) for i in range(2))
    sample = NodeSample(t=now, hostname="node-a", backend="nvml", devices=devices)
    jobs = {"train-a": JobStatus("train-a", state="stalled", ranks=(0, 1), devices=("GPU-0000",)),
            "train-b": JobStatus("train-b", state="waiting", ranks=(2, 3), waiting_since=now - 42.0,
                                 waiting_on=(3,), devices=("GPU-0001",),
                                 deadline=Deadline(1800.0, "flight_recorder", "timeout_ms 1800000"))}
    m.update(sample, jobs, {"train-a": 2})
    m.sample_duration(0.004)
    m.nvml_errors([SampleError("NVMLError_NotSupported", "nvmlDeviceGetPowerUsage gpu 1"),
                   SampleError("AccessDenied", "pid 4242")])
    m.incident("stall")
    m.action("dump_stacks", True)
    m.restart("train-a")
    m.pyspy_dump("ok")
    m.gpu_fault("GPU-0001", 79)
    m.detection_latency(12.5)
    m.count(TimeSaved(1790.0, 2 * 1790.0))
    m.job_config("train-a", "3f2a9c0d")
    m.straggler_scores({"train-b": {2: (0.6, 0.0, False), 3: (0.05, 0.55, True)}})
    return m


def exported_names(registry: Any) -> set[str]:
    """Every sample name a registry exposes right now (``_total``, ``_bucket``, ``_created``, ... included)."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for fam in text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples}
