"""What a hung NCCL job looks like on a GPU, brought to CI: the agent's real NVML and RAS code watching a CPU job whose
ranks behave on the host like NCCL ranks.

Every earlier rule was proven on gloo, where a waiting rank sleeps. Here (shared/real-gpu, RESEARCH section 6):

* the job (tests/jobs/nccl_like.py, gloo DDP) completes every collective the NCCL way: launched async, and the host
  *spins* in a device sync at the ``loss.item()`` line (a C busy loop: ~1 core, 0 voluntary wakeups) plus a proxy
  thread that polls while an operation is pending — py-spy sees the waiting ranks "active" in user code, with no
  torch.distributed frame;
* the NVML stand-in plays what the H200 showed (tests/support/gpu_play.py): 100 % utilization, memory controller 0 %,
  17 % power and ~117 MiB/s of PCIe polling with 2^32 counter wraps while a rank waits in a collective that does not
  complete — whether the job is hung or a peer is saving a checkpoint; training shows busy GPUs, a big all-reduce
  swings utilization at low power with GiB/s of traffic;
* ``ras.enabled = "on"`` points the agent at a RAS stand-in whose counts follow the job (ras_standin.RasStandIn(
  source=...) over nccl_like_state.ras_report): collectives counted when launched, so the rank that never launched
  is behind; a transport hang shows equal, frozen counts; a stopped rank is an unresponsive missing rank.

The hangs (``gpu-watchdog launch --backend nvml``): the stall is confirmed at most 10 s after the job's own
``hang_onset`` with the right culprit and the right recovery, and the restarted run finishes:

============  ====================================================  ===========================================
scenario      the job                                               expected
============  ====================================================  ===========================================
own_code      rank 1 blocks in ``Event().wait()`` before its        culprit 1, plain restart (no NCCL change)
              backward; rank 0 spins in the device sync
sigstop       rank 1 stops itself (SIGSTOP); rank 0 spins           culprit 1, plain restart
desync        3 ranks; rank 1 all_gathers where 0 and 2             desync, culprit 1 (the odd rank), plain
              broadcast; everyone spins                             restart
transport     every rank's bucket all-reduce is launched and        no culprit, fallback level 1 with an NCCL
              never completes: everyone spins, counts equal and     setting; the rerun (NCCL_P2P_DISABLE=1)
              frozen                                                finishes
============  ====================================================  ===========================================

The healthy twins finish with no acting incident: ``slow_save`` (rank 0 writes 64 KiB fsync'd chunks for 20 s while
rank 1 spins: on the GPU and in RAS exactly the hang, only rank 0's own I/O and wakeups tell them apart) and
``big_collectives`` (an 8 MiB all-reduce every step: the ranks spin while data moves, RAS counts move). And the node
daemon (``gpu-watchdog run --backend nvml``, a registered job) on own_code and slow_save.

Each test runs real 2–3-rank jobs for 30–90 s: marked ``slow``. Every test prints the incident's key fields and
timings (``-s``, or the ``nccl_standin`` property in a junit report).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gpu_play import GpuPlay
from launch_harness import LaunchRun, read_events, start_launch, torchrun, write_config
from nccl_like_state import STATE_DIR_ENV, ras_report
from nvml_standin.fixtures import nvml_standin as _nvml_standin_fixture  # noqa: F401
from nvml_standin.fixtures import nvml_standin_lib as _nvml_standin_lib_fixture  # noqa: F401
from ras_standin import RasStandIn
from repo_paths import REPO

NCCL_LIKE = REPO / "tests" / "jobs" / "nccl_like.py"
N_GPUS = 1  # every rank on one GPU, as in the H200 captures
ONSET_TO_CONFIRMED_S = 10.0  # the issue's goal
# Short windows, as the other end-to-end tests use; waiting_timeout_s longer than any hang window here (and than the
# 20 s save), so no verdict below can come from the waiting timeout.
DETECT = {"confirm_after_s": 8.0, "waiting_timeout_s": 60.0}
RAS = {"enabled": "on", "timeout_s": 3.0, "poll_interval_s": 1.0, "watch_interval_s": 1.0, "confirm_gap_s": 1.0}
RECOVERY = {"stop_grace_s": 5.0, "checkpoint_grace_s": 10.0, "memory_release_timeout_s": 15.0, "max_restarts": 2}
ACTING = ("checkpoint", "stop", "restart", "restart_hook", "give_up")  # actions that interrupt the job
STEPS, STEP_AT, STEP_S = 20, 10, 0.1


def nccl_argv(events: Path, workdir: Path, scenario: str, *, nproc: int, rank_at: int = 1, step_at: int = STEP_AT,
              steps: int = STEPS, step_s: float = STEP_S, extra: tuple[str, ...] = (),
              max_lifetime_s: int = 300) -> list[str]:
    """``torchrun … tests/jobs/nccl_like.py`` under ``timeout -s KILL`` (a safety net)."""
    argv = [torchrun(), "--standalone", "--nproc-per-node", str(nproc), str(NCCL_LIKE), "--scenario", scenario,
            "--rank-at", str(rank_at), "--step-at", str(step_at), "--steps", str(steps), "--step-s", str(step_s),
            "--events", str(events), "--workdir", str(workdir), *extra]
    timeout_bin = shutil.which("timeout")
    return [timeout_bin, "-s", "KILL", str(max_lifetime_s), *argv] if timeout_bin else argv


def acting(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The incidents that interrupted the job (an action that ran, not one skipped)."""
    return [i for i in incidents if any(a["action"] in ACTING and a.get("outcome") != "skipped"
                                        for a in i.get("actions", []))]


