"""ProcessScanner against real processes: identity from the environment, rank trees, scoping, zombies, races."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from gloo_jobs import TRAIN, RunningJob, _torchrun
from gpu_watchdog.model import JobIdentity, ProcessSample, validate_job_id
from gpu_watchdog.sample import processes as processes_mod
from gpu_watchdog.sample.processes import ProcessScanner, _is_launcher, identity_from_env
from waiting import wait_for

ID_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID",
           "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_ID", "GPU_WATCHDOG_JOB_ID")
SLEEP = "import time; time.sleep(120)"
# Burn ~0.5 s of CPU, then sleep: a dataloader worker that did some work.
BURN = "import time\ne = time.process_time() + 0.5\nwhile time.process_time() < e: pass\ntime.sleep(120)"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ID_KEYS}
    env.update(extra)
    return env


class Procs:
    """Starts processes in their own sessions and kills every one of them (and their children) at the end."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, code: str, **env: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-c", code], env=clean_env(**env), start_new_session=True)
        self.started.append(p)
        wait_for(lambda: _env_ready(p.pid, env), 15.0, f"pid {p.pid} to exec", poll=0.02)
        return p

    def start_argv(self, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, env=clean_env(**env), start_new_session=True)
        self.started.append(p)
        wait_for(lambda: _env_ready(p.pid, env), 15.0, f"pid {p.pid} to exec", poll=0.02)
        return p

    def kill(self, p: subprocess.Popen[bytes], reap: bool = True) -> None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if reap:
            p.wait()

    def close(self) -> None:
        for p in self.started:
            self.kill(p)


def _env_ready(pid: int, env: dict[str, str]) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.cmdline()[:1] == [sys.executable] and all(proc.environ().get(k) == v for k, v in env.items())
    except psutil.Error:
        return False


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def mine(samples: tuple[ProcessSample, ...], *ps: subprocess.Popen[bytes]) -> dict[int, ProcessSample]:
    pids = {p.pid for p in ps}
    return {s.pid: s for s in samples if s.pid in pids}


