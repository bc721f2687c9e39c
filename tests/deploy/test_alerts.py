"""prometheus/alerts.yml and the Grafana dashboard, checked with promtool and a real Prometheus.

Without promtool/prometheus installed these tests skip, unless GPU_WATCHDOG_REQUIRE_PROMETHEUS=1 (CI),
which turns the skip into a failure.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prom
import pytest
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.export.http import serve

REPO = prom.REPO
PROVISIONING = REPO / "grafana" / "provisioning"


def alert_names() -> list[str]:
    return re.findall(r"^\s*- alert:\s*(\S+)", prom.ALERTS.read_text(), re.M)


def alert_exprs() -> dict[str, str]:
    """alert name → expr text (folded YAML scalars joined), read without a YAML library."""
    out: dict[str, str] = {}
    lines = prom.ALERTS.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^\s*- alert:\s*(\S+)", line)
        if not m:
            continue
        j = i + 1
        while not lines[j].strip().startswith("expr:"):
            j += 1
        head = lines[j].split("expr:", 1)[1].strip()
        if head in (">-", ">", "|", "|-"):
            body, k = [], j + 1
            indent = len(lines[k]) - len(lines[k].lstrip())
            while k < len(lines) and (len(lines[k]) - len(lines[k].lstrip()) >= indent) and lines[k].strip():
                body.append(lines[k].strip())
                k += 1
            head = " ".join(body)
        out[m.group(1)] = head
    return out


# -- promtool ----------------------------------------------------------------------------------------------
def test_promtool_check_rules() -> None:
    r = prom.promtool("check", "rules", str(prom.ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in r.stdout


def test_promtool_unit_tests() -> None:
    r = prom.promtool("test", "rules", str(prom.ALERTS_TEST))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    expected = {"GpuWatchdogStallConfirmed", "GpuWatchdogWaitingOnRankTooLong", "GpuWatchdogAgentDown",
                "GpuWatchdogNotSampling", "GpuWatchdogRestartLoop", "GpuWatchdogHighFallbackLevel",
                "GpuWatchdogGpuFault", "GpuWatchdogJobConfigMismatch", "GpuWatchdogStraggler",
                "GpuWatchdogStragglerAcrossNodes", "GpuWatchdogCollectiveTimeoutNear"}
    assert set(alert_names()) == expected
    text = prom.ALERTS_TEST.read_text()
    # each alert_rule_test entry: alertname followed by exp_alerts, either [] (not firing) or a list (firing)
    cases = re.findall(r"alertname:\s*(\S+)\s*\n\s*exp_alerts:\s*(\[\])?", text)
    for name in expected:
        kinds = {"quiet" if empty else "firing" for n, empty in cases if n == name}
        assert kinds == {"quiet", "firing"}, f"{name}: {kinds or 'not tested'}"


def test_alert_rules_use_only_exported_metrics() -> None:
    exported = prom.exported_names(prom.populated_metrics().registry) | {"up"}
    for name, expr in alert_exprs().items():
        unknown = prom.promql_metric_names(expr) - exported
        assert not unknown, f"{name}: {sorted(unknown)} not exported by gpu_watchdog.export.metrics"


# -- the dashboard -----------------------------------------------------------------------------------------
def test_dashboard_structure() -> None:
    d = prom.load_dashboard()
    assert d["uid"] == "gpu-watchdog" and d["title"]
    names = prom.dashboard_variables(d)
    assert names[0] == "datasource" and {"instance", "Hostname", "job_id"} <= set(names)
    ids = []

    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    for p in walk(d["panels"]):
        ids.append(p["id"])
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for where, expr in prom.dashboard_expressions(d):
        for var in re.findall(r"\$\{?(\w+)", expr):
            assert var in names or var.startswith("__"), f"{where}: unknown variable ${var}"


def test_dashboard_has_the_required_views() -> None:
    d = prom.load_dashboard()
    used = set().union(*(prom.promql_metric_names(e) for _, e in prom.dashboard_expressions(d)))
    for name in ("gpu_watchdog_gpu_utilization_ratio", "gpu_watchdog_gpu_memory_controller_utilization_ratio",
                 "gpu_watchdog_gpu_memory_used_bytes", "gpu_watchdog_gpu_power_watts", "gpu_watchdog_gpu_stalled",
                 "gpu_watchdog_job_state", "gpu_watchdog_job_fallback_level", "gpu_watchdog_incidents_total",
                 "gpu_watchdog_restarts_total", "gpu_watchdog_job_deadline_left_seconds",
                 "gpu_watchdog_gpu_seconds_saved_total"):
        assert name in used, name
    annotations = " ".join(a.get("expr", "") for a in d["annotations"]["list"])
    assert "gpu_watchdog_incidents_total" in annotations and "gpu_watchdog_restarts_total" in annotations


def test_dashboard_uses_only_exported_metrics() -> None:
    exported = prom.exported_names(prom.populated_metrics().registry)
    exprs = prom.dashboard_expressions(prom.load_dashboard())
    assert len(exprs) > 20
    for where, expr in exprs:
        names = prom.promql_metric_names(prom.substitute_grafana_vars(expr))
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} not exported by gpu_watchdog.export.metrics"


def test_the_name_check_catches_a_typo() -> None:
    exported = prom.exported_names(prom.populated_metrics().registry)
    assert prom.promql_metric_names('sum(rate(gpu_watchdog_incident_total{x="1"}[5m]))') - exported


def test_provisioning_files_point_at_the_dashboard() -> None:
    dashboards = (PROVISIONING / "dashboards" / "gpu-watchdog.yml").read_text()
    datasources = (PROVISIONING / "datasources" / "prometheus.yml").read_text()
    assert re.search(r"^apiVersion: 1$", dashboards, re.M) and re.search(r"^apiVersion: 1$", datasources, re.M)
    assert re.search(r"^\s+type: file$", dashboards, re.M)
    path = re.search(r"^\s+path:\s*(\S+)$", dashboards, re.M)
    assert path and Path(path.group(1)).is_absolute()
    assert re.search(r"^\s+type: prometheus$", datasources, re.M)
    assert "\t" not in dashboards + datasources


# -- a real Prometheus -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[prom.Prometheus, Any]]:
    """A real Prometheus (alert rules loaded) scraping a served, fully populated AgentMetrics every second."""
    prom.require("prometheus")
    m = prom.populated_metrics()
    srv = serve("127.0.0.1:0", m.registry, LoopHealth(60.0))
    try:
        with prom.Prometheus(tmp_path_factory.mktemp("prom"), [f"127.0.0.1:{srv.port}"],
                             rule_files=[prom.ALERTS]) as p:
            p.wait_for("gpu_watchdog_up == 1", timeout=30)
            time.sleep(2.5)  # a few scrapes, so rates and increases have two points
            m.incident("stall")  # counters move: changes()/increase() annotations see an event
            m.restart("train-a")
            p.wait_for('gpu_watchdog_incidents_total{kind="stall"} == 2', timeout=30)
            yield p, m
    finally:
        srv.stop()


def test_every_expression_parses_in_prometheus(live: tuple[prom.Prometheus, Any]) -> None:
    p, _ = live
    d = prom.load_dashboard()
    variables = {v: ".*" for v in prom.dashboard_variables(d)}
    exprs = [(w, prom.substitute_grafana_vars(e, variables)) for w, e in prom.dashboard_expressions(d)]
    exprs += [(f"alert {n}", e) for n, e in alert_exprs().items()]
    bad = []
    for where, expr in exprs:
        try:
            p.query(expr)
        except prom.PrometheusError as e:
            bad.append(f"{where}: {e}\n    {expr}")
    assert not bad, "\n".join(bad)


def test_every_dashboard_expression_returns_data(live: tuple[prom.Prometheus, Any]) -> None:
    p, _ = live
    d = prom.load_dashboard()
    variables = {v: ".*" for v in prom.dashboard_variables(d)}
    empty = []
    for where, expr in prom.dashboard_expressions(d):
        q = prom.substitute_grafana_vars(expr, variables)
        try:
            p.wait_for(q, timeout=10)
        except prom.PrometheusError:
            empty.append(f"{where}: {q}")
    assert not empty, "no data:\n" + "\n".join(empty)


def test_rules_load_and_evaluate_cleanly(live: tuple[prom.Prometheus, Any]) -> None:
    p, _ = live
    deadline = time.monotonic() + 15
    while True:
        rules = [r for g in p.api("rules")["groups"] for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(r["name"] for r in rules) == sorted(alert_names())
    for r in rules:
        assert r["health"] == "ok", f"{r['name']}: {r.get('lastError')}"
        assert {"summary", "description", "runbook"} <= set(r["annotations"]), r["name"]
    # the populated agent has a stalled job: the stall alert is at least pending after one evaluation
    p.wait_for('ALERTS{alertname="GpuWatchdogStallConfirmed",job_id="train-a"}', timeout=15)