def summary(inc: dict[str, Any], onset: float | None) -> dict[str, Any]:
    """An incident's key fields, for the report."""
    keys = ("kind", "signature", "verdict", "culprit_ranks", "collective", "desync", "culprit_evidence",
            "action_evidence", "evidence", "ras_culprit_ranks", "ras_hung_communicators", "evidence_disagreements")
    out: dict[str, Any] = {k: inc.get(k) for k in keys if k in inc}
    fb = inc.get("fallback") or {}
    out["fallback"] = {k: fb.get(k) for k in ("level", "env", "reason")} if fb else None
    out["actions"] = [(a["action"], a.get("ok"), (a.get("detail") or "")[:120]) for a in inc.get("actions", [])]
    if onset is not None and inc.get("detected_at"):
        out["onset_to_confirmed_s"] = round(inc["detected_at"] - onset, 2)
        if inc.get("onset"):
            out["detector_onset_lag_s"] = round(inc["onset"] - onset, 2)
    return out


def report(record_property: Any, what: str, data: dict[str, Any]) -> None:
    record_property("nccl_standin", json.dumps(data, default=str))
    print(f"\n[nccl-standin] {what}: {json.dumps(data, default=str, indent=1)}", file=sys.stderr)


@dataclass
class NcclRun:
    rc: int | None
    run: LaunchRun
    events: Path
    play: GpuPlay
    ras: RasStandIn
    output: str
    incidents: list[dict[str, Any]]

    def onset(self) -> float | None:
        return min((e["t"] for e in read_events(self.events) if e["event"] == "hang_onset"), default=None)

    def runs(self) -> list[list[dict[str, Any]]]:
        """The ranks' start events, run by run (restart 0, 1, …)."""
        starts = [e for e in read_events(self.events) if e["event"] == "start"]
        by: dict[str, list[dict[str, Any]]] = {}
        for e in starts:
            by.setdefault(str(e.get("restart")), []).append(e)
        return [by[k] for k in sorted(by)]

    def finished(self, nproc: int) -> bool:
        return sorted(e["rank"] for e in read_events(self.events) if e["event"] == "done") == list(range(nproc))


def run_nccl(tmp_path: Path, nvml_standin: Any, scenario: str, *, nproc: int, rank_at: int = 1,
             extra: tuple[str, ...] = (), timeout_s: float = 240.0) -> NcclRun:
    """nccl_like.py's ``scenario`` under ``launch --backend nvml`` (GpuPlay on the NVML stand-in, RAS stand-in on),
    to its end."""
    state = nvml_standin.require_scripted()
    state_dir = tmp_path / "nccl-state"
    state_dir.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    events = tmp_path / "events.jsonl"
    play = GpuPlay(state, state_dir, N_GPUS)
    with RasStandIn(source=lambda: ras_report(state_dir, n_gpus=N_GPUS)) as ras:
        cfg = write_config(tmp_path / "watchdog.toml", {"detect": DETECT, "recovery": RECOVERY,
                                                       "ras": {**RAS, "addr": ras.addr}})
        env = {**nvml_standin.env, STATE_DIR_ENV: str(state_dir)}
        run = start_launch(["--backend", "nvml", "--config", str(cfg)],
                           nccl_argv(events, work, scenario, nproc=nproc, rank_at=rank_at, extra=extra),
                           env=env, tmp_path=tmp_path, job_id=f"nccl-{scenario}")
        rc = None
        try:
            with play:
                try:
                    rc = run.wait(timeout_s)
                except TimeoutError:
                    rc = None
        finally:
            run.kill(play.seen_pids)
    return NcclRun(rc, run, events, play, ras, run.output(), run.incidents())