# -- identity from the environment --------------------------------------------------------------------
@pytest.mark.parametrize(("env", "ident"), [
    ({"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "te-1"},
     JobIdentity("te-1", 2, 2, 4)),
    ({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
      "SLURM_NTASKS": "8"}, JobIdentity("4242", 5, 1, 8)),  # an srun task
    ({"SLURM_JOB_ID": "4242", "TORCHELASTIC_RUN_ID": "te-1", "RANK": "3", "SLURM_PROCID": "0"},
     JobIdentity("4242", 3, None, None)),  # torchrun inside Slurm: the Slurm job id, torchrun's RANK
    ({"GPU_WATCHDOG_JOB_ID": "wd-7", "SLURM_JOB_ID": "4242", "TORCHELASTIC_RUN_ID": "te-1", "RANK": "1",
      "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, JobIdentity("wd-7", 1, 1, 2)),
    ({"RANK": "0"}, JobIdentity("unknown", 0)),
    ({"RANK": "0", "GPU_WATCHDOG_JOB_ID": ""}, JobIdentity("unknown", 0)),  # empty ids do not count
])
def test_identity_of_a_real_process(procs: Procs, env: dict[str, str], ident: JobIdentity) -> None:
    p = procs.start(SLEEP, **env)
    samples, errors = ProcessScanner(root_pid=os.getpid()).sample()
    got = mine(samples, p)
    assert got[p.pid].job == ident and got[p.pid].is_rank
    assert got[p.pid].create_time == psutil.Process(p.pid).create_time()
    # Just exec'd: still starting up (disk-sleep while it pages in its modules) or already in time.sleep.
    assert got[p.pid].cmdline[:2] == (sys.executable, "-c")
    assert got[p.pid].status in ("sleeping", "running", "disk-sleep"), got[p.pid].status
    assert got[p.pid].rss_bytes > 0 and errors == [], errors


def test_processes_without_identity_are_not_sampled(procs: Procs) -> None:
    p = procs.start(SLEEP)
    q = procs.start(SLEEP, GPU_WATCHDOG_JOB_ID="launcher-only")  # a job member that is no rank
    samples, _ = ProcessScanner(root_pid=os.getpid()).sample()
    assert mine(samples, p, q) == {}
    # ... unless someone else names them (NVML, a scheduler registration)
    samples, _ = ProcessScanner(root_pid=os.getpid()).sample(extra_pids=[p.pid, q.pid])
    got = mine(samples, p, q)
    assert got[p.pid].job is None and not got[p.pid].is_rank
    assert got[q.pid].job == JobIdentity("launcher-only") and not got[q.pid].is_rank


def test_identity_from_env_unit() -> None:
    assert identity_from_env({}) is None
    assert identity_from_env({"PATH": "/bin"}) is None
    assert identity_from_env({"RANK": "x"}) is None
    assert identity_from_env({"SLURM_PROCID": "3", "SLURM_STEP_ID": "0"}) == JobIdentity("unknown", 3)
    # A batch step's shell (and what it starts outside srun) has SLURM_PROCID=0 but no step: a job member only.
    assert identity_from_env({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0"}) == JobIdentity("9")
    assert identity_from_env({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "RANK": "2"}) == JobIdentity("9", 2)
    assert identity_from_env({"RANK": "1", "LOCAL_RANK": "z", "WORLD_SIZE": "4"}) == JobIdentity("unknown", 1,
                                                                                                None, 4)
    assert identity_from_env({"TORCHELASTIC_RUN_ID": "r"}) == JobIdentity("r")  # torchrun's own agent, no rank


# -- rank trees ---------------------------------------------------------------------------------------
RANK_WITH_WORKER = (
    "import subprocess, sys, time\n"
    f"subprocess.Popen([sys.executable, '-c', {BURN!r}])\n"
    "time.sleep(120)\n"
)
RANK_WITH_REAPED_WORKER = (
    "import subprocess, sys, time\n"
    f"subprocess.run([sys.executable, '-c', {BURN.replace('time.sleep(120)', '')!r}])\n"
    "time.sleep(120)\n"
)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def test_a_child_that_inherits_rank_is_not_a_rank_but_its_cpu_counts(procs: Procs) -> None:
    rank = procs.start(RANK_WITH_WORKER, RANK="0", WORLD_SIZE="1", GPU_WATCHDOG_JOB_ID="tree")
    wait_for(lambda: _children(rank.pid), 15.0, "the worker", poll=0.02)
    worker = _children(rank.pid)[0]
    wait_for(lambda: worker.cpu_times().user + worker.cpu_times().system >= 0.45, 15.0, "the worker to burn CPU",
             poll=0.02)
    assert worker.environ().get("RANK") == "0"  # inherited
    samples, _ = ProcessScanner(root_pid=os.getpid()).sample()
    assert worker.pid not in {s.pid for s in samples}
    s = mine(samples, rank)[rank.pid]
    own = psutil.Process(rank.pid).cpu_times()
    assert s.is_rank and s.job == JobIdentity("tree", 0, None, 1)
    assert s.cpu_time_s >= own.user + own.system + 0.45
    # NVML may name the worker (it holds a CUDA context): it is sampled then, but still not a rank.
    samples, _ = ProcessScanner(root_pid=os.getpid()).sample(extra_pids=[worker.pid])
    got = {x.pid: x for x in samples}
    assert not got[worker.pid].is_rank and got[rank.pid].is_rank


def test_cpu_of_reaped_children_still_counts(procs: Procs) -> None:
    rank = procs.start(RANK_WITH_REAPED_WORKER, RANK="0", GPU_WATCHDOG_JOB_ID="reaped")

    def reaped() -> bool:
        ct = psutil.Process(rank.pid).cpu_times()
        return ct.children_user + ct.children_system >= 0.45

    wait_for(reaped, 15.0, "the worker to be reaped", poll=0.02)
    samples, _ = ProcessScanner(root_pid=os.getpid()).sample()
    assert mine(samples, rank)[rank.pid].cpu_time_s >= 0.45


def test_root_pid_scoping_excludes_a_decoy(procs: Procs) -> None:
    job_root = procs.start(
        "import subprocess, sys, os, time\n"
        "for r in range(2):\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
        "                     env={**os.environ, 'RANK': str(r), 'WORLD_SIZE': '2', 'TORCHELASTIC_RUN_ID': 'in'})\n"
        "time.sleep(120)\n")
    decoy = procs.start(SLEEP, RANK="0", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="decoy")

    def two_ranks() -> bool:
        return len(_children(job_root.pid)) == 2 and all(
            _env_ready(c.pid, {"RANK": c.environ().get("RANK", "?")}) for c in _children(job_root.pid))

    wait_for(two_ranks, 15.0, "the job's ranks", poll=0.02)
    ranks = {c.pid for c in _children(job_root.pid)}
    samples, _ = ProcessScanner(root_pid=job_root.pid).sample()
    assert {s.pid for s in samples} == ranks
    assert sorted((s.job.job_id, s.job.rank) for s in samples if s.job) == [("in", 0), ("in", 1)]
    # The daemon (no root) sees both jobs.
    samples, _ = ProcessScanner().sample()
    seen = {s.pid: s for s in samples}
    assert ranks | {decoy.pid} <= set(seen)
    assert seen[decoy.pid].job == JobIdentity("decoy", 0, None, 2)


def test_samples_are_sorted_by_job_then_rank(procs: Procs) -> None:
    a = [procs.start(SLEEP, RANK=str(r), GPU_WATCHDOG_JOB_ID="b-job") for r in (1, 0)]
    b = procs.start(SLEEP, RANK="3", GPU_WATCHDOG_JOB_ID="a-job")
    samples, _ = ProcessScanner(root_pid=os.getpid()).sample()
    order = [(s.job.job_id, s.job.rank) for s in samples if s.pid in {p.pid for p in (*a, b)} and s.job]
    assert order == [("a-job", 3), ("b-job", 0), ("b-job", 1)]


# -- zombies and vanished processes -------------------------------------------------------------------
def test_a_zombie_child_of_a_rank(procs: Procs) -> None:
    rank = procs.start(
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os._exit(0)\n"
        "time.sleep(120)\n", RANK="0", GPU_WATCHDOG_JOB_ID="zombie-child")

    def has_zombie() -> bool:
        return any(c.status() == psutil.STATUS_ZOMBIE for c in _children(rank.pid))

    wait_for(has_zombie, 15.0, "an unreaped child", poll=0.02)
    samples, errors = ProcessScanner(root_pid=os.getpid()).sample()
    got = mine(samples, rank)
    assert got[rank.pid].is_rank and got[rank.pid].status != psutil.STATUS_ZOMBIE
    assert errors == []


def test_a_rank_that_becomes_a_zombie(procs: Procs) -> None:
    rank = procs.start(SLEEP, RANK="0", GPU_WATCHDOG_JOB_ID="zombie")
    scanner = ProcessScanner(root_pid=os.getpid())
    assert mine(scanner.sample()[0], rank)[rank.pid].status != psutil.STATUS_ZOMBIE
    procs.kill(rank, reap=False)  # exited, not reaped: a zombie until we wait()
    wait_for(lambda: psutil.Process(rank.pid).status() == psutil.STATUS_ZOMBIE, 15.0, "the zombie", poll=0.02)
    samples, errors = scanner.sample()
    got = mine(samples, rank)
    assert got[rank.pid].status == psutil.STATUS_ZOMBIE and got[rank.pid].job == JobIdentity("zombie", 0)
    assert errors == []
    # A fresh scanner never saw it alive: a zombie's environment is gone, so it is simply not a rank.
    assert mine(ProcessScanner(root_pid=os.getpid()).sample()[0], rank) == {}
    rank.wait()
    assert mine(scanner.sample()[0], rank) == {}


def test_a_vanished_rank_drops_out_and_from_the_cache(procs: Procs) -> None:
    r0 = procs.start(SLEEP, RANK="0", GPU_WATCHDOG_JOB_ID="gone")
    r1 = procs.start(SLEEP, RANK="1", GPU_WATCHDOG_JOB_ID="gone")
    scanner = ProcessScanner(root_pid=os.getpid())
    assert set(mine(scanner.sample()[0], r0, r1)) == {r0.pid, r1.pid}
    procs.kill(r1)
    samples, errors = scanner.sample()
    assert set(mine(samples, r0, r1)) == {r0.pid} and errors == []
    assert not scanner.remembers(r1.pid)


def test_a_rank_vanishing_in_the_middle_of_a_tick(procs: Procs, monkeypatch: pytest.MonkeyPatch) -> None:
    victims = [procs.start(SLEEP, RANK=str(r), GPU_WATCHDOG_JOB_ID="race") for r in range(2)]
    scanner = ProcessScanner(root_pid=os.getpid())
    known = scanner.sample()[0]  # both cached
    assert len(mine(known, *victims)) == 2
    fresh = procs.start(SLEEP, RANK="2", GPU_WATCHDOG_JOB_ID="race")  # not cached yet
    real_table = processes_mod.process_table

    def table_then_kill(**_: bool) -> dict[int, tuple[int, float]]:
        listed = real_table()
        procs.kill(victims[1])  # gone after the listing, before its stats are read
        procs.kill(fresh)  # gone before its environment is read
        return listed

    monkeypatch.setattr(processes_mod, "process_table", table_then_kill)
    samples, errors = scanner.sample()
    assert set(mine(samples, *victims, fresh)) == {victims[0].pid} and errors == []


# -- pid reuse ----------------------------------------------------------------------------------------
def test_pid_reuse_is_caught_by_the_start_time(procs: Procs) -> None:
    p = procs.start(SLEEP, RANK="1", GPU_WATCHDOG_JOB_ID="new-job")
    scanner = ProcessScanner(root_pid=os.getpid())
    scanner.sample()
    cached = scanner._known[p.pid]
    assert cached is not None
    # Pretend the cache entry belongs to an older process that had this pid (another job, another rank):
    # its psutil handle, create time and start token are the old process's.
    old = psutil.Process(os.getpid())  # any other live process: its handle reports its own create time
    scanner._known[p.pid] = replace(cached, proc=old, create_time=old.create_time(), start=cached.start - 100,
                                    identity=JobIdentity("old-job", 7), cmdline=("old",))
    s = mine(scanner.sample()[0], p)[p.pid]
    assert s.job == JobIdentity("new-job", 1) and s.create_time == psutil.Process(p.pid).create_time()
    assert s.cmdline[:2] == (sys.executable, "-c")


def test_a_process_table_handed_over_serves_one_scan_of_the_same_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's registry reads the table just before the tick's scan and hands it over: the scan takes it once;
    the next scan, or one after half a second, reads /proc again."""
    handed = processes_mod.process_table(hand_over=True)
    assert processes_mod.process_table(take_handed_over=True) is handed
    assert processes_mod.process_table(take_handed_over=True) is not handed  # taken once only
    assert processes_mod.process_table() is not processes_mod.process_table()  # without either: always a read
    handed = processes_mod.process_table(hand_over=True)
    monkeypatch.setattr(processes_mod, "_HANDED_OVER_FOR_S", -1.0)  # already older than its time
    assert processes_mod.process_table(take_handed_over=True) is not handed  # a stale one: another tick's


def testprocess_table_matches_psutil() -> None:
    table = processes_mod.process_table()
    me = psutil.Process()
    assert table[os.getpid()][0] == me.ppid()
    assert os.getpid() in table and len(table) >= len(psutil.pids()) // 2
    again = processes_mod.process_table()
    assert again[os.getpid()][1] == table[os.getpid()][1]  # the start token is stable for a live process
    with subprocess.Popen([sys.executable, "-c", SLEEP]) as child:
        try:
            wait_for(lambda: child.pid in processes_mod.process_table(), 15.0, "the child in /proc", poll=0.02)
            assert processes_mod.process_table()[child.pid][0] == os.getpid()
        finally:
            child.kill()


def test_env_filter_keeps_selected_variables(procs: Procs) -> None:
    p = procs.start(SLEEP, RANK="0", GPU_WATCHDOG_JOB_ID="envs", NCCL_P2P_DISABLE="1", NCCL_PROTO="Simple")
    scanner = ProcessScanner(root_pid=os.getpid(), env_filter=("NCCL_",))
    scanner.sample()
    env = scanner.env_of(p.pid)
    assert env.get("NCCL_P2P_DISABLE") == "1" and env.get("NCCL_PROTO") == "Simple"
    assert all(k.startswith("NCCL_") for k in env)
    assert scanner.env_of(999_999_999) == {}


def test_a_process_that_execs_into_a_rank_is_found(procs: Procs) -> None:
    """torchrun's workers and wrapper scripts start without RANK and exec the real program with it: the scanner
    must look again at a young process it first saw without an identity."""
    wrapper = ("import os, sys, time; time.sleep(1.5); "
               "os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'], "
               "{**os.environ, 'RANK': '0', 'GPU_WATCHDOG_JOB_ID': 'exec-job'})")
    p = procs.start(wrapper)
    scanner = ProcessScanner()
    first, _ = scanner.sample()
    assert p.pid not in mine(first, p)  # no identity yet
    wait_for(lambda: _env_ready(p.pid, {"RANK": "0"}), 15.0, "the wrapper to exec", poll=0.02)
    later, _ = scanner.sample()
    s = mine(later, p)[p.pid]
    assert s.is_rank and s.job == JobIdentity("exec-job", 0)


@pytest.mark.parametrize(("launcher_env", "worker"), [
    # Under `launch` torchrun's environment holds GPU_WATCHDOG_JOB_ID: the fork has the job id, no RANK.
    ({"GPU_WATCHDOG_JOB_ID": "fork-job"}, JobIdentity("fork-job", 3)),
    # torchrun under Slurm: the fork carries torchrun's own identity (the srun task's SLURM_PROCID).
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, JobIdentity("77", 3)),
])
def test_a_worker_caught_before_it_execs_is_read_again(procs: Procs, launcher_env: dict[str, str],
                                                       worker: JobIdentity) -> None:
    """A torchrun-like parent forks a worker that execs with RANK=3 a little later. Caught between fork and
    exec, the worker shows its parent's environment. Seen in CI under `launch`: such a rank stayed invisible
    for the whole run (stacks undumped, its GPU left out of the incident) because a process that had any
    identity was never read again."""
    launcher = ("import os, sys, time\n"
                "if os.fork() == 0:\n"
                "    time.sleep(1.5)\n"
                "    os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'],\n"
                "              {**os.environ, 'RANK': '3'})\n"
                "time.sleep(60)\n")
    parent = procs.start(launcher, **launcher_env)
    child = wait_for(lambda: psutil.Process(parent.pid).children(), 15.0, "the fork")[0]
    scanner = ProcessScanner()
    first, _ = scanner.sample()
    assert child.pid not in {s.pid for s in first}  # its parent's identity: not a rank of its own yet
    wait_for(lambda: _env_ready(child.pid, {"RANK": "3"}), 15.0, "the fork to exec", poll=0.02)
    later, _ = scanner.sample()
    s = {s.pid: s for s in later}[child.pid]
    assert s.is_rank and s.job == worker


# A Slurm-like tree: `parent` starts `n` children (each with the env given) and sleeps; children sleep.
_SPAWN = ("import os, subprocess, sys, time, json\n"
          "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], env={**os.environ, **e})\n"
          "        for e in json.loads(sys.argv[1])]\n"
          "time.sleep(120)\n")


def _spawn_tree(procs: Procs, child_envs: list[dict[str, str]], **env: str) -> list[int]:
    """A parent with ``env`` whose children get ``child_envs``; returns [parent, *children] once all exec'd."""
    import json

    p = subprocess.Popen([sys.executable, "-c", _SPAWN, json.dumps(child_envs)], env=clean_env(**env),
                         start_new_session=True)
    procs.started.append(p)
    kids = wait_for(lambda: (lambda c: c if len(c) == len(child_envs) and all(
        _env_ready(k.pid, e) for k, e in zip(sorted(c, key=lambda k: k.pid), child_envs, strict=False)) else None)(
        psutil.Process(p.pid).children()), 15.0, "the children to exec", poll=0.05)
    return [p.pid, *sorted(k.pid for k in kids)]


def _ranks(samples: tuple[ProcessSample, ...], pids: list[int]) -> dict[int, int | None]:
    return {s.pid: s.job.rank for s in samples if s.pid in pids and s.is_rank and s.job is not None}


def _duplicates_among(samples: tuple[ProcessSample, ...], errors: list, pids: list[int]) -> list:
    """DuplicateRank errors of the jobs these processes belong to: the scan sees the whole machine, where another
    job's processes (another test's, a leftover) may claim a rank twice."""
    ids = {s.job.job_id for s in samples if s.pid in pids and s.job is not None}
    ours = {str(p) for p in pids}

    def claimants(where: str) -> set[str]:
        return set(re.findall(r"\d+", where.partition("claimed by pids ")[2].partition("(")[0]))

    return [e for e in errors if e.error_class == "DuplicateRank"
            and (any(f"job {i} " in e.where for i in ids) or claimants(e.where) & ours)]


def test_sbatch_torchrun_batch_shell_and_agent_are_no_ranks(procs: Procs) -> None:
    """sbatch + torchrun: the batch shell (and torchrun's agent) carry SLURM_PROCID=0 without a step; only the
    workers (RANK) are ranks. Seen on Slurm 22.05: ranks [0, 0, 1, 2] and the job read as 'waiting on rank 0'
    until waiting_timeout_s (600 s)."""
    batch = {"SLURM_JOB_ID": "501", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}
    workers = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": "none"}
               for r in range(3)]
    pids = _spawn_tree(procs, workers, **batch)
    samples, errors = ProcessScanner().sample()
    assert _ranks(samples, pids) == dict(zip(pids[1:], [0, 1, 2], strict=True)), samples
    assert not _duplicates_among(samples, errors, pids)


def test_srun_torchrun_agent_is_no_rank(procs: Procs) -> None:
    """`srun torchrun ...`: the srun task (torchrun's agent) has SLURM_PROCID=0 in a step; its workers' RANK
    wins and the agent is a launcher, not a second rank 0."""
    task = {"SLURM_JOB_ID": "502", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    workers = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"} for r in range(2)]
    pids = _spawn_tree(procs, workers, **task)
    samples, _ = ProcessScanner().sample()
    assert _ranks(samples, pids) == dict(zip(pids[1:], [0, 1], strict=True))


def test_an_srun_task_running_torchrun_is_a_launcher_before_its_workers_start(procs: Procs, tmp_path: Path) -> None:
    """srun task 1 on node 2 runs torchrun: until its workers start it must not count as rank 1 (the phantom rank
    1 that made every later stall on that node "rank 1 is missing")."""
    task = {"SLURM_JOB_ID": "504", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    fake = tmp_path / "torchrun"  # a console script named torchrun, run by its interpreter, not yet started workers
    fake.write_text("import time\ntime.sleep(120)\n")
    agent = procs.start_argv([sys.executable, str(fake)], **task)
    samples, _ = ProcessScanner().sample()
    assert _ranks(samples, [agent.pid]) == {}, samples
    plain = procs.start(SLEEP, **task)  # an srun task running the training script itself is a rank
    samples, _ = ProcessScanner().sample()
    assert _ranks(samples, [plain.pid]) == {plain.pid: 1}, samples


@pytest.mark.parametrize(("argv", "launcher"), [
    (["/v/bin/torchrun", "--nproc-per-node", "2", "t.py"], True),
    (["/usr/bin/python3", "-m", "torch.distributed.run", "t.py"], True),
    (["python3.11", "/v/bin/torchrun", "t.py"], True),
    (["/v/bin/accelerate", "launch", "t.py"], True),
    (["deepspeed", "t.py"], True),
    (["python3", "train.py"], False),
    (["python3", "-m", "mypkg.train"], False),
    (["bash", "run.sh"], False),
])
def test_launchers_are_known_by_their_command_line(argv: list[str], launcher: bool) -> None:
    class Fake:
        def cmdline(self) -> list[str]:
            return argv

    assert _is_launcher(Fake()) is launcher  # type: ignore[arg-type]


def test_srun_python_tasks_are_ranks_and_the_batch_shell_is_not(procs: Procs) -> None:
    """`srun python train.py` from a batch script: slurmstepd's tasks (SLURM_PROCID in a step) are the ranks;
    the batch shell and srun (SLURM_PROCID=0, no step) are not, though they are not the tasks' ancestors."""
    job = {"SLURM_JOB_ID": "503", "SLURM_NTASKS": "3"}
    shell = procs.start(SLEEP, SLURM_PROCID="0", **job)
    tasks = _spawn_tree(procs, [{"SLURM_STEP_ID": "0", "SLURM_PROCID": str(r), **job} for r in range(3)])
    samples, errors = ProcessScanner().sample()
    assert _ranks(samples, [shell.pid, *tasks]) == dict(zip(tasks[1:], [0, 1, 2], strict=True))
    assert not _duplicates_among(samples, errors, [shell.pid, *tasks])


class _ScriptedScanner:
    """Hands ProcBackend one rank whose cumulative CPU time the test sets before each tick."""

    def __init__(self) -> None:
        self.cpu_time_s = 0.0

    def sample(self, extra_pids: object = ()) -> tuple[tuple[ProcessSample, ...], list[object]]:
        rank = ProcessSample(4242, 1000.0, 1, "sleeping", self.cpu_time_s, 0, 64 << 20,
                             job=JobIdentity("j", rank=0), is_rank=True)
        return (rank,), []


def test_proc_backend_rates_need_a_minimum_window() -> None:
    """One 10 ms CPU clock tick over the 40 ms between a tick and the early one after a stack dump would
    read as 25 % busy and restart a stall's streak (seen in the latency runs): a window shorter than
    min_window_s keeps the previous value and baseline, so the next full window measures the real rate."""
    from gpu_watchdog.sample.backends import ProcBackend

    now = [100.0]
    scanner = _ScriptedScanner()
    backend = ProcBackend(scanner, "host", clock=lambda: now[0], monotonic=lambda: now[0],  # type: ignore[arg-type]
                          min_window_s=0.5)

    def tick(at: float, cpu: float) -> float | None:
        now[0], scanner.cpu_time_s = at, cpu
        (dev,) = backend.sample().devices
        return dev.util_percent

    assert tick(100.0, 5.0) is None  # nothing to compare with yet
    assert tick(101.0, 5.0) == 0.0  # a hung rank: idle
    assert tick(101.04, 5.01) == 0.0  # early tick: one clock tick, not 25 %
    assert tick(102.0, 5.01) == pytest.approx(1.0)  # measured from 101.0: 10 ms over 1 s
    assert tick(103.0, 5.51) == pytest.approx(50.0)
    short = ProcBackend(scanner, "host", clock=lambda: now[0], monotonic=lambda: now[0],  # type: ignore[arg-type]
                        min_window_s=0.0)
    now[0], scanner.cpu_time_s = 103.0, 5.51
    short.sample()
    now[0], scanner.cpu_time_s = 103.04, 5.52
    (dev,) = short.sample().devices
    assert dev.util_percent == pytest.approx(25.0)  # what the unguarded rate said


# -- job identity without a run id (torchrun's `none`) and duplicate ranks ----------------------------
def test_identity_without_a_torchrun_run_id() -> None:
    """torchrun without --rdzv-id gives every job TORCHELASTIC_RUN_ID=none: no job id. Its rendezvous endpoint
    (MASTER_ADDR:MASTER_PORT, shared by every node of the job) names the job instead."""
    from gpu_watchdog.model import JOB_ID_RE

    ep = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    for none in ("none", "None", "NONE", ""):
        assert identity_from_env({"RANK": "1", "TORCHELASTIC_RUN_ID": none, **ep}) == JobIdentity(
            "torchrun-10.1.2.3:29500", 1, 1, 4), none
    # A real run id, a Slurm job id, the launcher's id: as before, whatever the endpoint.
    for extra, want in (({"TORCHELASTIC_RUN_ID": "te-9"}, "te-9"),
                        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}, "77"),
                        ({"TORCHELASTIC_RUN_ID": "none", "GPU_WATCHDOG_JOB_ID": "wd"}, "wd")):
        assert identity_from_env({"RANK": "1", **extra, **ep}) == JobIdentity(want, 1, 1, 4), extra
    # Not from torchrun: no endpoint-derived id (unchanged: "unknown"; duplicate ranks are split by launcher).
    assert identity_from_env({"RANK": "1", **ep}) == JobIdentity("unknown", 1, 1, 4)
    # torchrun's agent or a helper without a rank: `none` makes it no job member.
    assert identity_from_env({"TORCHELASTIC_RUN_ID": "none", **ep}) is None
    # No usable endpoint (--master-port 0 leaves MASTER_PORT=0): the scanner names the job after its agent.
    for bad in ({}, {"MASTER_ADDR": "127.0.0.1"}, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"},
                {"MASTER_ADDR": "", "MASTER_PORT": "29500"}, {"MASTER_ADDR": "h", "MASTER_PORT": "x"},
                {"MASTER_ADDR": "h", "MASTER_PORT": "70000"}):
        assert identity_from_env({"RANK": "0", "TORCHELASTIC_RUN_ID": "none", **bad}) == JobIdentity("unknown", 0)
    # IPv6 and odd host names still make valid job ids (no '/', no '..', at most 128 characters).
    cases: list[tuple[str, str | None]] = [
        ("::1", "torchrun-::1:29500"), ("[fd00::1]", "torchrun-fd00::1:29500"),
        ("fe80::1%eth0", "torchrun-fe80::1_eth0:29500"), ("node-3.cluster", "torchrun-node-3.cluster:29500"),
        ("a/../b", "torchrun-a_.__b:29500"), ("h" * 200, None)]
    for addr, expect in cases:
        got = identity_from_env({"RANK": "0", "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": addr,
                                 "MASTER_PORT": "29500"})
        assert got is not None and JOB_ID_RE.fullmatch(got.job_id) and validate_job_id(got.job_id), (addr, got)
        assert expect is None or got.job_id == expect, (addr, got)
    long1, long2 = (identity_from_env({"RANK": "0", "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": h * 200,
                                       "MASTER_PORT": "29500"}) for h in "hk")
    assert long1 and long2 and long1.job_id != long2.job_id and long1.job_id.endswith(":29500")


def _launcher(ranks: dict[int, dict[str, str]]) -> str:
    """A process that starts one child per rank with these extra environment variables, then sleeps."""
    return ("import os, subprocess, sys, time\n"
            f"for env in {list(ranks.values())!r}:\n"
            "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], env={**os.environ, **env})\n"
            "time.sleep(120)\n")


def _ranks_of(parent: int, n: int) -> list[psutil.Process]:
    def ready() -> list[psutil.Process] | None:
        kids = _children(parent)
        return kids if len(kids) == n and all(_env_ready(c.pid, {"RANK": c.environ().get("RANK", "?")})
                                              for c in kids) else None

    return wait_for(ready, 15.0, f"{n} ranks under pid {parent}", poll=0.02)


def _start_token(pid: int) -> int:
    return int(processes_mod.process_table()[pid][1])


def test_a_torchrun_rank_without_run_id_or_endpoint_is_named_after_its_agent(procs: Procs) -> None:
    """TORCHELASTIC_RUN_ID=none and no usable MASTER_ADDR/PORT: the agent (the ranks' parent) names the job, so
    two such jobs stay two; the name survives the agent's exit (the ranks are reparented)."""
    env = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    agents = [procs.start(_launcher({r: {**env, "RANK": str(r)} for r in range(2)})) for _ in range(2)]
    ranks = {a.pid: _ranks_of(a.pid, 2) for a in agents}
    scanner = ProcessScanner()
    samples, errors = scanner.sample()
    by_pid = {s.pid: s for s in samples}
    want = {a.pid: f"torchrun-pid{a.pid}-{_start_token(a.pid)}" for a in agents}
    for agent, kids in ranks.items():
        got = sorted((by_pid[k.pid].job.job_id, by_pid[k.pid].job.rank) for k in kids)  # type: ignore[union-attr]
        assert got == [(want[agent], 0), (want[agent], 1)]
        assert all(by_pid[k.pid].is_rank for k in kids)
    assert not [e for e in errors if e.error_class == "DuplicateRank" and any(w in e.where for w in want.values())]
    first = agents[0]
    os.kill(first.pid, signal.SIGKILL)  # the agent dies; its ranks live on (reparented)
    first.wait()
    wait_for(lambda: all(psutil.Process(k.pid).ppid() != first.pid for k in ranks[first.pid]), 15.0, "reparenting",
             poll=0.02)
    by_pid = {s.pid: s for s in scanner.sample()[0]}
    assert {by_pid[k.pid].job.job_id for k in ranks[first.pid]} == {want[first.pid]}  # type: ignore[union-attr]


def test_two_processes_claiming_one_rank_are_two_jobs(procs: Procs, caplog: pytest.LogCaptureFixture) -> None:
    """Two launchers start ranks of the same job id: rank 0 is claimed twice. They are never merged into one
    job: the daemon-wide scanner splits the job by launcher (JOB@LAUNCHER_PID, stable tick after tick and after
    the other claimant ends) and reports DuplicateRank every tick (logged once)."""
    job = f"dup-{os.getpid()}"
    env = {"GPU_WATCHDOG_JOB_ID": job, "WORLD_SIZE": "2"}
    a = procs.start(_launcher({r: {**env, "RANK": str(r)} for r in range(2)}))
    b = procs.start(_launcher({0: {**env, "RANK": "0"}}))
    ranks_a, (rank_b,) = _ranks_of(a.pid, 2), _ranks_of(b.pid, 1)
    rank_a0 = next(k for k in ranks_a if k.environ()["RANK"] == "0")
    scanner = ProcessScanner()
    with caplog.at_level("WARNING", logger="gpu_watchdog.sample.processes"):
        for _ in range(3):
            samples, errors = scanner.sample()
            got = sorted((s.job.job_id, s.job.rank) for s in samples if s.job and s.job.job_id.startswith(job))
            assert got == [(f"{job}@{a.pid}", 0), (f"{job}@{a.pid}", 1), (f"{job}@{b.pid}", 0)]
            dups = [e for e in errors if e.error_class == "DuplicateRank" and job in e.where]
            lo, hi = sorted((rank_a0.pid, rank_b.pid))
            la, lb = sorted((a.pid, b.pid))
            assert [e.where for e in dups] == [
                f"job {job} rank 0 claimed by pids {lo}, {hi} (launchers {la}, {lb}): watched as separate jobs"]
    assert [r.getMessage() for r in caplog.records if job in r.getMessage()] == [dups[0].where]
    for s in samples:
        if s.job and s.job.job_id.startswith(job):
            assert validate_job_id(s.job.job_id)
    # The other claimant ends: the split job keeps its id, and nothing is reported any more.
    procs.kill(b)
    wait_for(lambda: not psutil.pid_exists(rank_b.pid), 15.0, "the orphaned rank to be reaped", poll=0.02)
    samples, errors = scanner.sample()
    got = sorted((s.job.job_id, s.job.rank) for s in samples if s.job and s.job.job_id.startswith(job))
    assert got == [(f"{job}@{a.pid}", 0), (f"{job}@{a.pid}", 1)]
    assert not [e for e in errors if e.error_class == "DuplicateRank" and job in e.where]
    # A fresh scanner that never saw the duplicate: the job is just the job.
    samples, _ = ProcessScanner().sample()
    assert sorted((s.job.job_id, s.job.rank) for s in samples if s.job and s.job.job_id.startswith(job)) == [
        (job, 0), (job, 1)]


def test_a_duplicate_rank_under_one_launched_root_is_reported_not_split(procs: Procs) -> None:
    """Under `launch` (a root pid) everything below the root is the launched job: a duplicate is reported, the
    ranks keep the job's id (the launcher follows that id)."""
    job = f"dup-root-{os.getpid()}"
    env = {"GPU_WATCHDOG_JOB_ID": job, "RANK": "0"}
    a, b = procs.start(_launcher({0: env})), procs.start(_launcher({0: env}))
    (ra,), (rb,) = _ranks_of(a.pid, 1), _ranks_of(b.pid, 1)
    samples, errors = ProcessScanner(root_pid=os.getpid()).sample()
    assert {s.pid: s.job.job_id for s in samples if s.job and s.job.job_id.startswith(job)} == {ra.pid: job,
                                                                                                rb.pid: job}
    dups = [e.where for e in errors if e.error_class == "DuplicateRank" and job in e.where]
    assert len(dups) == 1 and dups[0].endswith("one launched job, not split"), dups


# -- two real torchrun jobs without --rdzv-id on one node ---------------------------------------------
def _start_unnamed_torchrun(tmp_path: Path) -> RunningJob:
    """``torchrun --rdzv-backend c10d --rdzv-endpoint localhost:0`` without ``--rdzv-id``: what ``--standalone``
    does (a free rendezvous port per job) but with torchrun's default run id ``none`` (``--standalone`` itself
    draws a uuid). 2 ranks of tests/jobs/train.py, healthy, running until stopped (or 60 s)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    events, log = tmp_path / "events.jsonl", tmp_path / "job.log"
    argv = [_torchrun(), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            "localhost:0", str(TRAIN), "--scenario", "healthy", "--steps", "100000", "--step-s", "0.02",
            "--events", str(events), "--workdir", str(tmp_path)]
    timeout_bin = shutil.which("timeout")
    if timeout_bin:
        argv = [timeout_bin, "-s", "KILL", "60", *argv]
    env = {**clean_env(), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=tmp_path, start_new_session=True)
    return RunningJob(proc, 2, events, log, tmp_path)


@pytest.mark.slow
def test_two_torchrun_jobs_without_run_id_are_two_jobs(tmp_path: Path) -> None:
    """The issue: every torchrun job without --rdzv-id says TORCHELASTIC_RUN_ID=none, and the daemon merged
    them into one job "none" (ranks [0,0,1,1]). Each is its own job, named after its rendezvous endpoint."""
    jobs = [_start_unnamed_torchrun(tmp_path / f"job{i}") for i in range(2)]
    try:
        pids = [j.wait_ranks(45.0) for j in jobs]
        samples, errors = ProcessScanner().sample()  # the daemon's view: every process on the node
        by_pid = {s.pid: s for s in samples}
        ids = []
        for ranks in pids:
            envs = {r: psutil.Process(pid).environ() for r, pid in ranks.items()}
            assert {e["TORCHELASTIC_RUN_ID"] for e in envs.values()} == {"none"}
            (port,) = {e["MASTER_PORT"] for e in envs.values()}
            got = {by_pid[pid].job.job_id for pid in ranks.values()}  # type: ignore[union-attr]
            assert len(got) == 1, got
            (job_id,) = got
            assert job_id == processes_mod.endpoint_job_id(envs[0]) and job_id.endswith(f":{port}"), (job_id, port)
            assert sorted(s.job.rank or 0 for s in samples if s.is_rank and s.job and s.job.job_id == job_id) == [0, 1]
            ids.append(job_id)
        assert ids[0] != ids[1]
        assert not [e for e in errors if e.error_class == "DuplicateRank" and any(i in e.where for i in ids)]
    finally:
        for j in jobs:
            j.stop()


def test_a_rank_that_starts_workers_with_other_ranks_stays_a_rank(procs: Procs) -> None:
    """Healthy counterpart of the launcher rule: a torchrun rank (RANK) whose children claim other ranks of its
    job (a framework's own worker processes) is still a rank; only an srun task's SLURM_PROCID yields."""
    rank = {"TORCHELASTIC_RUN_ID": "te-9", "RANK": "0", "WORLD_SIZE": "1"}
    pids = _spawn_tree(procs, [{"RANK": "5"}], **rank)
    samples, _ = ProcessScanner().sample()
    assert _ranks(samples, pids) == {pids[0]: 0, pids[1]: 5}


def test_read_task_state_of_real_threads(tmp_path: Path) -> None:
    """The scheduler state letter of a thread, read from /proc even when the command name holds ') ('."""
    from gpu_watchdog.sample.processes import read_task_state

    assert read_task_state(os.getpid(), threading.get_native_id()) == "R"  # this thread, reading its own stat
    odd = tmp_path / "odd) (name"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", odd)
    child = subprocess.Popen([str(odd), "30"])
    try:
        deadline = time.monotonic() + 10
        while read_task_state(child.pid, child.pid) != "S" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_task_state(child.pid, child.pid) == "S"
    finally:
        child.kill()
        child.wait()
    assert read_task_state(child.pid, child.pid) == ""  # gone: unreadable, no exception


def test_an_srun_task_that_execs_torchrun_is_no_rank_once_it_has(procs: Procs, tmp_path: Path) -> None:
    """``srun bash -c '… exec torchrun …'`` (the 2-node Slurm test's own job; a Python wrapper here): first seen as the
    wrapper, the task
    is provisionally rank 1; once it has exec'd torchrun it is its agent — before any worker exists — and no
    longer a rank (it was kept as rank 1 and compared with the other node's workers: a false config_mismatch)."""
    task = {"SLURM_JOB_ID": "505", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    fake = tmp_path / "torchrun"
    fake.write_text("import time\ntime.sleep(120)\n")
    go = tmp_path / "go"
    wrapper = procs.start(f"import os, sys, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
                          f"os.execv(sys.executable, [sys.executable, {str(fake)!r}])", **task)
    scanner = ProcessScanner()
    wait_for(lambda: _ranks(scanner.sample()[0], [wrapper.pid]) == {wrapper.pid: 1}, 10, "the wrapper as a task")
    go.touch()
    wait_for(lambda: psutil.Process(wrapper.pid).cmdline()[1:] == [str(fake)], 10, "the exec")
    assert _ranks(scanner.sample()[0], [wrapper.pid]) == {}


def test_an_srun_task_whose_child_is_torchrun_is_no_rank_before_the_workers_start(procs: Procs,
                                                                                 tmp_path: Path) -> None:
    """``srun bash -c 'torchrun …'`` without exec: the shell stays torchrun's parent; with the agent below it the
    shell is a launcher too, while the agent is still in its rendezvous (no worker yet)."""
    task = {"SLURM_JOB_ID": "506", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    fake = tmp_path / "torchrun"
    fake.write_text("import time\ntime.sleep(120)\n")
    shell = procs.start(f"import subprocess, sys\nsubprocess.run([sys.executable, {str(fake)!r}])", **task)
    # The agent as it runs, not the shell's copy in the instant between fork and exec (that copy is the shell)
    wait_for(lambda: any(str(fake) in c.cmdline() for c in psutil.Process(shell.pid).children()), 10,
             "torchrun's agent")
    scanner = ProcessScanner()
    samples, _ = scanner.sample()
    assert [s for s in samples if s.is_rank and s.job is not None and s.job.job_id == "506"] == []
    assert _ranks(samples, [shell.pid, *[c.pid for c in psutil.Process(shell.pid).children()]]) == {}


def test_a_process_whose_environment_reads_as_gone_is_not_looked_up_every_tick(procs: Procs,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel threads on some kernels (this CI box's) answer /proc/PID/environ with "no such process" while the process
    table lists them: one lookup, then never again while the same process is there (each lookup built a
    psutil.Process: most of the daemon's steady-state CPU, 11.7 → 2.9 ms per tick with a 4-rank job here)."""
    p = procs.start(SLEEP, GPU_WATCHDOG_JOB_ID="gone-env", RANK="0")
    real_environ = psutil.Process.environ
    built: list[int] = []
    real_init = psutil.Process.__init__

    def environ(self: psutil.Process) -> dict[str, str]:
        if self.pid == p.pid:
            raise psutil.NoSuchProcess(self.pid)
        return real_environ(self)

    def init(self: psutil.Process, pid: int | None = None) -> None:
        built.append(pid if pid is not None else os.getpid())
        real_init(self, pid)

    monkeypatch.setattr(psutil.Process, "environ", environ)
    monkeypatch.setattr(psutil.Process, "__init__", init)
    scanner = ProcessScanner()
    for _ in range(3):
        samples, _ = scanner.sample()
        assert p.pid not in {s.pid for s in samples}
    assert built.count(p.pid) == 1
