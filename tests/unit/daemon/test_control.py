"""Control API security and validation: peer credentials, job ids, hooks, pid ownership, and the rule that
nothing the API accepts makes the daemon signal a process outside a registered or discovered job."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from daemon_helpers import GW
from gpu_watchdog.config.schema import Config, DaemonSettings, HookSpec
from gpu_watchdog.daemon.control import ControlServer, PeerCred, check_peer, handle_request, request
from gpu_watchdog.daemon.service import Daemon
from gpu_watchdog.errors import UsageError
from gpu_watchdog.export.sdnotify import Notifier
from repo_paths import REPO
from waiting import wait_for

ROOT = PeerCred(1, 0, 0)
ALICE = PeerCred(1, 4242, 4242)


@pytest.fixture
def daemon(make_daemon: Callable[..., Daemon]) -> Daemon:
    return make_daemon({"allowed_uids": (4242,)},
                       hooks={"requeue": HookSpec("requeue", "command", ("/bin/true", "{job_id}"), 5.0)})


@pytest.fixture
def sleeper():
    procs = []

    def start() -> int:
        p = subprocess.Popen(["sleep", "60"])
        procs.append(p)
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_check_peer_rules() -> None:
    s = DaemonSettings(allowed_uids=(1000,), allowed_gids=(2000,))
    assert check_peer(PeerCred(1, 0, 0), s, set()) is None
    assert check_peer(PeerCred(1, 1000, 1000), s, set()) is None
    assert check_peer(PeerCred(1, 1001, 2000), s, set()) is None
    assert check_peer(PeerCred(1, 1001, 1001), s, {2000}) is None  # supplementary group
    assert "not allowed" in (check_peer(PeerCred(1, 1001, 1001), s, {3000}) or "")
    no_root = DaemonSettings(allowed_uids=(1000,), allow_root=False)
    assert check_peer(PeerCred(1, 0, 0), no_root, set()) is not None


def test_real_socket_refuses_peer_not_allowed(daemon: Daemon, base: Path) -> None:
    daemon.settings = DaemonSettings(control_socket=str(base / "c.sock"), socket_group="", allow_root=False,
                                     allowed_uids=(4242,))
    srv = ControlServer(daemon.settings, daemon)
    srv.start()
    try:
        assert (os.stat(srv.path).st_mode & 0o777) == 0o660
        reply = request(str(srv.path), {"op": "status"})
        assert not reply["ok"] and "permission denied" in reply["error"] and "uid 0" in reply["error"]
        srv.settings = daemon.settings = DaemonSettings(control_socket=str(base / "c.sock"), socket_group="")
        assert request(str(srv.path), {"op": "status"})["ok"]
        # garbage and oversized requests are answered, never crash the server
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(srv.path))
        s.sendall(b"not json\n")
        assert "not valid JSON" in s.recv(4096).decode()
        s.sendall(b"x" * 70000)
        assert "longer than" in s.recv(4096).decode()
        s.close()
        assert request(str(srv.path), {"op": "status"})["ok"]
    finally:
        srv.stop()
    assert not srv.path.exists()


def test_a_silent_peer_is_dropped_after_peer_timeout_and_others_are_served(daemon: Daemon, base: Path) -> None:
    """A client that connects and never finishes its request (a hung prolog) is disconnected after
    daemon.peer_timeout_s; meanwhile other clients are answered."""
    daemon.settings = DaemonSettings(control_socket=str(base / "c.sock"), socket_group="", peer_timeout_s=1.0)
    srv = ControlServer(daemon.settings, daemon)
    srv.start()
    try:
        stuck = socket.socket(socket.AF_UNIX)
        stuck.connect(str(srv.path))
        stuck.sendall(b'{"op": "sta')  # half a request, then silence
        assert request(str(srv.path), {"op": "status"}, timeout_s=5.0)["ok"]  # served while the other hangs
        stuck.settimeout(10.0)
        t0 = time.monotonic()
        assert stuck.recv(4096) == b""  # the server closed it
        assert time.monotonic() - t0 < 5.0
        stuck.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("job_id", ["a/b", "..", "a..b", "x\n", "x\x1b[31m", "", "-x", "a" * 200, 5, None])
def test_bad_job_ids_refused(daemon: Daemon, sleeper, job_id: object) -> None:
    with pytest.raises(UsageError):
        handle_request(daemon, {"op": "job-start", "job_id": job_id, "pids": [sleeper()]}, ROOT)
    assert daemon.registrations() == {}


def test_unknown_hook_and_fields_refused(daemon: Daemon, sleeper) -> None:
    pid = sleeper()
    with pytest.raises(UsageError, match="unknown restart_hook"):
        handle_request(daemon, {"op": "job-start", "job_id": "j", "pids": [pid], "restart_hook": "rm -rf /"}, ROOT)
    with pytest.raises(UsageError, match="unknown field"):
        handle_request(daemon, {"op": "job-start", "job_id": "j", "pids": [pid], "argv": ["sh"]}, ROOT)
    with pytest.raises(UsageError, match="op must be"):
        handle_request(daemon, {"op": "exec", "job_id": "j"}, ROOT)
    ok = handle_request(daemon, {"op": "job-start", "job_id": "j", "pids": [pid], "restart_hook": "requeue"}, ROOT)
    assert ok["ok"] and daemon.registrations()["j"].restart_hook == "requeue"


def test_pids_must_be_live_and_owned(daemon: Daemon, sleeper) -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    for bad in ([p.pid], [0], [1], [-5], ["12"], [True], "123"):
        with pytest.raises(UsageError):
            handle_request(daemon, {"op": "job-start", "job_id": "j", "pids": bad}, ROOT)
    # alice (allowed peer) may not register root's processes
    with pytest.raises(UsageError, match="not to you"):
        handle_request(daemon, {"op": "job-start", "job_id": "j", "pids": [sleeper()]}, ALICE)
    with pytest.raises(UsageError, match="invalid cgroup"):
        handle_request(daemon, {"op": "job-start", "job_id": "j", "cgroup": "../../etc"}, ROOT)


def test_other_users_cannot_end_or_restart_a_job(daemon: Daemon, sleeper) -> None:
    handle_request(daemon, {"op": "job-start", "job_id": "j", "pids": [sleeper()]}, ROOT)
    for op in ("job-end", "restart", "preempt"):
        with pytest.raises(UsageError, match="another user"):
            handle_request(daemon, {"op": op, "job_id": "j"}, ALICE)
    assert "j" in daemon.registrations()
    with pytest.raises(UsageError, match="not registered"):
        handle_request(daemon, {"op": "restart", "job_id": "nope"}, ROOT)


def test_signals_only_reach_registered_job_processes(daemon: Daemon, sleeper) -> None:
    victim = sleeper()  # never registered
    job = subprocess.Popen([sys.executable, "-c", "import subprocess,time; subprocess.Popen(['sleep','60']); "
                            "time.sleep(60)"])
    try:
        handle_request(daemon, {"op": "job-start", "job_id": "j", "pids": [job.pid]}, ROOT)
        wait_for(lambda: psutil.Process(job.pid).children(), 15, "the job's child")
        pids = {p.pid for p in daemon.job_processes("j")}
        assert job.pid in pids and victim not in pids and os.getpid() not in pids
        assert len(pids) == 2  # the job and its child
        # a registered pid that exits and is "reused" does not count: create time is checked
        reg = daemon.registrations()["j"]
        first = reg.pids[0]
        daemon.register(replace(reg, pids=(replace(first, create_time=first.create_time + 1.0),)))
        assert job.pid not in {p.pid for p in daemon.job_processes("j")}
        # a job registered by a non-root peer never includes another user's processes
        daemon.register(replace(reg, registered_by_uid=4242))
        assert daemon.job_processes("j") == []
        # preempt of a job that did not opt in sends nothing
        reply = handle_request(daemon, {"op": "preempt", "job_id": "j", "timeout_s": 0.5}, ROOT)
        assert not reply["ok"] and "did not opt in" in reply["error"]
        assert psutil.Process(victim).status() != psutil.STATUS_ZOMBIE
    finally:
        for c in psutil.Process(job.pid).children(recursive=True):
            c.kill()
        job.kill()
        job.wait()


def test_preempt_with_signal_opt_in(base: Path) -> None:
    from dataclasses import replace

    cfg = Config()
    cfg = replace(cfg, recovery=replace(cfg.recovery, checkpoint_signal="SIGUSR1"))
    d = Daemon(cfg, DaemonSettings(socket_group=""), base / "state", notifier=Notifier(None))
    ready = base / "handler-installed"
    job = subprocess.Popen([sys.executable, "-c", "import pathlib,signal,sys,time; "
                            "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(0)); "
                            "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)", str(ready)])
    try:
        # SIGUSR1 before the handler is installed would kill the job (the default action), not preempt it.
        wait_for(ready.exists, 15, "the job's SIGUSR1 handler")
        handle_request(d, {"op": "job-start", "job_id": "j", "pids": [job.pid], "checkpoint_opt_in": True}, ROOT)
        from gpu_watchdog.detect.detector import DetectorState
        from gpu_watchdog.model import JobStatus

        d.state = DetectorState(jobs={"j": JobStatus("j", rank_pids={0: job.pid})})
        reply = handle_request(d, {"op": "preempt", "job_id": "j", "timeout_s": 5}, ROOT)
        assert reply["ok"] and reply["sent_to"] == [job.pid]
        assert job.wait(5) == 0
    finally:
        job.kill()


def test_hook_cli_against_real_daemon(base: Path) -> None:
    (base / "c.toml").write_text(f'[agent]\nbackend = "proc"\nstate_dir = "{base / "state"}"\n'
                                 f'[daemon]\ncontrol_socket = "{base / "c.sock"}"\nsocket_group = ""\n'
                                 '[hooks.requeue]\ntype = "slurm-requeue"\n')
    d = subprocess.Popen([GW, "run", "--config", str(base / "c.toml")], stderr=subprocess.PIPE)
    sl = subprocess.Popen(["sleep", "60"])
    try:
        wait_for((base / "c.sock").exists, 20, "the daemon's control socket")
        run = lambda *a: subprocess.run([GW, "hook", *a, "--config", str(base / "c.toml")],  # noqa: E731
                                        capture_output=True, text=True, timeout=30)
        r = run("job-start", "--job-id", "../etc", "--pid", str(sl.pid))
        assert r.returncode == 1 and "invalid job id" in r.stderr
        r = run("job-start", "--job-id", "j1", "--pid", str(sl.pid), "--restart-hook", "nope")
        assert r.returncode == 1 and "unknown restart_hook" in r.stderr
        assert run("job-start", "--job-id", "j1", "--pid", str(sl.pid), "--restart-hook", "requeue").returncode == 0
        st = json.loads(run("status", "--json").stdout)
        assert st["registered"] == ["j1"]
        plain = run("status").stdout  # --json is what makes it JSON
        assert "registered: j1" in plain and not plain.lstrip().startswith("{"), plain
        assert run("job-end", "--job-id", "j1").returncode == 0
        assert json.loads(run("status", "--json").stdout)["registered"] == []
    finally:
        sl.kill()
        d.send_signal(signal.SIGTERM)
        d.wait(15)


def test_slurm_prolog_epilog_with_standin_scontrol(base: Path) -> None:
    repo = REPO
    (base / "c.toml").write_text(f'[agent]\nbackend = "proc"\nstate_dir = "{base / "state"}"\n'
                                 f'[daemon]\ncontrol_socket = "{base / "c.sock"}"\nsocket_group = ""\n'
                                 '[hooks.slurm-requeue]\ntype = "slurm-requeue"\n')
    bindir = base / "bin"
    bindir.mkdir()
    sl = subprocess.Popen(["sleep", "60"])
    (bindir / "scontrol").write_text("#!/bin/sh\n[ \"$1\" = listpids ] || exit 2\n"
                                     "echo 'PID      JOBID    STEPID   LOCALID GLOBALID'\n"
                                     f"echo '{sl.pid}    $2    0    0    0'\n")
    (bindir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4711",
           "GPU_WATCHDOG": GW, "GPU_WATCHDOG_SOCKET": str(base / "c.sock"),
           "GPU_WATCHDOG_CGROUP_ROOT": str(base / "nocgroup")}
    d = subprocess.Popen([GW, "run", "--config", str(base / "c.toml")], stderr=subprocess.DEVNULL)
    try:
        wait_for((base / "c.sock").exists, 20, "the daemon's control socket")
        pro = subprocess.run([str(repo / "scheduler/slurm/prolog.sh")], env=env, capture_output=True, text=True,
                             timeout=30)
        assert pro.returncode == 0, pro.stderr
        st = request(str(base / "c.sock"), {"op": "status"})
        assert st["registered"] == ["4711"]
        epi = subprocess.run([str(repo / "scheduler/slurm/epilog.sh")], env=env, capture_output=True, text=True,
                             timeout=30)
        assert epi.returncode == 0 and request(str(base / "c.sock"), {"op": "status"})["registered"] == []
    finally:
        sl.kill()
        d.send_signal(signal.SIGTERM)
        d.wait(15)
    # the daemon is down: the prolog still exits 0 (never drains the node), and says why
    pro = subprocess.run([str(repo / "scheduler/slurm/prolog.sh")], env=env, capture_output=True, text=True,
                         timeout=30)
    assert pro.returncode == 0 and "not registered" in pro.stderr


def test_job_start_registers_the_live_pids_and_names_the_exited(daemon: Daemon, sleeper) -> None:
    """Seen on Slurm: one exited helper pid made the daemon refuse the whole registration."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = sleeper()
    reply = handle_request(daemon, {"op": "job-start", "job_id": "j", "pids": [gone.pid, live]}, ROOT)
    assert reply["ok"] and reply["pids"] == [live] and reply["gone"] == [gone.pid]
    with pytest.raises(UsageError, match="none of the pids"):
        handle_request(daemon, {"op": "job-start", "job_id": "k", "pids": [gone.pid]}, ROOT)