# ------------------------------------------------------------------------------------------------ launch: hangs
@dataclass(frozen=True)
class Hang:
    scenario: str
    nproc: int
    culprit: tuple[int, ...]  # the ranks the incident must name (empty: none)
    nccl_change: bool  # the restart climbs a fallback level (an NCCL setting) — else a plain restart
    desync: bool = False


HANGS = (
    Hang("own_code", 2, (1,), nccl_change=False),
    Hang("sigstop", 2, (1,), nccl_change=False),
    Hang("desync", 3, (1,), nccl_change=False, desync=True),
    Hang("transport", 2, (), nccl_change=True),
)


@pytest.mark.slow
@pytest.mark.parametrize("hang", HANGS, ids=[h.scenario for h in HANGS])
def test_an_nccl_hang_is_confirmed_fast_names_the_culprit_and_the_rerun_finishes(nvml_standin, tmp_path, hang,
                                                                                 record_property):
    res = run_nccl(tmp_path, nvml_standin, hang.scenario, nproc=hang.nproc)
    onset = res.onset()
    spin_at = res.play.shown_at("spin", onset or 0.0)
    report(record_property, hang.scenario, {
        "rc": res.rc, "hang_onset_to_gpu_spin_s": round(spin_at - onset, 2) if onset and spin_at else None,
        "ras_queries": len(res.ras.served), "runs": len(res.runs()), "finished": res.finished(hang.nproc),
        "incidents": [summary(i, onset) for i in res.incidents]})
    out = res.output
    assert onset is not None, out[-3000:]
    assert spin_at is not None and spin_at - onset < 3.0, (spin_at, onset)  # the GPU showed the hang at once
    assert res.incidents, f"no incident:\n{out[-4000:]}"
    inc = res.incidents[0]
    assert inc["kind"] == "stall", inc
    assert inc["detected_at"] - onset <= ONSET_TO_CONFIRMED_S, summary(inc, onset)
    assert inc["culprit_ranks"] == list(hang.culprit), summary(inc, onset)
    if hang.desync:
        assert inc.get("desync"), summary(inc, onset)
    acts = {a["action"]: a for a in inc["actions"]}
    assert acts.get("stop", {}).get("ok") and acts.get("restart", {}).get("ok"), summary(inc, onset)
    level = (inc.get("fallback") or {}).get("level")
    if hang.nccl_change:
        assert level == 1 and "NCCL_P2P_DISABLE=1" in acts["restart"]["detail"], summary(inc, onset)
    else:
        assert level == 0 and "NCCL_P2P_DISABLE" not in acts["restart"]["detail"], summary(inc, onset)
    assert res.rc == 0, out[-4000:]
    assert len(res.incidents) == 1, [summary(i, onset) for i in res.incidents]
    runs = res.runs()
    assert len(runs) == 2 and len(runs[1]) == hang.nproc, runs
    assert all(e["nccl"].get("NCCL_P2P_DISABLE") == ("1" if hang.nccl_change else None) for e in runs[1]), runs[1]
    assert res.finished(hang.nproc), read_events(res.events)[-10:]


# ------------------------------------------------------------------------------------------ launch: healthy twins
def ras_counts(report: str) -> dict[int, int]:
    """rank → collectives launched, from one served RAS report (the job's live communicator)."""
    from gpu_watchdog.evidence.nccl_ras.client import parse_report

    comms = parse_report(report).communicators
    return {r.rank: sum(r.collective_counts.values()) for c in comms for r in c.ranks}


