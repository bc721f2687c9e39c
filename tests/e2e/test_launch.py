"""Acceptance tests of the recovery loop: ``gpu-watchdog launch`` around real torchrun gloo jobs, plus unit
tests of its pure parts (restart budget, fallback ladder, stores, stop ladder, in-job client protocol).

The slow tests run the real console script in a subprocess around ``python -m torch.distributed.run`` with the
packaged demo job (``gpu_watchdog/demo/train.py``) or ``tests/jobs/train.py``. Every process they start is killed
at the end: the launcher, and every process carrying the test's unique ``GPU_WATCHDOG_JOB_ID``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import namedtuple
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
from gpu_watchdog.act.stopper import JobProcess, job_tree, send_signal, stop_processes
from gpu_watchdog.atomic import write_errors
from gpu_watchdog.config.schema import FallbackConfig, FallbackLevel, RecoveryConfig
from gpu_watchdog.demo import train as demo_job
from gpu_watchdog.demo.runner import read_events
from gpu_watchdog.errors import EXIT_BUDGET_SPENT, NoInputError, UsageError
from gpu_watchdog.job import Client
from gpu_watchdog.job.protocol import EXIT_ABORTED, EXIT_CHECKPOINTED, ControlDir
from gpu_watchdog.model import Finding, validate_job_id
from gpu_watchdog.policy import ladder
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.policy.ladder import FallbackDecision, decide, hang_place
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore
from repo_paths import REPO
from waiting import wait_for

TRAIN = REPO / "tests" / "jobs" / "train.py"
VENV_BIN = Path(sys.executable).parent
GW = str(VENV_BIN / "gpu-watchdog") if (VENV_BIN / "gpu-watchdog").exists() else (shutil.which("gpu-watchdog")
                                                                                     or "gpu-watchdog")
CONTRACT_FIELDS = ("id", "job_id", "kind", "signature", "onset", "detected_at", "culprit_ranks", "collective",
                   "stacks_dir", "actions", "fallback")
LEVEL1_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
# Recovery tests: sample twice a second and shorten the client's boundary wait; detection keeps its defaults.
FAST_CFG = """\
[agent]
interval_s = 0.5

[recovery]
client_boundary_s = 2.0
stop_grace_s = 10.0
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _finding(job: str = "job-a", confirmed_at: float = 1000.0, kind: str = "stall") -> Finding:
    return Finding(kind, "idle_held", job, (0, 1, 2, 3), (), confirmed_at - 5.0, confirmed_at, (),
                   "no rank makes progress", "stacks")


# == RestartBudget ===========================================================================================
def test_budget_window_limits_restarts_then_forgets_old_ones() -> None:
    b = RestartBudget(RecoveryConfig(max_restarts=2, restart_window_s=100.0, max_no_progress_restarts=99))
    assert b.allow(0.0, 10) == (True, "")
    assert b.allow(10.0, 20) == (True, "")
    ok, why = b.allow(20.0, 30)
    assert not ok and "2 restarts in the last 100s" in why and "recovery.max_restarts" in why
    ok, why = b.allow(99.0, 40)  # t=0 and t=10 still inside the window
    assert not ok
    assert b.allow(111.0, 50) == (True, "")  # both earlier restarts left the window
    assert b.restarts == [0.0, 10.0, 111.0]  # refused hangs are not counted as restarts


def test_budget_stops_runs_that_hang_again_without_progress() -> None:
    b = RestartBudget(RecoveryConfig(max_restarts=100, max_no_progress_restarts=2))
    assert b.allow(0.0, 11)[0]  # first hang after step 11
    assert b.allow(1.0, 11)[0]  # hung again at the same step: 1 without progress
    ok, why = b.allow(2.0, None)  # the next run hung before reporting any step: no progress either
    assert not ok
    assert "2 restarts in a row hung again without passing step 11" in why
    assert "max_no_progress_restarts" in why


def test_budget_progress_resets_the_no_progress_count() -> None:
    b = RestartBudget(RecoveryConfig(max_restarts=100, max_no_progress_restarts=2))
    assert b.allow(0.0, 5)[0]
    assert b.allow(1.0, 5)[0]  # no progress: 1
    assert b.allow(2.0, 9)[0]  # got past step 5: back to 0
    assert b.no_progress == 0 and b.last_hang_step == 9
    assert b.allow(3.0, 9)[0]  # 1 again, still allowed
    assert not b.allow(4.0, 3)[0]  # an earlier step is no progress: 2


def test_budget_without_heartbeats_only_counts_restarts() -> None:
    """An unmodified job reports no steps: the no-progress rule cannot judge it, the window rule still applies."""
    b = RestartBudget(RecoveryConfig(max_restarts=3, restart_window_s=3600.0, max_no_progress_restarts=1))
    assert [b.allow(float(t), None)[0] for t in range(4)] == [True, True, True, False]


# == ladder.decide ==========================================================================================
@pytest.fixture
def big_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ladder.shutil, "disk_usage", lambda _p: usage(64 << 30, 0, 64 << 30))


COMM = "stacks: ranks 0,2,3 wait in all_reduce"  # communication evidence, as act.gather words it


def test_decide_climbs_the_ladder_in_order_then_reports_exhaustion(big_shm: None) -> None:
    cfg = FallbackConfig()
    seen = []
    level = 0
    for _ in range(3):
        d = decide(cfg, level, "stall", "collective", communication=COMM)
        assert d.changed and d.level == level + 1
        seen.append((d.name, d.env))
        level = d.level
    assert seen == [
        ("p2p-nvls-off", LEVEL1_ENV),
        ("no-ll128", {**LEVEL1_ENV, "NCCL_PROTO": "^LL128"}),
        ("simple-proto", {**LEVEL1_ENV, "NCCL_PROTO": "Simple"}),
    ]
    last = decide(cfg, 3, "stall", "collective", communication=COMM)
    assert not last.changed and last.level == 3 and last.env == seen[-1][1]
    assert "exhausted" in last.advice