def test_a_run_merges_its_tasks_and_a_new_run_gets_a_clean_control_dir(daemon: Daemon, sleeper) -> None:
    """Every srun task's TaskProlog registers its own pid (same run: joined); a requeued run (next
    SLURM_RESTART_COUNT) replaces the registration and never sees the last run's checkpoint request."""
    first, second, rerun = sleeper(), sleeper(), sleeper()
    r0 = handle_request(daemon, {"op": "job-start", "job_id": "77", "pids": [first], "run": 0}, ROOT)
    handle_request(daemon, {"op": "job-start", "job_id": "77", "pids": [second], "run": 0}, ROOT)
    assert [p.pid for p in daemon.registrations()["77"].pids] == [first, second]
    old = Path(r0["control_dir"])
    assert old.is_dir() and old.name == "run-0"
    (old / "request.json").write_text('{"id": "old"}')
    r1 = handle_request(daemon, {"op": "job-start", "job_id": "77", "pids": [rerun], "run": 1}, ROOT)
    assert [p.pid for p in daemon.registrations()["77"].pids] == [rerun]
    new = Path(r1["control_dir"])
    assert new != old and new.is_dir() and [p.name for p in new.iterdir()] == ["flight-recorder"]
    assert list((new / "flight-recorder").iterdir()) == []  # [flight_recorder]: the run's own, empty
    assert daemon.control_dir("77").path == new
    for bad in (-1, "1", True, 1.5):
        with pytest.raises(UsageError, match="run must be"):
            handle_request(daemon, {"op": "job-start", "job_id": "77", "pids": [rerun], "run": bad}, ROOT)


