"""The node daemon end to end: a real hanging 4-rank gloo job registered through ``gpu-watchdog hook``,
found, proven with stacks, stopped and handed to the restart hook exactly once — also across a SIGKILL of
the daemon in the middle of the hook. Plus bad config (exit 78), SIGHUP reload and the in-process faults
the daemon must survive (NVML fault, vanished process, failing hook)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from daemon_helpers import GW, DaemonProc, records, short_dir, wait_for, write_config
from gloo_jobs import start_job


@pytest.fixture
def base():
    d = short_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _incidents(state: Path) -> list[dict]:
    out = subprocess.run([GW, "incidents", "--state-dir", str(state), "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _register(d: DaemonProc, job_id: str, pid: int, hook: str = "requeue") -> None:
    out = subprocess.run([GW, "hook", "job-start", "--socket", d.socket, "--job-id", job_id, "--pid", str(pid),
                          "--restart-hook", hook], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr + d.log_text()


def _assert_replayable_trace(inc: dict, config: Path) -> None:
    """The daemon's incident carries the node's samples before confirmation, the job's only, and ``replay`` of the
    incident directory finds the same stall."""
    d = Path(inc["stacks_dir"]).parent
    assert inc["trace"] == "trace.jsonl"
    recs = [json.loads(line) for line in (d / "trace.jsonl").read_text().splitlines()]
    samples = [r for r in recs if r["type"] == "sample"]
    assert samples[-1]["t"] <= inc["detected_at"] and inc["detected_at"] - samples[0]["t"] <= 120.0
    assert samples[0]["t"] < inc["onset"]  # what led to the stall, not only the stall
    assert {p["job"]["job_id"] for s in samples for p in s.get("processes", []) if p.get("job")} == {"train-42"}
    out = subprocess.run([GW, "replay", "--config", str(config), str(d)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("stall ") and "job=train-42" in out.stdout, out


@pytest.mark.slow
def test_daemon_finds_registered_hang_and_runs_restart_hook_once(base: Path) -> None:
    d = DaemonProc(base, write_config(base))
    job = start_job("hang", nproc=4, extra_args=("--rank-at", "1", "--step-at", "60", "--steps", "1000"),
                    tmp_path=base / "job")
    try:
        d.wait_socket()
        job.wait_ranks(60)
        _register(d, "train-42", job.proc.pid)
        wait_for(lambda: len(records(base)) >= 2, 90, "restart hook ran", d.log_text)
        inc = wait_for(lambda: [i for i in _incidents(base / "state") if i.get("outcome")
                                     and i["job_id"] == "train-42"], 30, "incident finished", d.log_text)[0]
        assert inc["job_id"] == "train-42" and inc["kind"] == "stall"
        assert inc["culprit_ranks"] == [1], inc
        _assert_replayable_trace(inc, base / "config.toml")
        stacks = sorted(p.name for p in Path(inc["stacks_dir"]).iterdir())
        assert stacks == [f"rank-{r}.json" for r in range(4)]
        acts = {a["action"]: a for a in inc["actions"]}
        assert acts["stop"]["ok"] and acts["restart_hook"]["ok"], inc["actions"]
        rec = [r for r in records(base) if "argv" in r]
        assert len(rec) == 1
        assert rec[0]["argv"] == ["requeue", "train-42", "--level=1", inc["id"], rec[0]["argv"][-1]]
        assert rec[0]["env_level"] == "1"
        # the job is gone, the overlay is readable through `gpu-watchdog env`
        wait_for(lambda: job.proc.poll() is not None, 15, "job stopped")
        env = subprocess.run([GW, "env", "--state-dir", str(base / "state"), "--job", "train-42"],
                             capture_output=True, text=True, timeout=60)
        assert env.returncode == 0 and "export NCCL_P2P_DISABLE=1" in env.stdout, env
        st = d.call("incidents")
        row = [r for r in st["incidents"] if r["id"] == inc["id"]][0]
        assert st["ok"] and row["outcome"] == "restart hook ran"
        seq = [a["action"] for a in row["actions"]]
        assert seq.index("stop") < seq.index("restart_hook")
        assert all(a["finished_at"] is not None for a in row["actions"])
        assert d.proc.poll() is None  # still running
        d.kill(signal.SIGTERM)
        assert d.proc.returncode == 0, d.log_text()
        assert not Path(d.socket).exists()
    finally:
        job.stop()
        d.kill()


@pytest.mark.slow
def test_a_restart_hook_that_exits_1_is_recorded_and_the_daemon_carries_on(base: Path) -> None:
    """The scheduler refuses the requeue (the hook exits 1): the hung job is still stopped (nothing of it left
    running unsupervised), the incident says the hook failed and why, and the daemon keeps serving."""
    failing = '[hooks.failing]\nargv = ["/bin/sh", "-c", "echo requeue refused >&2; exit 1"]\ntimeout_s = 10\n'
    d = DaemonProc(base, write_config(base, extra=failing))
    job = start_job("hang", nproc=2, extra_args=("--rank-at", "1", "--step-at", "20", "--steps", "1000"),
                    tmp_path=base / "job")
    try:
        d.wait_socket()
        job.wait_ranks(60)
        _register(d, "train-9", job.proc.pid, hook="failing")
        inc = wait_for(lambda: [i for i in _incidents(base / "state") if i.get("outcome")
                                     and i["job_id"] == "train-9"], 90, "incident finished", d.log_text)[0]
        acts = {a["action"]: a for a in inc["actions"]}
        assert acts["stop"]["ok"], inc["actions"]
        assert acts["restart_hook"]["ok"] is False and "exit 1" in acts["restart_hook"]["detail"], acts
        assert "requeue refused" in json.dumps(inc["restart_hook"]), inc
        assert inc["outcome"] == "restart hook failed or missing", inc
        wait_for(lambda: job.proc.poll() is not None, 15, "job stopped")
        assert d.call("status")["ok"] and d.proc.poll() is None
        assert "Traceback" not in d.log_text()
        d.kill(signal.SIGTERM)
        assert d.proc.returncode == 0, d.log_text()
    finally:
        job.stop()
        d.kill()


@pytest.mark.slow
def test_sigkill_during_restart_hook_then_restart_completes_without_rerun(base: Path) -> None:
    d = DaemonProc(base, write_config(base, hook_sleep=4.0))
    job = start_job("hang", nproc=4, extra_args=("--rank-at", "2", "--step-at", "60", "--steps", "1000"),
                    tmp_path=base / "job")
    try:
        d.wait_socket()
        job.wait_ranks(60)
        _register(d, "train-7", job.proc.pid)
        wait_for(lambda: (base / "hook.record.started").exists(), 90, "restart hook started", d.log_text,
                 poll=0.05)
        d.kill(signal.SIGKILL)  # right after the hook started, before it finished
        d2 = DaemonProc(base, d.config)
        d2.wait_socket()
        inc = wait_for(lambda: [i for i in _incidents(base / "state") if i.get("outcome")
                                     and i["job_id"] == "train-7"], 30, "incident completed after the restart",
                       d2.log_text)[0]
        assert "not re-run" in inc["outcome"], inc
        hook = [a for a in inc["actions"] if a["action"] == "restart_hook"]
        assert len(hook) == 1 and "interrupted" in hook[0]["detail"]
        wait_for(lambda: any(r.get("done") for r in records(base)), 15, "the orphaned hook finished")
        time.sleep(1.5)  # a few more ticks: nothing re-runs it
        assert len([r for r in records(base) if "argv" in r]) == 1
        rows = [r for r in d2.call("incidents")["incidents"] if r["id"] == inc["id"]]
        assert rows[0]["finished_at"] is not None
        assert d2.call("status")["ok"]
        d2.kill(signal.SIGTERM)
    finally:
        job.stop()
        d.kill()


def test_bad_config_exits_78_naming_the_key(base: Path) -> None:
    cfg = write_config(base, extra='[hooks.bad]\nargv = ["rm", "{job_id}{shell}"]\n')
    out = subprocess.run([GW, "run", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 78
    assert "hooks.bad.argv[1]" in out.stderr and "{shell}" in out.stderr
    cfg.write_text('[daemon]\nallowed_uids = ["root"]\n')
    out = subprocess.run([GW, "run", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 78 and "daemon.allowed_uids" in out.stderr


def test_sighup_reload_bad_config_keeps_old(base: Path) -> None:
    cfg = write_config(base)
    d = DaemonProc(base, cfg)
    try:
        d.wait_socket()
        good = cfg.read_text()
        cfg.write_text(good.replace("[hooks.requeue]", "[hooks.requeue]\nbogus = 1"))
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "keeping the old config" in d.log_text(), 15, "reload refused", d.log_text)
        assert d.call("status")["hooks"] == ["requeue"]
        cfg.write_text(good + '\n[hooks.other]\ntype = "slurm-requeue"\n')
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: d.call("status")["hooks"] == ["other", "requeue"], 15, "reloaded", d.log_text)
        d.kill(signal.SIGTERM)
        assert d.proc.returncode == 0
    finally:
        d.kill()


# -- in-process: faults the daemon must survive --------------------------------------------------------
class _FlakyBackend:
    name = "fake"

    def __init__(self, fail_at: set[int]) -> None:
        self.n = 0
        self.fail_at = fail_at

    def sample(self):
        from gpu_watchdog.model import NodeSample

        self.n += 1
        if self.n in self.fail_at:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return NodeSample(t=time.time(), hostname="n", backend="fake", devices=(), processes=(), errors=())

    def close(self) -> None:
        pass


def test_tick_survives_backend_fault_vanished_pid_and_keeps_the_loop_alive(tmp_path: Path) -> None:
    from gpu_watchdog.config.schema import Config, DaemonSettings
    from gpu_watchdog.daemon.registry import validate_pids_live
    from gpu_watchdog.daemon.service import Daemon
    from gpu_watchdog.model import Registration

    sent: list[str] = []

    class N:
        watchdog_interval_s = None

        def watchdog(self) -> None:
            sent.append("WATCHDOG")

        def ready(self, status: str) -> None:
            sent.append("READY")

        def status(self, line: str) -> None:
            sent.append("STATUS")

    d = Daemon(Config(), DaemonSettings(socket_group=""), tmp_path, backend=_FlakyBackend({1, 3}),
               notifier=N())  # type: ignore[arg-type]
    d.tick()  # NVML fault on the first tick: not ready, not healthy, but the loop runs (systemd may keep it)
    assert d.ticks_failed == 1 and "READY" not in sent
    assert d.health.status() == (False, "sampling failed: NVML_ERROR_GPU_IS_LOST") and d.health.loop_alive()
    p = subprocess.Popen(["sleep", "30"])
    d.register(Registration("j", validate_pids_live([p.pid]), registered_by_uid=0))
    p.kill()
    p.wait()  # the registered process vanishes
    d.tick()
    assert sent.count("READY") == 1 and d.ticks_ok == 1
    assert d.health.status() == (True, "ok")
    d.tick()  # another fault: the daemon keeps going
    d.tick()
    assert d.ticks_ok == 2 and d.ticks_failed == 2 and sent.count("READY") == 1
    assert d.job_processes("j") == []


class _FaultyGpuBackend:
    """Two ticks on one GPU: healthy, then the fault named in ``fault`` (a lost GPU or an Xid)."""

    name = "fake"

    def __init__(self, fault) -> None:
        self.n = 0
        self.fault = fault

    def sample(self):
        from gpu_watchdog.model import DeviceSample, GpuProcess, NodeSample

        self.n += 1
        dev = DeviceSample(0, "GPU-test-0", "fake", util_percent=50.0, processes=(GpuProcess(4242, 1 << 30),),
                           fault=self.fault if self.n >= 2 else None)
        return NodeSample(t=time.time(), hostname="n", backend="fake", devices=(dev,))

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("fault", "drains"), [
    ("lost", True), ("xid79", True), ("xid13", False)])
def test_gpu_fault_drains_the_node_once_and_never_for_an_application_xid(tmp_path: Path, fault: str,
                                                                          drains: bool) -> None:
    import sys

    from gpu_watchdog.config.schema import Config, DaemonSettings, FaultsConfig
    from gpu_watchdog.daemon.service import Daemon
    from gpu_watchdog.model import GpuFault

    faults = {"lost": GpuFault("gpu_lost", "GPU 0 is lost"), "xid79": GpuFault("xid", "Xid 79", xid=79),
              "xid13": GpuFault("xid_application", "Xid 13", xid=13)}
    record = tmp_path / "argv.jsonl"
    script = tmp_path / "drain.py"
    script.write_text(f"import json, sys\nopen({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    cfg = dataclasses.replace(Config(), faults=dataclasses.replace(
        FaultsConfig(), drain_command=(sys.executable, str(script), "{node}", "{reason}")))
    d = Daemon(cfg, DaemonSettings(socket_group=""), tmp_path / "state", backend=_FaultyGpuBackend(faults[fault]))
    for _ in range(4):  # the fault lasts: it must be handled once
        d.tick()
        time.sleep(0.1)
    d.wait_idle()
    runs = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    if drains:
        assert len(runs) == 1 and runs[0][0] == d.host
    else:
        assert runs == []
    kinds = [s["kind"] for s in d.incidents.list()]
    assert kinds == ["gpu_fault"]
    assert all(s.get("fallback") is None for s in d.incidents.list())  # never an NCCL fallback


class _XidOnJobGpu:
    """A GPU whose process is the job's rank (a real process), faulting with an application Xid from tick 2 on."""

    name = "fake"

    def __init__(self, pid: int, job_id: str) -> None:
        import psutil

        self.pid, self.job_id, self.n = pid, job_id, 0
        self.create_time = psutil.Process(pid).create_time()

    def sample(self):
        from gpu_watchdog.model import DeviceSample, GpuFault, GpuProcess, JobIdentity, NodeSample, ProcessSample

        self.n += 1
        fault = GpuFault("xid_application", "Xid 13", xid=13) if self.n >= 2 else None
        dev = DeviceSample(0, "GPU-app", "fake", util_percent=80.0, mem_used_bytes=8 << 30,
                           processes=(GpuProcess(self.pid, 8 << 30),), fault=fault)
        rank = ProcessSample(self.pid, self.create_time, 1, "sleeping", 1.0, 1000, 100 << 20,
                             job=JobIdentity(self.job_id, 0, 0, 1), is_rank=True)
        return NodeSample(t=time.time(), hostname="n", backend="fake", devices=(dev,), processes=(rank,))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("registered", [True, False])