TWINS = {  # scenario → (what the GPU must have shown, the job's extra arguments)
    "slow_save": ("spin", ("--pause-s", "20")),
    "big_collectives": ("transfer", ("--steps", "60", "--big-mib", "32")),
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(TWINS))
def test_a_healthy_nccl_job_that_looks_like_a_hang_runs_clean(nvml_standin, tmp_path, scenario, record_property):
    """slow_save: rank 0 writes for 20 s while rank 1 spins; the GPU spins and RAS shows rank 0 behind, frozen — as
    in the hang; only rank 0's I/O and wakeups say it is alive. big_collectives: the ranks spin while 32 MiB
    all-reduces move data; utilization swings at 17 % power, RAS counts move."""
    shown, extra = TWINS[scenario]
    res = run_nccl(tmp_path, nvml_standin, scenario, nproc=2, extra=extra)
    onset = res.onset()
    evs = read_events(res.events)
    pause_end = next((e["t"] for e in evs if e["event"] == "pause_end"), None)
    counts = [(t, ras_counts(r)) for t, r in res.ras.served]
    shown_at = res.play.shown_at(shown, onset or 0.0)
    report(record_property, scenario, {
        "rc": res.rc, "profiles_shown": {p: sum(1 for _, profs in res.play.history if p in profs)
                                         for p in ("busy", "transfer", "spin", "idle", "none")},
        f"first_{shown}_after_onset_s": round(shown_at - onset, 2) if onset and shown_at else None,
        "ras_queries": len(res.ras.served), "finished": res.finished(2),
        "ras_counts_during_pause": [c for t, c in counts if onset and pause_end and onset < t < pause_end][:3],
        "incidents": [summary(i, onset) for i in res.incidents]})
    assert shown_at is not None, res.play.history[-20:]  # the twin did look like the hang on the GPU
    if scenario == "slow_save":
        assert onset is not None and pause_end is not None and pause_end - onset >= 19, evs[-10:]
        assert any(c.get(0, 0) < c.get(1, 0) for t, c in counts if onset + 2 < t < pause_end), counts  # rank 0 behind
    else:
        assert len({sum(c.values()) for _, c in counts}) >= 2, counts  # RAS counts moved
    assert acting(res.incidents) == [], [summary(i, onset) for i in res.incidents]
    assert res.rc == 0, res.output[-4000:]
    assert len(res.runs()) == 1 and res.finished(2), evs[-10:]


# ------------------------------------------------------------------------------------------------------ daemon
# Under the daemon, the hangs whose recovery differs (plain restart, desync advice, the NCCL ladder) and the twin
# that looks most like a hang; sigstop and big_collectives take the same detector and recovery paths under launch.
DAEMON_CASES = ["own_code", "desync", "transport", "slow_save"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", DAEMON_CASES)
def test_the_daemon_on_a_registered_nccl_job(nvml_standin, scenario, record_property):
    """``gpu-watchdog run --backend nvml`` with a nccl_like.py job started outside it and registered through
    ``gpu-watchdog hook job-start``: each hang is confirmed at most 10 s after its onset with the same culprit as
    under ``launch``, stopped and handed to the restart hook once — at level 0 (a plain restart), at level 1 only
    for the transport hang; the healthy twins finish with no acting incident."""
    from daemon_helpers import GW, records, register_when_up, short_dir, wait_for
    from daemon_helpers import write_config as daemon_config
    from gloo_jobs import start_job
    from gpu_watchdog.store.incidents import IncidentStore

    state = nvml_standin.require_scripted()
    base = short_dir()  # the control socket's path must stay short
    state_dir = base / "nccl-state"
    state_dir.mkdir()
    play = GpuPlay(state, state_dir, N_GPUS)
    ras = RasStandIn(source=lambda: ras_report(state_dir, n_gpus=N_GPUS))
    ras_toml = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {**RAS, "addr": ras.addr}.items())
    detect_toml = "\n".join(f"{k} = {v!r}" for k, v in DETECT.items())
    cfg = daemon_config(base, extra=f"\n[detect]\n{detect_toml}\n\n[ras]\n{ras_toml}\n")
    cfg.write_text(cfg.read_text().replace('backend = "proc"', 'backend = "nvml"'))
    log = base / "daemon.log"
    with open(log, "wb") as f:
        daemon = subprocess.Popen([GW, "run", "--config", str(cfg)], stdout=f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  env={**nvml_standin.env, "PYTHONUNBUFFERED": "1"})
    hang = next((h for h in HANGS if h.scenario == scenario), None)
    extra = TWINS[scenario][1] if scenario in TWINS else ()
    job = start_job(scenario, nproc=hang.nproc if hang else 2,
                    extra_args=("--rank-at", "1", "--steps", "60", "--pause-s", "20", *extra),
                    env={STATE_DIR_ENV: str(state_dir)}, tmp_path=base / "job", step_s=STEP_S, step_at=40,
                    script=NCCL_LIKE)

    def daemon_log() -> str:
        return log.read_text(errors="replace")[-6000:]

    def incidents() -> list[dict[str, Any]]:
        return [i for i in IncidentStore(base / "state").list() if i["job_id"] == "nccl-42"]

    try:
        with play:
            register_when_up(daemon, base, job, "nccl-42", daemon_log, ranks_timeout=120)
            assert not [e for e in job.events() if e["event"] == "hang_onset"], "registered too late"
            if hang is not None:
                wait_for(lambda: any(r.get("done") for r in records(base)), 150, "restart hook ran", daemon_log)
                inc = wait_for(lambda: [i for i in incidents() if i.get("outcome")], 30, "incident finished",
                               daemon_log)[0]
                wait_for(lambda: job.proc.poll() is not None, 15, "job stopped")
            else:
                wait_for(lambda: job.proc.poll() is not None, 150, "the job's end", daemon_log)
            assert daemon.poll() is None, daemon_log()
            incs = incidents()
    finally:
        job.stop()
        ras.close()
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
    calls = [r for r in records(base) if "argv" in r]
    events = job.events()
    onset = min((e["t"] for e in events if e["event"] == "hang_onset"), default=None)
    report(record_property, f"daemon-{scenario}", {
        "job_rc": job.proc.returncode, "ras_queries": len(ras.served), "hook_calls": [c["argv"] for c in calls],
        "incidents": [summary(i, onset) for i in incs]})
    text = log.read_text(errors="replace")
    shutil.rmtree(base, ignore_errors=True)
    assert "nvml backend" in text, text[-3000:]
    assert onset is not None or scenario == "big_collectives", events[-10:]  # no slow phase there
    if hang is not None:
        assert onset is not None
        assert inc["kind"] == "stall" and inc["detected_at"] - onset <= ONSET_TO_CONFIRMED_S, summary(inc, onset)
        assert inc["culprit_ranks"] == list(hang.culprit), summary(inc, onset)
        assert bool(inc.get("desync")) == hang.desync, summary(inc, onset)
        acts = {a["action"]: a for a in inc["actions"]}
        assert acts["stop"]["ok"] and acts["restart_hook"]["ok"], summary(inc, onset)
        level = "--level=1" if hang.nccl_change else "--level=0"
        assert len(calls) == 1 and calls[0]["argv"][:3] == ["requeue", "nccl-42", level], calls
    else:
        assert acting(incs) == [], [summary(i, onset) for i in incs]
        assert job.proc.returncode == 0, job.log_tail()
        assert sorted(e["rank"] for e in events if e["event"] == "done") == [0, 1]
        if scenario == "slow_save":
            assert any(e["event"] == "pause_end" for e in events), events[-10:]
    assert daemon.returncode == 0, text[-3000:]  # SIGTERM: a clean stop