def test_task_prolog_exports_the_fallback_env(base: Path) -> None:
    """The shipped TaskProlog against a real daemon: the task's pid ($PPID) registered, the job's fallback
    overlay, level and control dir printed as Slurm TaskProlog lines; a daemon that is down: a `print`
    line, exit 0."""
    from gpu_watchdog.policy.ladder import FallbackDecision
    from gpu_watchdog.store.fallback_levels import FallbackStore

    (base / "c.toml").write_text(f'[agent]\nbackend = "proc"\nstate_dir = "{base / "state"}"\n'
                                 f'[daemon]\ncontrol_socket = "{base / "c.sock"}"\nsocket_group = ""\n'
                                 '[hooks.slurm-requeue]\ntype = "slurm-requeue"\n')
    FallbackStore(base / "state").save("4711", FallbackDecision(1, "p2p-off", {"NCCL_P2P_DISABLE": "1",
                                                                              "NCCL_IB_HCA": "^mlx5_1,x"}),
                                       {"NCCL_P2P_DISABLE": "1", "NCCL_IB_HCA": "^mlx5_1,x"})
    env = {**os.environ, "SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "2", "GPU_WATCHDOG": GW,
           "GPU_WATCHDOG_SOCKET": str(base / "c.sock")}
    task = [sys.executable, "-c", "import subprocess, sys; r = subprocess.run([sys.argv[1]], capture_output=True, "
            "text=True); print(r.stdout, end=''); import time; time.sleep(30)",
            str(REPO / "scheduler/slurm/task_prolog.sh")]
    d = subprocess.Popen([GW, "run", "--config", str(base / "c.toml")], stderr=subprocess.DEVNULL)
    try:
        wait_for((base / "c.sock").exists, 20, "the daemon's control socket")
        t = subprocess.Popen(task, env=env, stdout=subprocess.PIPE, text=True)
        try:
            lines = []
            assert t.stdout is not None
            for _ in range(4):
                lines.append(t.stdout.readline().strip())
            reg = request(str(base / "c.sock"), {"op": "status"})
            assert reg["registered"] == ["4711"]
        finally:
            t.kill()
            t.wait()
        assert "export NCCL_P2P_DISABLE=1" in lines and "export NCCL_IB_HCA=^mlx5_1,x" in lines  # verbatim
        assert "export GPU_WATCHDOG_FALLBACK_LEVEL=1" in lines
        ctl = [ln for ln in lines if ln.startswith("export GPU_WATCHDOG_CONTROL_DIR=")]
        assert ctl and ctl[0].endswith("/run/4711/run-2"), lines
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(15)
    out = subprocess.run([str(REPO / "scheduler/slurm/task_prolog.sh")], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("print gpu-watchdog task prolog: job 4711 not registered")
    assert "export" not in out.stdout
    assert "unset GPU_WATCHDOG_CONTROL_DIR" in out.stdout.splitlines()  # never another node's control dir


def test_a_node_whose_daemon_is_down_still_exports_the_jobs_settings(base: Path) -> None:
    """Multi-node: node 1's daemon is down while node 2's agent decided run 1 at level 1 (fallback.shared_dir). Node
    1's TaskProlog still exports that run's settings (its ranks must match node 2's), saying it is unregistered;
    a run nobody decided, or a config without a shared directory, exports nothing."""
    from gpu_watchdog.store.job_runs import JobRuns

    shared = base / "shared"
    JobRuns(shared, "node2").claim("4711", 1, {"level": 1, "env": {"NCCL_P2P_DISABLE": "1"}})
    cfg = base / "c.toml"
    cfg.write_text(f'[daemon]\ncontrol_socket = "{base / "down.sock"}"\n[fallback]\nshared_dir = "{shared}"\n')
    env = {k: v for k, v in os.environ.items() if k != "GPU_WATCHDOG_SOCKET"}
    env.update({"SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "1", "GPU_WATCHDOG": GW,
                "GPU_WATCHDOG_CONFIG": str(cfg)})
    prolog = [str(REPO / "scheduler/slurm/task_prolog.sh")]
    out = subprocess.run(prolog, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("print gpu-watchdog: job 4711 not registered (cannot reach the daemon"), lines
    assert "export NCCL_P2P_DISABLE=1" in lines and "export GPU_WATCHDOG_FALLBACK_LEVEL=1" in lines
    assert "unset GPU_WATCHDOG_CONTROL_DIR" in lines  # unregistered: not the batch host's control dir
    for run, text in (("0", cfg.read_text()), ("1", f'[daemon]\ncontrol_socket = "{base / "down.sock"}"\n')):
        cfg.write_text(text)
        out = subprocess.run(prolog, env={**env, "SLURM_RESTART_COUNT": run}, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0 and "not registered" in out.stdout and "export" not in out.stdout, out.stdout


def test_env_fails_loudly_on_an_unreadable_state_dir(base: Path) -> None:
    """`gpu-watchdog env` as a job user cannot open the 0750 state dir: exit 66 with one line, never a silent
    level 0. A state dir that exists without the job's file is level 0."""
    state = base / "state"
    (state / "jobs").mkdir(parents=True)
    ok = subprocess.run([GW, "env", "--state-dir", str(state), "--job", "j"], capture_output=True, text=True,
                        timeout=30)
    assert ok.returncode == 0 and "level 0" in ok.stdout
    (state / "jobs" / "j.json").write_text("{not json")
    bad = subprocess.run([GW, "env", "--state-dir", str(state), "--job", "j"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 66 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1, bad
    assert "cannot read" in bad.stderr
    missing = subprocess.run([GW, "env", "--state-dir", str(base / "nope"), "--job", "j"], capture_output=True,
                             text=True, timeout=30)
    assert missing.returncode == 66 and "cannot read the state dir" in missing.stderr, missing


def test_slurm_epilog_logs_a_failed_deregistration_where_it_can_be_read(base: Path) -> None:
    """Slurm discards an Epilog's output: with the daemon unreachable the epilog still exits 0 and says so to syslog
    (logger) and to GPU_WATCHDOG_EPILOG_LOG; GPU_WATCHDOG_SOCKET names the daemon's socket."""
    bindir = base / "bin"
    bindir.mkdir()
    (bindir / "logger").write_text(f"#!/bin/sh\necho \"$@\" >> {base / 'syslog'}\n")
    (bindir / "logger").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4712", "GPU_WATCHDOG": GW,
           "GPU_WATCHDOG_SOCKET": str(base / "gone.sock"), "GPU_WATCHDOG_EPILOG_LOG": str(base / "epilog.log")}
    epi = subprocess.run([str(REPO / "scheduler/slurm/epilog.sh")], env=env, capture_output=True, text=True,
                         timeout=30)
    assert epi.returncode == 0, epi.stderr
    syslog = (base / "syslog").read_text()
    assert "-t gpu-watchdog-epilog" in syslog and "job 4712: not de-registered" in syslog
    assert f"cannot reach the daemon at {base / 'gone.sock'}" in syslog, syslog
    assert "job 4712: not de-registered" in (base / "epilog.log").read_text()
