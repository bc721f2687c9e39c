"""deploy/kubernetes/ and prometheus/alertmanager.example.yml: every YAML parses, the manifests agree with each
other and with the daemon (its config loads, the socket, port and groups line up, the commands parse with the
real CLI), amtool accepts the Alertmanager config and a real Alertmanager inhibits a node's stall pages while a
GPU fault fires there."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import prom
import pytest
import yaml
from gpu_watchdog.cli.main import build_parser
from gpu_watchdog.config.load import load_config

REPO = prom.REPO
K8S = REPO / "deploy" / "kubernetes"
ALERTMANAGER = REPO / "prometheus" / "alertmanager.example.yml"
YAML_FILES = sorted([*REPO.glob("deploy/**/*.yaml"), *REPO.glob("prometheus/*.yml"),
                     *REPO.glob("grafana/provisioning/**/*.yml")])


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kind(kind: str) -> dict[str, Any]:
    (obj,) = [d for p in sorted(K8S.glob("*.yaml")) for d in _docs(p) if d["kind"] == kind]
    return obj


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_yaml_parses(path: Path) -> None:
    docs = _docs(path)
    assert docs and all(isinstance(d, dict) for d in docs)
    if path.parent == K8S:
        assert all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs), path


def test_the_kubernetes_files_are_all_there() -> None:
    kinds = {d["kind"] for p in K8S.glob("*.yaml") for d in _docs(p)}
    assert {"DaemonSet", "ConfigMap", "PodMonitor", "Pod", "ServiceAccount", "Role", "RoleBinding"} <= kinds


def _config(tmp: Path) -> Any:
    text = _kind("ConfigMap")["data"]["config.toml"]
    (tmp / "config.toml").write_text(text)
    return load_config(tmp / "config.toml")  # the daemon's own loader: a bad key would exit 78 on the node


def _container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod_spec["containers"]
    return c


def _mount_of(pod_spec: dict[str, Any], path: str) -> str:
    """The host path behind ``path`` in the pod's (only) container."""
    mounts = {m["mountPath"]: m["name"] for m in _container(pod_spec)["volumeMounts"]}
    vols = {v["name"]: v for v in pod_spec["volumes"]}
    for mount, name in mounts.items():
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            return vols[name]["hostPath"]["path"] + path[len(mount):]
    raise AssertionError(f"{path} is not mounted")