def test_an_application_xid_never_stops_a_job(tmp_path: Path, registered: bool) -> None:
    """Even with daemon.stop_unregistered = true (which stops stalled unregistered jobs), an application Xid is
    an incident only: the job's own error, the GPU serves on."""
    from gpu_watchdog.config.schema import Config, DaemonSettings
    from gpu_watchdog.daemon.registry import validate_pids_live
    from gpu_watchdog.daemon.service import Daemon
    from gpu_watchdog.export.sdnotify import Notifier
    from gpu_watchdog.model import Registration

    job = subprocess.Popen(["sleep", "60"])
    try:
        d = Daemon(Config(), DaemonSettings(socket_group="", control_socket="", stop_unregistered=True),
                   tmp_path / "state", backend=_XidOnJobGpu(job.pid, "xid-job"), notifier=Notifier(None))
        if registered:
            d.register(Registration("xid-job", validate_pids_live([job.pid]), registered_by_uid=0))
        for _ in range(4):
            d.tick()
        d.wait_idle()
        assert job.poll() is None  # never signalled
        [inc] = d.incidents.list()
        assert (inc["kind"], inc["signature"], inc["xid"], inc["drain"]) == ("gpu_fault", "xid_application", 13,
                                                                           False)
        assert not [a for a in inc["actions"] if a["action"] in ("stop", "drain", "restart_hook")]
        assert inc["outcome"] == "recorded (application Xid)"
    finally:
        job.kill()
        job.wait()