def test_the_ras_stand_in_follows_the_state_files(tmp_path):
    """Fast: the report built from nccl_like.py's files (launched counts, one communicator per run, a stopped rank
    unresponsive, a run whose processes are gone forgotten) parses with the agent's own RAS reader, which names the
    rank behind."""
    from gpu_watchdog.evidence.nccl_ras.client import analyze_report, parse_report

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        live[2].send_signal(signal.SIGSTOP)
        time.sleep(0.3)

        def write(rank: int, pid: int, comm: str, launched: dict[str, int]) -> None:
            (tmp_path / f"rank-{rank}.json").write_text(json.dumps({
                "rank": rank, "world": 3, "local_rank": rank, "pid": pid, "host": "127.0.0.1", "comm": comm,
                "state": "sync", "launched": launched, "completed": launched}))

        for rank, n in enumerate((12, 10, 12)):
            write(rank, live[rank].pid, "0xabc", {"AllReduce": n})
        rep = parse_report(ras_report(tmp_path, n_gpus=1))
        (comm,) = rep.communicators
        assert comm.size == 3 and rep.timeouts_count == 1
        assert [(r.rank, r.pid, r.cuda_dev, r.collective_counts["AllReduce"]) for r in comm.ranks] == [
            (0, live[0].pid, 0, 12), (1, live[1].pid, 0, 10)]
        assert [(m.rank, m.pid, m.unresponsive, m.considered_dead) for m in comm.missing_ranks] == [
            (2, live[2].pid, True, False)]
        analysis = analyze_report(rep, {("127.0.0.1", p.pid): r for r, p in enumerate(live)})
        assert analysis.culprit_ranks == [1, 2], analysis.to_json()
        for rank in range(3):  # a new run whose processes are all gone: NCCL forgets its communicator
            write(rank, dead.pid, "0xdef", {"AllReduce": 3})
        assert parse_report(ras_report(tmp_path)).communicators == ()
    finally:
        for p in live:
            p.kill()
            p.wait()