def test_decide_adds_the_site_network_env_to_every_level(big_shm: None) -> None:
    cfg = FallbackConfig(levels=(FallbackLevel("a", {"NCCL_P2P_DISABLE": "1"}),),
                         network_env={"NCCL_SOCKET_IFNAME": "eth0"})
    d = decide(cfg, 0, "stall", None, communication=COMM)  # every rank waits in communication: a transport hang
    assert d.level == 1 and d.env == {"NCCL_P2P_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}


@pytest.mark.parametrize("state, words", [("io", "checkpoint I/O"), ("data_wait", "dataloader"),
                                          ("compute", "same collectives")])
@pytest.mark.parametrize("level", [0, 1])
def test_decide_application_culprit_gets_advice_not_a_new_level(big_shm: None, state: str, words: str,
                                                                  level: int) -> None:
    cfg = FallbackConfig()
    d = decide(cfg, level, "stall", state, communication=COMM)
    assert d.level == level and not d.changed
    assert d.env == (LEVEL1_ENV if level == 1 else {})  # the current settings are kept as they are
    assert words in d.advice


def test_decide_never_climbs_for_a_data_wait_even_when_it_comes_back(big_shm: None) -> None:
    """A data wait is the culprit's own code: a plain restart with advice, however often it comes back at the same
    place (no NCCL change without the hang itself in communication)."""
    cfg = FallbackConfig()
    place = hang_place("data_wait", "Queue.get (queue.py:171)")
    comm = "stacks: ranks 0,1,3 wait in all_reduce"
    first = decide(cfg, 0, "stall", "data_wait", communication=comm, place=place)
    assert (first.level, first.changed) == (0, False) and first.reason.startswith("advice only: data wait")
    again = decide(cfg, 0, "stall", "data_wait", communication=comm, place=place)
    assert (again.level, again.changed, again.env) == (0, False, {}) and again.hang_place == first.hang_place


@pytest.mark.parametrize("state", ["io", "stopped"])
def test_decide_never_climbs_for_slow_io_or_a_stopped_rank(big_shm: None, state: str) -> None:
    place = hang_place(state, "write (ckpt.py:3)")
    d = decide(FallbackConfig(), 0, "stall", state, communication="stacks: rank 0 waits in barrier", place=place)
    assert (d.level, d.changed) == (0, False) and d.reason.startswith(f"advice only: {state}")


def test_decide_desync_gets_the_cause_and_no_nccl_change(big_shm: None) -> None:
    d = decide(FallbackConfig(), 1, "stall", "collective", desync=True)
    assert (d.level, d.changed, d.env) == (1, False, LEVEL1_ENV)
    assert "synced_gpus=True" in d.advice and "No NCCL setting helps" in d.advice
    assert d.reason == "advice only: desync (the ranks issued different collectives)"


@pytest.mark.parametrize("level", [0, 2])
def test_decide_gpu_fault_changes_no_nccl_setting(big_shm: None, level: int) -> None:
    cfg = FallbackConfig()
    d = decide(cfg, level, "gpu_fault", "collective")
    assert d.level == level and not d.changed
    assert d.env == ladder.overlay(cfg, level)
    assert "drain" in d.advice


def test_decide_warns_about_a_small_dev_shm_when_disabling_p2p(monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    calls = []

    def small(path: str) -> Any:
        calls.append(path)
        return usage(64 << 20, 0, 64 << 20)

    monkeypatch.setattr(ladder.shutil, "disk_usage", small)
    d = decide(FallbackConfig(), 0, "stall", "collective", communication=COMM)
    assert calls == ["/dev/shm"]
    assert d.level == 1 and d.env == LEVEL1_ENV  # still applied: the warning is advice
    assert "WARNING: /dev/shm is only 64 MiB" in d.advice and "--shm-size" in d.advice

    def missing(path: str) -> Any:
        raise FileNotFoundError(path)

    monkeypatch.setattr(ladder.shutil, "disk_usage", missing)
    assert "/dev/shm is missing" in decide(FallbackConfig(), 0, "stall", "collective", communication=COMM).advice


def test_decide_no_warning_with_a_big_dev_shm(big_shm: None) -> None:
    assert "WARNING" not in decide(FallbackConfig(), 0, "stall", "collective", communication=COMM).advice


# == FallbackStore ===========================================================================================
def test_fallback_store_persists_per_job(tmp_path: Path) -> None:
    d = FallbackDecision(2, "no-ll128", {"NCCL_PROTO": "^LL128"}, "advice", True)
    FallbackStore(tmp_path).save("job-1", d, {"NCCL_PROTO": "^LL128", "NCCL_DEBUG": "INFO"}, now=123.0)
    again = FallbackStore(tmp_path)  # a new process reads what the last one wrote
    assert again.level("job-1") == 2
    data = again.load("job-1")
    assert data["env"] == {"NCCL_PROTO": "^LL128", "NCCL_DEBUG": "INFO"} and data["updated_at"] == 123.0
    assert again.level("other-job") == 0 and again.load("other-job")["env"] == {}
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == ["job-1.json"]  # no temp files left
    (tmp_path / "jobs" / "broken.json").write_text("{not json")
    assert again.level("broken") == 0  # a torn file is "no fallback", never a crash


def test_fallback_store_resets_to_level_0_after_a_healthy_period(tmp_path: Path) -> None:
    cfg = FallbackConfig(healthy_reset_s=1800.0)
    store = FallbackStore(tmp_path)
    assert not store.note_healthy("j", 0.0, 5000.0, cfg)  # level 0 already: nothing to reset
    store.save("j", FallbackDecision(1, "p2p-nvls-off", LEVEL1_ENV), LEVEL1_ENV)
    assert not store.note_healthy("j", 1000.0, 2799.0, cfg)
    assert store.level("j") == 1
    assert store.note_healthy("j", 1000.0, 2800.0, cfg)
    assert store.level("j") == 0 and store.load("j")["env"] == {}


@pytest.mark.parametrize("bad", ["a/b", "/abs", "..", "../x", "a..b", "a\nb", "abc\n", "a\x00b", "a\x7fb", "tab\t",
                                 "", ".hidden", "-flag", "x" * 129, "sp ace"])
def test_job_id_validation_rejects_paths_and_control_chars(tmp_path: Path, bad: str) -> None:
    with pytest.raises(UsageError, match="invalid job id"):
        validate_job_id(bad)
    with pytest.raises(UsageError):
        FallbackStore(tmp_path).load(bad)
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())


@pytest.mark.parametrize("good", ["j", "launch-host-123-1700000000", "slurm.42:step@1+x", "A" * 128])
def test_job_id_validation_accepts_ordinary_ids(good: str) -> None:
    assert validate_job_id(good) == good


def test_cli_env_rejects_a_bad_job_id(tmp_path: Path) -> None:
    r = subprocess.run([GW, "env", "--job", "../etc", "--state-dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 64, r
    assert "invalid job id" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# == stopper =================================================================================================
IGNORE_TERM = """\
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").close()
time.sleep(120)
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _start_py(started: list[subprocess.Popen[bytes]], code: str, *args: str, ready: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, start_new_session=True)
    started.append(p)
    if ready is not None:
        wait_for(ready.exists, 30, f"{ready} from pid {p.pid}")
    return p


def test_stop_escalates_to_sigkill_for_a_process_ignoring_sigterm(tmp_path: Path, procs: list) -> None:
    stubborn = _start_py(procs, IGNORE_TERM, str(tmp_path / "r1"), ready=tmp_path / "r1")
    polite = _start_py(procs, "import time; time.sleep(120)")
    wait_for(lambda: psutil.Process(polite.pid).cmdline()[:1] == [sys.executable], 30, "polite to exec")
    jps = job_tree(stubborn.pid) + job_tree(polite.pid)
    assert {j.pid for j in jps} == {stubborn.pid, polite.pid}

    def reap() -> None:
        stubborn.poll()
        polite.poll()

    t0 = time.monotonic()
    res = stop_processes(jps, grace_s=1.0, reap=reap)
    assert res.ok and res.survivors == ()
    assert res.terminated == (polite.pid,) and res.killed == (stubborn.pid,)
    assert time.monotonic() - t0 >= 1.0  # the grace period was given
    assert stubborn.wait(5) == -signal.SIGKILL and polite.wait(5) == -signal.SIGTERM
    assert "1 exited on SIGTERM, 1 needed SIGKILL" in res.detail


def test_stop_never_signals_a_pid_whose_create_time_differs(tmp_path: Path, procs: list) -> None:
    p = _start_py(procs, IGNORE_TERM.replace("signal.SIG_IGN", "lambda *a: open(sys.argv[1] + '.sig', 'w')"),
                  str(tmp_path / "r"), ready=tmp_path / "r")
    real = job_tree(p.pid)[0]
    impostor = JobProcess(p.pid, real.create_time + 1.0)  # "the same pid, but a different process"
    assert not send_signal(impostor, signal.SIGKILL)
    res = stop_processes([impostor], grace_s=0.2, reap=p.poll)
    assert res.ok and res.killed == () and res.survivors == ()
    time.sleep(0.3)
    assert p.poll() is None and not (tmp_path / "r.sig").exists()
    assert send_signal(real, signal.SIGKILL)  # the genuine identity is signalled
    assert p.wait(5) == -signal.SIGKILL


def test_job_tree_includes_descendants(tmp_path: Path, procs: list) -> None:
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)']); open(sys.argv[1], 'w').write(str(c.pid)); time.sleep(120)")
    p = _start_py(procs, code, str(tmp_path / "c"), ready=tmp_path / "c")
    child = int(wait_for(lambda: (tmp_path / "c").read_text(), 10, "child pid"))
    assert {j.pid for j in job_tree(p.pid)} == {p.pid, child}
    res = stop_processes(job_tree(p.pid), grace_s=5.0, reap=p.poll)
    assert res.ok and set(res.terminated) == {p.pid, child}
    wait_for(lambda: _gone(child), 10, "the grandchild to be gone")
    assert job_tree(999_999_999) == []


# == IncidentStore ===========================================================================================
def test_incident_summary_has_the_contract_fields(tmp_path: Path) -> None:
    inc = IncidentStore(tmp_path).create(_finding("job-a", 1000.0), "host-1")
    entry = inc.begin_action("dump_stacks")
    on_disk = json.loads((inc.dir / "summary.json").read_text())
    assert on_disk["actions"][0]["ok"] is None  # logged before it runs
    inc.end_action(entry, True, "4/4 ranks dumped")
    inc.record_action("checkpoint", False, "skipped")
    inc.update(culprit_ranks=[2], collective="all_reduce", fallback={"level": 1, "env": LEVEL1_ENV})
    (s,) = IncidentStore(tmp_path).list()
    for key in CONTRACT_FIELDS:
        assert key in s, key
    assert s["id"] == inc.id and s["job_id"] == "job-a" and s["kind"] == "stall"
    assert s["signature"] == "idle_held" and s["onset"] == 995.0 and s["detected_at"] == 1000.0
    assert s["culprit_ranks"] == [2] and s["collective"] == "all_reduce"
    assert Path(s["stacks_dir"]).is_dir() and Path(s["stacks_dir"]) == inc.stacks_dir
    assert [(a["action"], a["ok"], a["detail"]) for a in s["actions"]] == [
        ("dump_stacks", True, "4/4 ranks dumped"), ("checkpoint", False, "skipped")]
    assert all(isinstance(a["at"], float) for a in s["actions"])
    assert s["fallback"] == {"level": 1, "env": LEVEL1_ENV}
    assert IncidentStore(tmp_path).get(inc.id).summary == s


def test_incident_summary_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inc = IncidentStore(tmp_path).create(_finding(), "h")
    inc.update(collective="all_reduce")
    before = (inc.dir / "summary.json").read_text()

    def crash(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    errors = write_errors()
    monkeypatch.setattr(os, "replace", crash)
    inc.update(collective="barrier", culprit_ranks=[1])  # a full disk never stops the recovery writing it
    monkeypatch.undo()
    assert write_errors() == errors + 1
    assert (inc.dir / "summary.json").read_text() == before  # the old summary, whole
    assert json.loads(before)["collective"] == "all_reduce"
    assert sorted(p.name for p in inc.dir.iterdir() if p.is_file()) == ["summary.json"]  # no temp left
    inc.update(collective="barrier")  # space is back: what was kept in memory lands
    assert json.loads((inc.dir / "summary.json").read_text())["culprit_ranks"] == [1]


def test_incident_list_is_oldest_first_and_ids_are_unique(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path)
    a = store.create(_finding("j", 300.0), "h", now=1_700_000_000.0)
    b = store.create(_finding("j", 100.0), "h", now=1_700_000_000.0)  # same second: a distinct id
    c = store.create(_finding("j", 200.0), "h", now=1_700_000_001.0)
    assert len({a.id, b.id, c.id}) == 3
    assert [s["id"] for s in store.list()] == [b.id, c.id, a.id]  # by detection time
    (tmp_path / "incidents" / "junk").mkdir()  # unreadable entries are skipped
    assert len(store.list()) == 3
    with pytest.raises(UsageError):
        store.get("../etc")
    with pytest.raises(NoInputError, match="no incident"):  # exit 66: an input that does not exist
        store.get("nope")


# == the in-job client's file protocol =======================================================================
def test_client_from_env_outside_the_watchdog_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPU_WATCHDOG_CONTROL_DIR", raising=False)
    c = Client.from_env()
    assert not c.enabled
    c.on_checkpoint(lambda s: None)
    with c.training():
        c.step(1)
    assert c.last_step == 1


def test_client_announces_heartbeats_and_saves_at_the_step_boundary(tmp_path: Path) -> None:
    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    c = Client(ctl.path, rank=3, poll_s=0.02)
    saved: list[int | None] = []
    c.on_checkpoint(saved.append)
    announce = ctl.clients()
    assert list(announce) == [3] and announce[3]["pid"] == os.getpid()
    requested_after = None
    with pytest.raises(SystemExit) as exit_info:
        with c.training():
            for step in range(1, 500):
                time.sleep(0.02)
                c.step(step)
                assert ctl.steps() == {3: step}  # the heartbeat
                if step == 5:
                    ctl.request_checkpoint("inc-1", 5.0)
                    requested_after = step
    c.close()
    assert exit_info.value.code == EXIT_CHECKPOINTED == 85
    assert requested_after == 5 and len(saved) == 1 and saved[0] is not None and saved[0] > 5
    ack = ctl.acks("inc-1")
    assert ack[3]["outcome"] == "saved" and ack[3]["step"] == saved[0] and ack[3]["pid"] == os.getpid()
    assert ctl.acks("another-request") == {}


def test_client_exits_only_after_every_announced_peer_acked(tmp_path: Path) -> None:
    """The first rank to exit makes torchrun SIGTERM the rest: a client holds its exit until all clients acked."""
    import threading

    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    c = Client(ctl.path, rank=1, poll_s=0.02)
    c.on_checkpoint(lambda step: None)
    (ctl.path / "client-0.json").write_text(json.dumps({"pid": 1, "rank": 0, "t": 0}))  # a peer, still saving
    ctl.request_checkpoint("inc-2", 5.0, grace_s=30.0)
    wait_for(lambda: c.checkpoint_requested, 5, "the client to see the request")
    result: list[Any] = []

    def at_boundary() -> None:
        try:
            c.step(4)
        except BaseException as e:  # noqa: B036 - _Exit is a BaseException
            result.append(e)

    th = threading.Thread(target=at_boundary)
    th.start()
    wait_for(lambda: 1 in ctl.acks("inc-2"), 5, "rank 1's ack")
    time.sleep(0.5)
    assert th.is_alive() and not result  # saved and acked, but waiting for rank 0
    (ctl.path / "ack-0.json").write_text(json.dumps({"id": "inc-2", "rank": 0, "outcome": "saved", "step": 4}))
    th.join(5)
    assert not th.is_alive() and result and result[0].args == (EXIT_CHECKPOINTED,)
    c.close()


def test_client_exit_wait_is_bounded_by_the_request_grace(tmp_path: Path) -> None:
    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    c = Client(ctl.path, rank=1, poll_s=0.02)
    c.on_checkpoint(lambda step: None)
    (ctl.path / "client-0.json").write_text(json.dumps({"pid": 1, "rank": 0, "t": 0}))  # never answers
    ctl.request_checkpoint("inc-3", 5.0, grace_s=0.5)
    wait_for(lambda: c.checkpoint_requested, 5, "the client to see the request")
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        with c.training():
            c.step(1)
    assert exit_info.value.code == EXIT_CHECKPOINTED and 0.4 < time.monotonic() - t0 < 3.0
    c.close()


CLIENT_ABORT_JOB = textwrap.dedent("""\
    import json, os, sys, threading, time
    import torch
    import torch.distributed as dist
    from gpu_watchdog.job import Client

    rank, store, ctl, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    t = torch.ones(4)
    if rank == 0:  # the hung peer: takes part in steps 1-3, never joins step 4's all_reduce
        for _ in range(3):
            dist.all_reduce(t)
        threading.Event().wait()  # blocked for good (a sleep would be a slow rank, not a hung one)
    client = Client(ctl, rank, poll_s=0.05)

    def save(step):
        with open(out, "w") as f:
            json.dump({"step": step}, f)

    client.on_checkpoint(save)
    with client.training():
        for step in range(1, 10):
            if step == 4:
                open(out + ".blocked", "w").close()
            dist.all_reduce(t)  # blocks at step 4
            client.step(step)
""")


@pytest.mark.slow
def test_client_aborts_a_blocked_gloo_collective_and_saves_the_last_step(tmp_path: Path, procs: list) -> None:
    script = tmp_path / "job.py"
    script.write_text(CLIENT_ABORT_JOB)
    ctl = ControlDir(tmp_path / "ctl")
    ctl.create()
    out = tmp_path / "saved.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), str(ctl.path),
                               str(out)], env=env, start_new_session=True) for r in (0, 1)]
    procs.extend(ranks)
    wait_for(lambda: Path(f"{out}.blocked").exists(), 120, "rank 1 to reach step 4")
    wait_for(lambda: 1 in ctl.clients() and ctl.steps().get(1) == 3, 10, "the announce and heartbeat")
    # Prove the main thread sits in the collective: py-spy sees all_reduce on top.
    from gpu_watchdog.evidence.stacks.dump import dump_stacks

    def in_all_reduce() -> bool:
        (res,) = dump_stacks([ranks[1].pid], timeout_s=10)
        main = [th for th in res.threads if th.get("thread_name") == "MainThread"]
        return bool(main) and main[0]["frames"][0]["name"] == "all_reduce"

    wait_for(in_all_reduce, 20, "rank 1's main thread to block in all_reduce", poll=0.3)
    t0 = time.monotonic()
    ctl.request_checkpoint("inc-abort", 0.5)
    assert ranks[1].wait(30) == EXIT_ABORTED == 86
    assert time.monotonic() - t0 < 2.0 + 0.5 + 5.0
    assert json.loads(out.read_text()) == {"step": 3}  # the last completed step
    ack = ctl.acks("inc-abort")[1]
    assert ack["outcome"] == "aborted_saved" and ack["step"] == 3
    # Note: on torch 2.13 (CPU, this machine) _abort_process_group() returns at once but does NOT make the
    # pending gloo all_reduce raise; the client's helper thread saves and exits 86 after its 2 s wait instead.
    assert ranks[0].poll() is None  # the peer is untouched (the test kills it)


# == gpu-watchdog launch around real torchrun jobs ===========================================================
def _job_processes(job_id: str) -> list[psutil.Process]:
    """Live processes carrying this job id in their environment (torchrun and its ranks)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("GPU_WATCHDOG_JOB_ID") == job_id and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def torchrun(nproc: int, script: str | Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), *args]


def gw(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([GW, *args], capture_output=True, text=True, timeout=60)
    if check:
        assert r.returncode == 0, r
    return r


class Launched:
    """``gpu-watchdog launch`` started in a subprocess, its output in a file; kill() ends it and its job."""

    def __init__(self, tmp: Path, name: str, cmd: Sequence[str], config: str | None) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.job_id = f"t-{name}-{uuid.uuid4().hex[:8]}"
        self.log = tmp / "launcher.log"
        argv = [GW, "launch", "--state-dir", str(self.state), "--job-id", self.job_id]
        if config is not None:
            (tmp / "watchdog.toml").write_text(config)
            argv += ["--config", str(tmp / "watchdog.toml")]
        argv += ["--", *cmd]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GPU_WATCHDOG_JOB_ID", "TORCHELASTIC_RUN_ID"):
            env.pop(k, None)
        self.t0 = time.time()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=tmp, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"launcher still running after {timeout}s:\n{self.output()[-6000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in _job_processes(self.job_id):
            try:
                p.kill()
            except psutil.Error:
                pass

    def incidents(self) -> list[dict[str, Any]]:
        return json.loads(gw("incidents", "--json", "--state-dir", str(self.state)).stdout)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Launched]]:
    started: list[Launched] = []

    def start(name: str, cmd: Sequence[str], config: str | None = FAST_CFG) -> Launched:
        lc = Launched(tmp_path, name, cmd, config)
        started.append(lc)
        return lc

    yield start
    for lc in started:
        lc.kill()


def demo_cmd(tmp: Path, *extra: str, nproc: int = 4, steps: int = 20, hang_at: int = 8,
             hang_rank: int = 2) -> list[str]:
    (tmp / "ckpt").mkdir(exist_ok=True)
    return torchrun(nproc, demo_job.__file__, "--ckpt-dir", str(tmp / "ckpt"), "--events", str(tmp / "events.jsonl"),
                    "--steps", str(steps), "--hang-at", str(hang_at), "--hang-rank", str(hang_rank), *extra)


def _starts(events: list[dict[str, Any]], restart: str) -> list[dict[str, Any]]:
    return sorted((e for e in events if e["event"] == "start" and e.get("restart") == restart),
                  key=lambda e: e["rank"])


def _assert_no_job_left(lc: Launched, exclude: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    left = [p for p in _job_processes(lc.job_id) if p.pid not in exclude]
    assert not left, f"job processes survived: {[(p.pid, p.cmdline()[:4]) for p in left]}"


DECOY = """\
import signal, sys, time
out = sys.argv[1]
ballast = bytearray(32 << 20)  # holds "memory" like a rank


def record(signum, _frame):
    with open(out, "a") as f:
        f.write(f"{signum}\\n")


for s in signal.valid_signals():
    if s not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            signal.signal(s, record)
        except (OSError, ValueError):
            pass
open(out + ".ready", "w").close()
while True:
    time.sleep(0.5)  # idle: looks exactly like a hung rank
"""


class PlainRun:
    """One launcher run of the unmodified demo job (hangs at step 8 on rank 2), with a decoy beside it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.lc = Launched(tmp, "plain", demo_cmd(tmp, "--save-every", "1"), FAST_CFG)
        # The decoy: started by the test, outside the launched tree, but carrying the very same identity as the
        # culprit rank (job id, RANK=2) — and idle, like a hung rank.
        env = dict(os.environ, RANK="2", LOCAL_RANK="2", WORLD_SIZE="4", GPU_WATCHDOG_JOB_ID=self.lc.job_id,
                   TORCHELASTIC_RUN_ID=self.lc.job_id)
        self.decoy_signals = tmp / "decoy-signals"
        self.decoy = subprocess.Popen([sys.executable, "-c", DECOY, str(self.decoy_signals)], env=env,
                                      start_new_session=True)
        wait_for(Path(f"{self.decoy_signals}.ready").exists, 30, "the decoy to start")
        try:
            self.rc = self.lc.wait(240)
            self.decoy_alive_at_end = self.decoy.poll() is None
            self.out = self.lc.output()
            self.events = read_events(tmp / "events.jsonl")
            self.incidents = self.lc.incidents()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.lc.kill()
        if self.decoy.poll() is None:
            self.decoy.kill()
        self.decoy.wait()


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlainRun]:
    run = PlainRun(tmp_path_factory.mktemp("plain"))
    yield run
    run.close()


@pytest.mark.slow
def test_unmodified_job_hang_is_recovered_with_level1_env(plain_run: PlainRun) -> None:
    """No in-job client: the job saves its own checkpoint every step; the watchdog never asks it for anything."""
    lc, events = plain_run.lc, plain_run.events
    assert plain_run.rc == 0, plain_run.out[-6000:]
    _assert_no_job_left(lc, exclude={plain_run.decoy.pid})
    (onset,) = [e for e in events if e["event"] == "hang_onset"]
    assert onset["rank"] == 2 and onset["step"] == 8
    first, second = _starts(events, "0"), _starts(events, "1")
    assert [e["rank"] for e in first] == [0, 1, 2, 3] and all(e["nccl_p2p_disable"] is None for e in first)
    assert [e["rank"] for e in second] == [0, 1, 2, 3], events
    for e in second:  # seen from inside the restarted job: the level-1 overlay and its own checkpoint
        assert (e["nccl_p2p_disable"], e["nccl_nvls_enable"]) == ("1", "0")
        assert e["step"] == 7  # resumed after the last step it saved itself
    assert sorted(e["rank"] for e in events if e["event"] == "done") == [0, 1, 2, 3]
    assert not _starts(events, "2")

    (inc,) = plain_run.incidents
    for key in CONTRACT_FIELDS:
        assert key in inc, key
    assert inc["job_id"] == lc.job_id and inc["kind"] == "stall"
    assert inc["culprit_ranks"] == [2] and inc["collective"] == "all_reduce"
    assert inc["onset"] <= inc["detected_at"] and 0 < inc["detected_at"] - onset["t"] < 20
    assert [a["action"] for a in inc["actions"]] == ["dump_stacks", "checkpoint", "stop", "restart"]
    assert all(isinstance(a["at"], float) and "detail" in a for a in inc["actions"])
    assert [(a["ok"], a["outcome"]) for a in inc["actions"]] == [(True, "ok"), (False, "skipped"), (True, "ok"),
                                                                  (True, "ok")]  # the job did not opt in
    assert inc["actions"][1]["detail"].startswith("skipped")
    assert inc["fallback"]["level"] == 1 and inc["fallback"]["env"] == LEVEL1_ENV
    stacks = sorted(p.name for p in Path(inc["stacks_dir"]).iterdir())
    assert stacks == ["rank-0.json", "rank-1.json", "rank-2.json", "rank-3.json"]
    # the time saved, against the job's own deadline: the job sets no group timeout (gloo's 30 min), which its
    # step heartbeats' client reports
    saved = inc["deadline"]
    assert (saved["source"], saved["timeout_s"], saved["unit"], saved["units"]) == ("client", 1800.0, "rank", 4)
    stop = next(a for a in inc["actions"] if a["action"] == "stop")
    assert abs(saved["due_at"] - (inc["onset"] + 1800.0)) < 1e-6 and saved["acted_at"] >= stop["at"]
    assert 1800.0 - 60.0 < saved["saved_s"] == pytest.approx(saved["due_at"] - saved["acted_at"], abs=0.1)
    assert saved["gpu_seconds"] == pytest.approx(4 * saved["saved_s"], abs=0.5)
    assert "time saved: stopped" in plain_run.out and "rank-hours on 4 rank(s)" in plain_run.out

    env = gw("env", "--job", lc.job_id, "--state-dir", str(lc.state)).stdout
    assert "export NCCL_P2P_DISABLE=1\n" in env and "export NCCL_NVLS_ENABLE=0\n" in env
    assert env.startswith(f"# gpu-watchdog fallback for job {lc.job_id}: level 1")

    report = gw("incidents", "show", inc["id"], "--state-dir", str(lc.state)).stdout
    lines = report.splitlines()
    assert lines[0].startswith(f"incident {inc['id']}")
    assert "culprit: rank 2" in lines[:4]
    groups = [ln for ln in lines if re.match(r"^  ranks? [\d,]+: ", ln)]
    assert groups[0].startswith("  rank 2: collective:recv") and groups[0].endswith("<- culprit"), report
    assert groups[1].startswith("  ranks 0,1,3: collective:all_reduce"), report
    listed = gw("incidents", "--state-dir", str(lc.state)).stdout
    assert inc["id"] in listed and "culprit=2" in listed and "collective=all_reduce" in listed


@pytest.mark.slow
def test_a_decoy_rank_outside_the_launched_tree_is_never_touched(plain_run: PlainRun) -> None:
    """Same job id and RANK as the culprit, idle, but not started by the launcher: never signalled, never a rank."""
    assert plain_run.rc == 0 and plain_run.decoy_alive_at_end
    assert not plain_run.decoy_signals.exists(), plain_run.decoy_signals.read_text()
    (inc,) = plain_run.incidents
    assert [a["action"] for a in inc["actions"]] == ["dump_stacks", "checkpoint", "stop", "restart"]  # recovered
    assert inc["ranks"] == [0, 1, 2, 3]
    dumped = {json.loads(p.read_text())["pid"] for p in Path(inc["stacks_dir"]).iterdir()}
    assert len(dumped) == 4 and plain_run.decoy.pid not in dumped
    # Only the details name pids; a bare substring test also hit the digits of a timestamp (CI: pid 370).
    decoy_pid = re.compile(rf"(?<![\d.]){plain_run.decoy.pid}(?![\d.])")
    assert not [a["detail"] for a in inc["actions"] if decoy_pid.search(a["detail"] or "")]


@pytest.mark.slow
def test_client_job_checkpoints_at_the_last_completed_step(tmp_path: Path, launch: Callable[..., Launched]) -> None:
    """--client: request → the hung ranks don't reach a boundary → abort → save at hang_at-1 → resume there.
    No config file: the whole recovery on the shipped defaults (interval 1 s, client_boundary_s 5 s, ...)."""
    lc = launch("client", demo_cmd(tmp_path, "--client", hang_rank=1), config=None)
    rc = lc.wait(240)
    out = lc.output()
    assert rc == 0, out[-6000:]
    _assert_no_job_left(lc)
    events = read_events(tmp_path / "events.jsonl")
    (inc,) = lc.incidents()
    assert inc["culprit_ranks"] == [1] and inc["collective"] == "all_reduce"
    assert [a["action"] for a in inc["actions"]] == ["dump_stacks", "checkpoint", "stop", "restart"]
    ckpt = inc["actions"][1]
    assert ckpt["ok"] is True
    acks = dict(re.findall(r"rank (\d+): aborted_saved at step (\d+)", ckpt["detail"]))
    assert sorted(acks) == ["0", "1", "2", "3"], ckpt["detail"]
    assert set(acks.values()) == {"7"}  # every rank acknowledged with the last completed step
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert saved == [7]  # the job saved once, on request
    second = _starts(events, "1")
    assert [e["rank"] for e in second] == [0, 1, 2, 3]
    assert {e["step"] for e in second} == {7}  # resumed exactly at the ack step == hang_at - 1
    assert all(e["nccl_p2p_disable"] == "1" for e in second)
    assert sorted(e["rank"] for e in events if e["event"] == "done") == [0, 1, 2, 3]
    assert {k: v for k, v in inc["fallback"].items() if k != "reason"} == {
        "level": 1, "name": "p2p-nvls-off", "env": LEVEL1_ENV}
    assert inc["fallback"]["reason"] == ("climbed: communication hang (culprit in collective); evidence: stacks: "
                                         "ranks 0,2,3 wait in all_reduce, rank 1 in recv")


@pytest.mark.slow
def test_job_that_always_hangs_spends_the_budget_and_exits_75(tmp_path: Path,
                                                            launch: Callable[..., Launched]) -> None:
    lc = launch("always", demo_cmd(tmp_path, "--client", "--hang-always", hang_at=3, steps=10, hang_rank=1))
    t0 = time.monotonic()
    rc = lc.wait(200)  # bounded: no infinite restart loop
    out = lc.output()
    assert rc == EXIT_BUDGET_SPENT == 75, out[-6000:]
    _assert_no_job_left(lc)
    incs = lc.incidents()
    # Shipped budget: max_no_progress_restarts = 2 → the first hang and one more are restarted, the third gives up.
    assert len(incs) == 3, [i["actions"] for i in incs]
    assert all(i["kind"] == "stall" and i["culprit_ranks"] == [1] for i in incs)
    for i in incs[:-1]:
        assert [a["action"] for a in i["actions"]][-1] == "restart"
    last = [a["action"] for a in incs[-1]["actions"]]
    assert last[-1] == "give_up" and "restart" not in last
    assert "restart budget spent" in incs[-1]["actions"][-1]["detail"]
    assert "without passing step 2" in incs[-1]["actions"][-1]["detail"]
    assert f"exit {EXIT_BUDGET_SPENT}" in out
    assert [i["fallback"]["level"] for i in incs[:-1]] == [1, 2]  # one ladder step per restart
    events = read_events(tmp_path / "events.jsonl")
    assert sorted({e["restart"] for e in events if e["event"] == "start"}) == ["0", "1", "2"]
    print(f"budget test: {time.monotonic() - t0:.1f}s")


@pytest.mark.slow
def test_readme_client_pattern_keeps_the_good_checkpoint_when_the_hang_comes_back_before_a_step(
        tmp_path: Path, launch: Callable[..., Launched]) -> None:
    """Issue 23: the README's pattern; the first run hangs at step 3 (saved: step 2), every later run hangs again
    before its first client.step(): the callback is not called (never with None), the step-2 checkpoint survives,
    each run resumes from it, and the job ends by the budget (75) — never TypeError, never exit 1."""
    ckpt, events_path = tmp_path / "ckpt.pt", tmp_path / "events.jsonl"
    job = torchrun(2, REPO / "tests" / "jobs" / "readme_client.py", "--ckpt", str(ckpt), "--events",
                   str(events_path), "--hang-at", "3")
    lc = launch("readme", job, config=FAST_CFG + "max_restarts = 2\nmax_no_progress_restarts = 2\n")
    rc = lc.wait(240)
    out = lc.output()
    assert rc == EXIT_BUDGET_SPENT, out[-6000:]
    assert "TypeError" not in out
    _assert_no_job_left(lc)
    events = read_events(events_path)
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2]  # saved once, by the first run
    starts = sorted(e["step"] for e in events if e["event"] == "start" and e["rank"] == 0)
    assert starts[0] == 0 and starts[1:] and set(starts[1:]) == {2}  # every later run resumed from step 2
    incs = lc.incidents()
    assert len(incs) == len(starts)
    ckpts = [next(a for a in i["actions"] if a["action"] == "checkpoint") for i in incs]
    assert ckpts[0]["outcome"] == "ok" and "rank 0: aborted_saved at step 2" in ckpts[0]["detail"]
    for a in ckpts[1:]:  # nothing completed in those runs: not saved, and said so
        assert a["ok"] is False and "skipped: no step completed in this run" in a["detail"], a
    import torch
    assert torch.load(ckpt, weights_only=True)["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("scenario, pause", [("save", 45), ("eval", 30)])
def test_a_long_rank0_pause_is_not_a_stall_on_shipped_defaults(tmp_path: Path, launch: Callable[..., Launched],
                                                              scenario: str, pause: int) -> None:
    """Rank 0 saves (I/O) or evaluates (CPU) while its peers wait in a barrier: no incident, no action, exit 0.
    No config at all: the shipped defaults (interval 1 s, detect.*, recovery.*)."""
    events_path = tmp_path / "events.jsonl"
    lc = launch(scenario, torchrun(4, TRAIN, "--scenario", scenario, "--pause-s", str(pause), "--steps", "5",
                                   "--step-at", "2", "--step-s", "0.2", "--events", str(events_path),
                                   "--workdir", str(tmp_path)), config=None)
    rc = lc.wait(pause + 120)
    out = lc.output()
    assert rc == 0, out[-6000:]
    _assert_no_job_left(lc)
    events = read_events(events_path)
    (began,) = [e for e in events if e["event"] == "hang_onset"]
    (ended,) = [e for e in events if e["event"] == "pause_end"]
    assert ended["t"] - began["t"] >= pause - 1  # the pause really happened, under the watchdog
    assert sorted(e["rank"] for e in events if e["event"] == "done") == [0, 1, 2, 3]
    assert lc.incidents() == []
    assert "STALL" not in out and "restarting" not in out and "checkpoint:" not in out
    assert not (lc.state / "jobs" / f"{lc.job_id}.json").exists()  # no fallback level recorded


@pytest.mark.slow
@pytest.mark.parametrize("signame, when", [("SIGINT", "running"), ("SIGTERM", "recovering")])
def test_a_signal_to_the_launcher_stops_the_job_and_exits_128_plus_signum(
        tmp_path: Path, launch: Callable[..., Launched], signame: str, when: str) -> None:
    signum = int(getattr(signal, signame))
    if when == "running":  # a healthy job, long enough to be interrupted
        cmd = demo_cmd(tmp_path, "--client", hang_at=0, steps=100_000)
    else:  # a signal while the launcher is busy recovering a hang: no next run may start
        cmd = demo_cmd(tmp_path, "--client", hang_at=3, steps=100_000)
    lc = launch(f"sig-{signame.lower()}", cmd)
    events_path = tmp_path / "events.jsonl"
    wait_for(lambda: len(_starts(read_events(events_path), "0")) == 4, 120, "all ranks to start", poll=0.2)
    ranks = {e["rank"]: e["pid"] for e in _starts(read_events(events_path), "0")}
    torchrun_pids = sorted({psutil.Process(pid).ppid() for pid in ranks.values()})
    assert len(torchrun_pids) == 1 and psutil.Process(torchrun_pids[0]).ppid() == lc.proc.pid
    if when == "running":
        wait_for(lambda: sum(e["event"] == "step" for e in read_events(events_path)) >= 8, 60, "some steps")
    else:
        wait_for(lambda: "STALL confirmed" in lc.output(), 60, "the stall to be confirmed", poll=0.1)
    lc.proc.send_signal(signum)
    rc = lc.wait(90)
    out = lc.output()
    assert rc == 128 + signum, out[-6000:]
    assert f"received {signame}" in out
    for pid in [*ranks.values(), *torchrun_pids]:  # no rank (nor torchrun) survives
        assert _gone(pid), pid
    _assert_no_job_left(lc)
    assert "still alive" not in out
    if when == "recovering":
        assert not _starts(read_events(events_path), "1"), "a new run started after the signal"
        (inc,) = lc.incidents()
        assert [a["action"] for a in inc["actions"]] == ["dump_stacks", "checkpoint", "stop", "restart"]
        assert inc["actions"][-1]["ok"] is False and inc["actions"][-1]["detail"].startswith(
            "skipped: the launcher received SIGTERM"), inc["actions"][-1]
    else:
        assert "stopped the job: " in out and ", 0 needed SIGKILL" in out


@pytest.mark.slow
def test_ranks_orphaned_by_a_killed_torchrun_are_stopped(tmp_path: Path, launch: Callable[..., Launched]) -> None:
    """torchrun SIGKILLed (OOM killer, an admin): its ranks are re-parented away from the launched tree; the
    launcher stops them too and exits 128+9 like a shell. 2 ranks: this is about process bookkeeping."""
    lc = launch("orphans", demo_cmd(tmp_path, nproc=2, hang_at=0, steps=100_000))
    events_path = tmp_path / "events.jsonl"
    wait_for(lambda: len(_starts(read_events(events_path), "0")) == 2, 120, "both ranks to start", poll=0.2)
    wait_for(lambda: sum(e["event"] == "step" for e in read_events(events_path)) >= 6, 60, "some steps")
    ranks = [e["pid"] for e in _starts(read_events(events_path), "0")]
    (torchrun_pid,) = {psutil.Process(pid).ppid() for pid in ranks}
    os.kill(torchrun_pid, signal.SIGKILL)
    rc = lc.wait(60)
    out = lc.output()
    assert rc == 128 + signal.SIGKILL, out[-4000:]
    assert "stopped 2 job process(es) left behind" in out
    for pid in ranks:
        assert _gone(pid), pid
    _assert_no_job_left(lc)