def test_a_broken_metrics_collector_stops_no_recovery_and_touches_no_other_incident(tmp_path: Path) -> None:
    """Two manual restarts of a registered job, the second with a metrics collector that raises on every call:
    both recoveries run to their end, each closes its own incident (no thread-local 'last incident')."""
    from gpu_watchdog.config.schema import Config, DaemonSettings
    from gpu_watchdog.daemon.registry import validate_pids_live
    from gpu_watchdog.daemon.service import Daemon
    from gpu_watchdog.export.sdnotify import Notifier
    from gpu_watchdog.model import Registration

    class Broken:
        def __getattr__(self, name: str):
            def fail(*_a: object, **_k: object) -> None:
                raise RuntimeError(f"collector broke in {name}")
            return fail

    cfg = dataclasses.replace(Config(), recovery=dataclasses.replace(Config().recovery, stop_grace_s=2.0))
    d = Daemon(cfg, DaemonSettings(socket_group="", control_socket=""), tmp_path / "state",
               backend=_FlakyBackend(set()), notifier=Notifier(None))
    outcomes = []
    for broken in (False, True):
        job = subprocess.Popen(["sleep", "60"])
        try:
            d.register(Registration("j", validate_pids_live([job.pid]), registered_by_uid=0))
            d.ctx.metrics = Broken() if broken else None
            d.tick()
            assert d.manual_restart("j")
            d.wait_idle()
            assert job.wait(10) is not None  # stopped by the recovery
        finally:
            job.kill()
            job.wait()
        outcomes.append([(i["id"], i.get("outcome")) for i in d.incidents.list()])
    first, second = outcomes
    assert len(first) == 1 and len(second) == 2 and second[0] == first[0]
    assert first[0][1] == second[1][1] == "restart hook failed or missing"  # it registered no hook
    assert [r["outcome"] for r in d.store.incidents(10)] == ["restart hook failed or missing"] * 2