def test_the_daemonset_has_the_privileges_the_daemon_needs_and_no_more(tmp_path: Path) -> None:
    ds = _kind("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    c = _container(spec)
    assert spec["hostPID"] is True and spec["runtimeClassName"] == "nvidia"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in str(c.get("resources", {}))  # would take GPUs away from the jobs
    sc = c["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"SYS_PTRACE", "KILL"} <= set(sc["capabilities"]["add"]) <= {"SYS_PTRACE", "KILL", "DAC_READ_SEARCH"}
    assert sc.get("privileged") is False and sc.get("allowPrivilegeEscalation") is False
    cfg = _config(tmp_path)
    assert c["command"][:2] == ["gpu-watchdog", "run"] and c["command"][-1] == "/etc/gpu-watchdog/config.toml"
    assert _mount_of(spec, cfg.agent.state_dir) == "/var/lib/gpu-watchdog"  # incidents stay on the node
    assert _mount_of(spec, cfg.daemon.control_socket) == "/run/gpu-watchdog/control.sock"
    assert env["GPU_WATCHDOG_SOCKET"] == cfg.daemon.control_socket
    port = int(cfg.agent.metrics_addr.rsplit(":", 1)[1])
    (metrics,) = [p for p in c["ports"] if p["name"] == "metrics"]
    assert metrics["containerPort"] == port and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sc["runAsGroup"] in cfg.daemon.allowed_gids and cfg.daemon.socket_group == ""
    assert spec["terminationGracePeriodSeconds"] > cfg.recovery.stop_grace_s
    assert "k8s-delete-pod" in cfg.hooks
    assert _kind("RoleBinding")["subjects"][0]["name"] == spec["serviceAccountName"]


def test_the_podmonitor_scrapes_the_daemon_as_the_alerts_expect() -> None:
    pm, ds = _kind("PodMonitor"), _kind("DaemonSet")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] in {p["name"] for p in _container(ds["spec"]["template"]["spec"])["ports"]}
    relabel = {r["targetLabel"]: r for r in ep["relabelings"]}
    assert relabel["job"]["replacement"] == prom.SCRAPE_JOB
    assert f'job="{prom.SCRAPE_JOB}"' in prom.ALERTS.read_text()
    assert relabel["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]  # one instance per node


def test_the_training_pod_registers_checkpoints_in_prestop_and_reaches_the_socket(tmp_path: Path) -> None:
    pod, ds = _kind("Pod"), _kind("DaemonSet")
    spec = pod["spec"]
    c = _container(spec)
    cfg = _config(tmp_path)
    assert spec["hostPID"] is True  # registration names host pids
    assert _mount_of(spec, cfg.daemon.control_socket) == _mount_of(ds["spec"]["template"]["spec"],
                                                                   cfg.daemon.control_socket)
    assert {e["name"]: e.get("value") for e in c["env"]}["GPU_WATCHDOG_SOCKET"] == cfg.daemon.control_socket
    assert set(spec["securityContext"]["supplementalGroups"]) & set(cfg.daemon.allowed_gids)
    parser = build_parser()
    name = pod["metadata"]["name"]

    def shell(text: str) -> str:  # what sh hands the CLI
        return text.replace("$$", "4242").replace('"$POD_NAME"', name)

    script = shell(c["command"][-1])
    gw_lines = [shlex.split(part.strip()) for part in script.split(";") if part.strip().startswith("gpu-watchdog")]
    assert [argv[1:3] for argv in gw_lines] == [["hook", "job-start"], ["hook", "job-end"]]
    start = parser.parse_args(gw_lines[0][1:])  # the real CLI's flags, not a guess
    assert start.restart_hook in cfg.hooks and start.checkpoint and start.job_id == name and start.pid == [4242]
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[:2] == ["sh", "-c"]
    args = parser.parse_args(shlex.split(shell(pre[2]))[1:])
    assert (args.hook_op, args.job_id) == ("preempt", name)
    assert spec["terminationGracePeriodSeconds"] > args.timeout  # the checkpoint gets its time


def test_the_docs_name_every_manifest() -> None:
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    for p in K8S.glob("*.yaml"):
        assert f"deploy/kubernetes/{p.name}" in doc, p.name
    for cap in ("SYS_PTRACE", "KILL", "DAC_READ_SEARCH", "hostPID", "runtimeClassName"):
        assert cap in doc, cap
    assert "docs/kubernetes.md" in (REPO / "README.md").read_text()


# -- Alertmanager ---------------------------------------------------------------------------------------
def _require(tool: str) -> str:
    import shutil

    path = shutil.which(tool)
    if path is None:
        msg = f"{tool} is not installed (Debian package: prometheus-alertmanager)"
        if prom.required():
            pytest.fail(f"{msg}; {prom.REQUIRE_ENV}=1 demands the real checks")
        pytest.skip(msg)
    return path


def test_amtool_accepts_the_alertmanager_example_and_routes_as_documented() -> None:
    amtool = _require("amtool")
    r = subprocess.run([amtool, "check-config", str(ALERTMANAGER)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    alerts = {a: s for a, s in ((a, _severity(a)) for a in _alert_names())}
    for alert, severity in alerts.items():
        r = subprocess.run([amtool, "config", "routes", "test", "--config.file", str(ALERTMANAGER),
                            f"alertname={alert}", f"severity={severity}"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        want = ("node-hardware" if alert in ("GpuWatchdogGpuFault", "GpuWatchdogAgentDown", "GpuWatchdogNotSampling")
                else "ml-jobs-info" if severity == "info" else "ml-jobs")
        assert r.stdout.strip() == want, (alert, r.stdout)


def _alert_names() -> list[str]:
    return [r["alert"] for g in yaml.safe_load(prom.ALERTS.read_text())["groups"] for r in g["rules"]]


def _severity(alert: str) -> str:
    (rule,) = [r for g in yaml.safe_load(prom.ALERTS.read_text())["groups"] for r in g["rules"]
               if r["alert"] == alert]
    return rule["labels"]["severity"]


def _am(port: int, path: str, body: Any = None) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v2/{path}", method="POST" if body else "GET",
                                 data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def test_a_real_alertmanager_inhibits_stall_pages_on_a_node_with_a_gpu_fault(tmp_path: Path) -> None:
    binary = _require("prometheus-alertmanager")
    port, cluster = prom.free_port(), prom.free_port()
    proc = subprocess.Popen([binary, f"--config.file={ALERTMANAGER}", f"--storage.path={tmp_path}",
                             f"--web.listen-address=127.0.0.1:{port}", f"--cluster.listen-address=127.0.0.1:{cluster}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _am(port, "status")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "alertmanager did not start"
                time.sleep(0.2)

        def alert(name: str, instance: str, severity: str, **labels: str) -> dict[str, Any]:
            return {"labels": {"alertname": name, "instance": instance, "severity": severity, **labels}}

        _am(port, "alerts", [
            alert("GpuWatchdogGpuFault", "node-a", "critical", UUID="GPU-1", kind="xid"),
            alert("GpuWatchdogStallConfirmed", "node-a", "warning", job_id="train-1"),  # the fault's symptom
            alert("GpuWatchdogRestartLoop", "node-a", "critical", job_id="train-1"),
            alert("GpuWatchdogStallConfirmed", "node-b", "warning", job_id="train-2"),  # another node: pages
            alert("GpuWatchdogStallConfirmed", "node-c", "warning", job_id="train-2"),  # the same job's other node
            alert("GpuWatchdogAgentDown", "node-a", "critical"),  # never inhibited
        ])
        deadline = time.monotonic() + 20
        while True:
            got = {(a["labels"]["alertname"], a["labels"]["instance"]): a["status"] for a in _am(port, "alerts")}
            if len(got) == 6 and got[("GpuWatchdogStallConfirmed", "node-a")]["state"] == "suppressed":
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        assert got[("GpuWatchdogStallConfirmed", "node-a")]["inhibitedBy"]
        assert got[("GpuWatchdogRestartLoop", "node-a")]["state"] == "suppressed"
        for active in (("GpuWatchdogGpuFault", "node-a"), ("GpuWatchdogStallConfirmed", "node-b"),
                       ("GpuWatchdogAgentDown", "node-a")):
            assert got[active]["state"] == "active" and not got[active]["inhibitedBy"], (active, got[active])
        # one page for one job's hang, whichever nodes' agents fire it
        groups = {(g["labels"].get("alertname"), g["labels"].get("job_id")): sorted(
            a["labels"]["instance"] for a in g["alerts"]) for g in _am(port, "alerts/groups")}
        assert groups[("GpuWatchdogStallConfirmed", "train-2")] == ["node-b", "node-c"], groups
    finally:
        proc.terminate()
        proc.wait(timeout=10)
