"""The NVML path end to end: real torchrun gloo jobs on fake GPUs, the agent's real pynvml, the stand-in.

Every agent here is a subprocess whose environment (``nvml_standin.env``) points ``LD_LIBRARY_PATH`` at the
compiled ``libnvidia-ml.so.1`` stand-in and ``NVML_STANDIN_STATE`` at the test's state file, so
``gpu-watchdog … --backend nvml`` runs its genuine NVML code through the real nvidia-ml-py. A harness
thread (``gpu_placement.GpuPlacer``) places the job's rank pids on four fake GPUs as NVML compute processes
holding 2 GiB each and keeps the GPUs in step with the job: busy while it trains, the hang's GPU signature
from the job's own ``hang_onset`` event on. Rank progress still comes from the processes (psutil), as on a
real node: a gloo rank blocked in ``all_reduce`` uses no CPU.

Each end-to-end test runs real jobs (4 ranks, ~20-100 s): marked ``slow``. The one fast test at the end
pins the detector rule the spin test's phase 2 relies on.
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gpu_placement import GpuPlacer
from gpu_watchdog.config.schema import DetectConfig
from launch_harness import (
    CLI,
    LaunchRun,
    base_env,
    demo_argv,
    read_events,
    start_launch,
    train_argv,
    write_config,
)
from nvml_standin import StandinState
from nvml_standin.fixtures import nvml_standin as _nvml_standin_fixture  # noqa: F401
from nvml_standin.fixtures import nvml_standin_lib as _nvml_standin_lib_fixture  # noqa: F401
from repo_paths import TESTS

NPROC = 4
INTERVAL_S = 1.0  # agent.interval_s, the default
NVML_GPU_LOST = 15
NVML_NOT_SUPPORTED = 3
NVML_UNKNOWN = 999
# Shared by every run: the shipped detection defaults, a short stop ladder, and quick give-up when a test
# only wants the first incident (max_restarts = 0: record it, dump stacks, stop the job, exit 75).
RECOVERY = {"stop_grace_s": 5.0, "checkpoint_grace_s": 20.0, "memory_release_timeout_s": 15.0}
GIVE_UP = {**RECOVERY, "max_restarts": 0}
EXIT_GAVE_UP = 75
EXIT_GPU_FAULT = 74


def add_gpus(state: StandinState, n: int = NPROC, **fields: Any) -> list[str]:
    """n H100-like GPUs; returns their UUIDs."""
    return [state.gpu(state.add_gpu(**fields))["uuid"] for _ in range(n)]


def hang_onset(events: Path) -> float:
    return next(e["t"] for e in read_events(events) if e.get("event") == "hang_onset")


def first_incident(run: LaunchRun, timeout: float = 90) -> dict[str, Any]:
    return run.wait_for("an incident", lambda: run.incidents()[:1], timeout)[0]


def finished_incident(run: LaunchRun, timeout: float = 60) -> dict[str, Any]:
    """The first incident once its recovery has recorded a stop (and, with restarts, a restart)."""
    def done() -> dict[str, Any] | None:
        incs = run.incidents()
        if incs and any(a["action"] == "stop" and a["ok"] is not None for a in incs[0]["actions"]):
            return incs[0]
        return None
    return run.wait_for("a finished recovery", done, timeout)


def actions(inc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {a["action"]: a for a in inc["actions"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def assert_culprit_proven(inc: dict[str, Any], nproc: int = NPROC) -> None:
    """Stacks dumped for every rank, and the culprit named from them: rank 1, peers in all_reduce."""
    assert inc["culprit_ranks"] == [1], inc
    assert inc["collective"] == "all_reduce", inc
    dump = actions(inc)["dump_stacks"]
    assert dump["ok"] and dump["detail"].startswith(f"{nproc}/{nproc} ranks dumped"), dump
    stacks = sorted(p.name for p in Path(inc["stacks_dir"]).glob("rank-*.json"))
    assert stacks == [f"rank-{r}.json" for r in range(nproc)]
    culprit = json.loads((Path(inc["stacks_dir"]) / "rank-1.json").read_text())
    assert culprit["outcome"] == "ok" and "recv" in json.dumps(culprit["threads"])  # the message that never comes


def run_train_hang(tmp_path: Path, backend: str, *, env: dict[str, str], state: StandinState | None,
                   config: dict[str, dict[str, Any]], hung: str = "idle", placer_kw: dict[str, Any] | None = None,
                   job_id: str = "e2e", args: tuple[str, ...] = (), job_kw: dict[str, Any] | None = None,
                   ) -> dict[str, Any]:
    """tests/jobs/train.py --scenario hang --rank-at 1 under ``launch --backend BACKEND`` until it gives up."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    events = tmp_path / "events.jsonl"
    cfg = write_config(tmp_path / "watchdog.toml", config)
    kw = {"hung": hung, **(placer_kw or {})}
    placer = GpuPlacer(state, events, NPROC, **kw) if state is not None else None
    run = start_launch(["--backend", backend, "--config", str(cfg), *args],
                       train_argv(events, tmp_path, **(job_kw or {})), env=env, tmp_path=tmp_path, job_id=job_id)
    try:
        if placer is not None:
            placer.start()
        rc = run.wait(timeout=150)
    finally:
        if placer is not None:
            placer.stop()
        run.kill(placer.seen_pids if placer else [e["pid"] for e in read_events(events) if "pid" in e])
    return {"rc": rc, "run": run, "events": events, "placer": placer, "output": run.output(),
            "incidents": run.incidents()}


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.slow
def test_launch_nvml_finds_the_hang_names_the_culprit_and_recovers(nvml_standin, tmp_path):
    """The demo job (4 ranks; rank 1 hangs in a P2P recv while NCCL_P2P_DISABLE is unset) under
    ``launch --backend nvml``: signature A on the GPUs, stacks, culprit, checkpoint, stop (waiting until
    NVML no longer lists the ranks), restart at fallback level 1, job finishes: exit 0 — as in proc mode."""
    state = nvml_standin.require_scripted()
    uuids = add_gpus(state)
    events, work = tmp_path / "events.jsonl", tmp_path / "job"
    work.mkdir()
    cfg = write_config(tmp_path / "watchdog.toml", {"recovery": RECOVERY})
    placer = GpuPlacer(state, events, NPROC)
    run = start_launch(["--backend", "nvml", "--config", str(cfg)], demo_argv(events, work),
                       env=nvml_standin.env, tmp_path=tmp_path, job_id="nvml-demo")
    try:
        with placer:
            rc = run.wait(timeout=200)
    finally:
        run.kill(placer.seen_pids)
    out = run.output()
    assert rc == 0, out[-4000:]
    assert "sampling with the nvml backend (requested" in out
    incs = run.incidents()
    assert len(incs) == 1, incs
    inc = incs[0]
    assert (inc["kind"], inc["signature"], inc["job_id"]) == ("stall", "idle_held", "nvml-demo"), inc
    assert sorted(inc["devices"]) == sorted(uuids)
    assert inc["ranks"] == [0, 1, 2, 3]
    assert inc["culprit_ranks"] == [1] and inc["collective"] == "all_reduce", inc
    acts = actions(inc)
    assert acts["dump_stacks"]["ok"] and acts["dump_stacks"]["detail"].startswith("4/4 ranks dumped")
    assert acts["checkpoint"]["ok"], acts["checkpoint"]
    # The stop waited for NVML to stop listing the ranks' pids before the restart.
    assert acts["stop"]["ok"] and "GPU memory released" in acts["stop"]["detail"], acts["stop"]
    assert acts["restart"]["ok"] and "NCCL_P2P_DISABLE=1" in acts["restart"]["detail"]
    assert inc["fallback"]["level"] == 1
    ev = read_events(events)
    onset = hang_onset(events)
    assert placer.hang_shown_at[0] - placer.hang_onsets[0] < INTERVAL_S  # shown before the agent's next tick
    assert inc["onset"] >= onset - INTERVAL_S - 0.5 and inc["detected_at"] - onset < 15, (inc, onset)
    restarted = [e for e in ev if e["event"] == "start" and e.get("restart") == "1"]
    assert len(restarted) == NPROC and all(e["nccl_p2p_disable"] == "1" for e in restarted)
    assert len([e for e in ev if e["event"] == "done"]) == NPROC
    assert placer.starts == 2
    assert not state.gpu(0)["processes"] or all(p["pid"] not in placer.placed() for p in state.gpu(0)["processes"])


def job_states(port: int, job_id: str) -> tuple[dict[str, float], dict[str, float]]:
    """(job state → 0/1, every series) from one scrape."""
    m = scrape(port)
    prefix = f'gpu_watchdog_job_state{{job_id="{job_id}",state="'
    return {k[len(prefix):-2]: v for k, v in m.items() if k.startswith(prefix)}, m


@pytest.mark.slow
def test_spin_signature_needs_idle_power_and_silent_links(nvml_standin, tmp_path):
    """Ranks really blocked the whole time (rank 1 blocked in a receive, the others wait in all_reduce: no CPU); only
    what the GPUs show changes.
    1. ~100 % at high power with rising NVLink/PCIe counters on every GPU: the devices work, so the job
       stays "running" — no suspect, no stack dump, no incident.
    2. GPUs 0, 2, 3 at 100 % and 60 W of 700 W with frozen counters, GPU 1 still working: the job waits
       on rank 1 (the rank whose GPU works), still no incident.
    3. GPU 1 spins too: a stall with signature "spin", proven with stacks, onset at the change."""
    state = nvml_standin.require_scripted()
    add_gpus(state)
    events = tmp_path / "events.jsonl"
    cfg = write_config(tmp_path / "watchdog.toml", {"recovery": GIVE_UP})
    port = free_port()
    placer = GpuPlacer(state, events, NPROC, hung="hot")
    run = start_launch(["--backend", "nvml", "--config", str(cfg), "--metrics-addr", f"127.0.0.1:{port}"],
                       train_argv(events, tmp_path), env=nvml_standin.env, tmp_path=tmp_path, job_id="spin")

    def watch(seconds: float) -> list[tuple[dict[str, float], dict[str, float]]]:
        seen = []
        end = time.time() + seconds
        while time.time() < end:
            seen.append(job_states(port, "spin"))
            assert run.poll() is None, run.output()[-3000:]
            time.sleep(0.5)
        assert run.incidents() == [], run.incidents()
        return seen

    try:
        with placer:
            run.wait_for("the hang", lambda: placer.hang_shown_at, 90)
            # Phase 1, longer than suspect_after_s + two dumps stack_confirm_gap_s apart (~6 s in proc mode).
            seen = watch(placer.hang_shown_at[0] + 10 - time.time())
            assert all(st == {"running": 1.0, "suspect": 0.0, "stalled": 0.0, "waiting": 0.0}
                       for st, _ in seen[4:]), [st for st, _ in seen]  # 2 s: the ticks around the hang
            m = seen[-1][1]
            util = [v for k, v in m.items() if k.startswith("gpu_watchdog_gpu_utilization_ratio")]
            power = [v for k, v in m.items() if k.startswith("gpu_watchdog_gpu_power_watts")]
            assert sorted(util) == [1.0] * NPROC and sorted(power) == [560.0] * NPROC, (util, power)
            assert "py-spy" not in run.output() and "SUSPECT" not in run.output().upper()

            # Phase 2: three GPUs spin, GPU 1 works.
            placer.override(1, "hot")
            placer.set_profile("hung", "spin")
            seen = watch(8)
            last, m = seen[-1]
            assert last["waiting"] == 1.0, [st for st, _ in seen]
            assert m.get('gpu_watchdog_rank_waited_on{job_id="spin",rank="1"}') == 1.0, m
            assert not any(k.startswith("gpu_watchdog_rank_waited_on") and 'rank="1"' not in k for k in m), m

            # Phase 3: GPU 1 spins too.
            switched = time.time()
            placer.override(1, None)
            inc = first_incident(run, 60)
            rc = run.wait(timeout=60)
    finally:
        run.kill(placer.seen_pids)
    out = run.output()
    assert rc == EXIT_GAVE_UP, out[-3000:]
    assert (inc["kind"], inc["signature"]) == ("stall", "spin"), inc
    assert "STALL confirmed in job spin (spin): GPUs spin at idle power with no traffic" in out
    assert_culprit_proven(run.incidents()[0])
    # The streak starts when the last GPU stopped working, not at the (earlier) rank hang.
    assert inc["onset"] >= switched - INTERVAL_S - 0.5, (inc["onset"], switched)
    assert inc["detected_at"] - switched < 12


@pytest.mark.slow
def test_gpu_lost_mid_run_is_a_gpu_fault_without_nccl_fallback(nvml_standin, tmp_path):
    """GPU 2 falls off the bus while the job trains (every NVML call on it returns GPU_IS_LOST): a
    ``gpu_fault`` incident (gpu_lost, that GPU, the job that ran on it), the job stopped, the node drained
    through faults.drain_command, no NCCL fallback (fallback level untouched, no restart), advice to run
    elsewhere, and launch exits 74 (EXIT_GPU_FAULT)."""
    state = nvml_standin.require_scripted()
    uuids = add_gpus(state)
    events, work = tmp_path / "events.jsonl", tmp_path / "job"
    work.mkdir()
    drained = tmp_path / "drain.jsonl"
    hook = TESTS / "hookbin" / "record_hook.py"
    cfg = write_config(tmp_path / "watchdog.toml", {
        "recovery": RECOVERY,
        "faults": {"drain_command": [sys.executable, str(hook), str(drained), "0", "{node}", "{gpu}", "{reason}"]},
    })
    placer = GpuPlacer(state, events, NPROC)
    run = start_launch(["--backend", "nvml", "--config", str(cfg)],
                       demo_argv(events, work, steps=200, hang_at=0), env=nvml_standin.env, tmp_path=tmp_path,
                       job_id="lost")
    try:
        with placer:
            run.wait_for("training steps", lambda: len([e for e in read_events(events)
                                                        if e["event"] == "step"]) >= 3 * NPROC, 90)
            # The agent must have sampled the ranks on the GPUs before one is lost: a lost GPU no longer
            # lists its processes, so the agent names the job from what it saw there the tick before.
            time.sleep(max(0.0, placer.last_placed_at + 4 * INTERVAL_S - time.time()))  # ticks run late under load
            lost_at = time.time()
            placer.apply(state.inject_error, "*", NVML_GPU_LOST, gpu=2)
            rc = run.wait(timeout=90)
    finally:
        run.kill(placer.seen_pids)
    out = run.output()
    assert rc == EXIT_GPU_FAULT, out[-4000:]
    incs = run.incidents()
    assert len(incs) == 1, incs
    inc = incs[0]
    assert (inc["kind"], inc["signature"]) == ("gpu_fault", "gpu_lost"), inc
    assert inc["devices"] == [uuids[2]] and inc["gpu"] == uuids[2]
    assert inc["jobs"] == ["lost"], inc  # the job on the GPU before it was lost
    assert "GPU 2 is lost" in inc["reason"]
    assert inc["detected_at"] - lost_at < 5 * INTERVAL_S  # the next tick sees it; slack for a loaded machine
    acts = actions(inc)
    assert "checkpoint" not in acts and "restart" not in acts and "dump_stacks" not in acts, acts
    assert acts["stop"]["ok"] and acts["drain"]["ok"] and acts["exit"]["ok"], acts
    # No NCCL fallback: none in the incident, the job's level untouched, no second run.
    assert inc["fallback"] is None
    assert "GPU fault" in inc["advice"] and "NCCL" in inc["advice"], inc["advice"]
    assert "NCCL_P2P_DISABLE=1" not in out
    assert [e for e in read_events(events) if e["event"] == "start" and e.get("restart") != "0"] == []
    env_out = subprocess.run([CLI, "env", "--state-dir", str(run.state_dir), "--job", "lost"],
                             capture_output=True, text=True, check=True).stdout
    assert "level 0" in env_out and "export" not in env_out, env_out
    (call, done) = [json.loads(ln) for ln in drained.read_text().splitlines()]
    assert call["argv"][1] == uuids[2] and "gpu lost on" in call["argv"][2] and done == {"done": True}, call


UNSUPPORTED_GPU: dict[str, Any] = {
    "power_mw": None, "power_limit_mw": None, "temperature_c": None, "clock_graphics_mhz": None,
    "clock_sm_mhz": None, "clock_mem_mhz": None, "clock_video_mhz": None, "fields": {},
    "clocks_event_reasons": None, "clock_sm_max_mhz": None,
}
UNSUPPORTED_NAMES = ("power", "power_limit", "temperature", "sm_clock", "traffic", "process_utilization",
                     "pcie_replay", "clock_event_reasons", "sm_clock_max")


@pytest.mark.slow
@pytest.mark.slow
def test_nvml_unknown_mid_run_is_counted_not_a_fault_and_a_later_hang_is_still_found(nvml_standin, tmp_path):
    """Every NVML call on GPU 2 starts failing with NVML_ERROR_UNKNOWN while the job trains (a driver hiccup,
    not proof of a hardware fault): the agent counts the errors by class, drains nothing, raises no gpu_fault,
    and keeps supervising: rank 2 is judged from its host counters, and when rank 1 later hangs the stall is
    found and proven with stacks as usual."""
    state = nvml_standin.require_scripted()
    add_gpus(state)
    events = tmp_path / "events.jsonl"
    drained = tmp_path / "drain.jsonl"
    hook = TESTS / "hookbin" / "record_hook.py"
    cfg = write_config(tmp_path / "watchdog.toml", {
        "recovery": GIVE_UP,
        "faults": {"drain_command": [sys.executable, str(hook), str(drained), "0", "{node}", "{gpu}", "{reason}"]},
    })
    port = free_port()
    placer = GpuPlacer(state, events, NPROC)
    run = start_launch(["--backend", "nvml", "--config", str(cfg), "--metrics-addr", f"127.0.0.1:{port}"],
                       train_argv(events, tmp_path, step_at=40, step_s=0.3), env=nvml_standin.env,
                       tmp_path=tmp_path, job_id="unknown")
    try:
        with placer:
            run.wait_for("training steps", lambda: len([e for e in read_events(events)
                                                        if e["event"] == "step"]) >= 3 * NPROC, 90)
            time.sleep(max(0.0, placer.last_placed_at + 2 * INTERVAL_S - time.time()))
            placer.apply(state.inject_error, "*", NVML_UNKNOWN, gpu=2)
            counted = run.wait_for("Unknown errors counted", lambda: scrape(port).get(
                'gpu_watchdog_nvml_errors_total{error_class="NVMLError_Unknown"}', 0) >= 3, 60)
            assert counted and run.incidents() == [], run.incidents()  # training goes on: nothing to report
            inc = first_incident(run, 90)  # rank 1 hangs at step 40
            rc = run.wait(timeout=90)
    finally:
        run.kill(placer.seen_pids)
    out = run.output()
    assert rc == EXIT_GAVE_UP, out[-4000:]
    assert (inc["kind"], inc["signature"]) == ("stall", "idle_held"), inc
    assert len(run.incidents()) == 1 and not drained.exists(), out[-4000:]
    assert "gpu_watchdog/" not in out  # no traceback of ours
    assert_culprit_proven(run.incidents()[0])


def test_everything_optional_not_supported(nvml_standin, tmp_path):
    """GPUs that answer only utilization, memory and the process list (power, power limit, temperature,
    clocks, every field value and per-process utilization NOT_SUPPORTED): ``record`` and ``launch`` say
    once per GPU what NVML cannot read, and the hang is still found from utilization, memory and the
    processes, and proven with stacks."""
    state = nvml_standin.require_scripted()
    uuids = add_gpus(state, **UNSUPPORTED_GPU)
    state.inject_error("nvmlDeviceGetProcessUtilization", NVML_NOT_SUPPORTED)

    trace = tmp_path / "idle.jsonl"
    rec = subprocess.run([CLI, "record", "--backend", "nvml", "--duration", "1", "--interval", "0.5",
                          "--output", str(trace)], env=nvml_standin.env, capture_output=True, text=True,
                         timeout=60)
    assert rec.returncode == 0, rec.stderr
    lines = [ln for ln in rec.stderr.splitlines() if "not supported" in ln]
    assert len(lines) == NPROC, rec.stderr  # once per GPU, not once per tick
    for ln in lines:
        assert all(name in ln for name in UNSUPPORTED_NAMES), ln
    samples = [json.loads(ln) for ln in trace.read_text().splitlines()[1:]]
    assert len(samples) >= 3
    for s in samples:
        for d in s["devices"]:
            assert set(d["unsupported"]) == set(UNSUPPORTED_NAMES), d
            assert d["power_w"] is None and d["pcie_tx_bytes_total"] is None and d["util_percent"] == 0.0

    res = run_train_hang(tmp_path / "launch", "nvml", env=nvml_standin.env, state=state,
                         config={"recovery": GIVE_UP}, job_id="unsup",
                         placer_kw={"busy": "busy_util_only", "hung": "idle_util_only",
                                    "idle": {"utilization_gpu": 0}, "process_samples": False})
    out = res["output"]
    assert res["rc"] == EXIT_GAVE_UP, out[-4000:]
    lines = [ln for ln in out.splitlines() if "not supported" in ln]
    assert len(lines) == NPROC and all(all(n in ln for n in UNSUPPORTED_NAMES) for ln in lines), out[-4000:]
    assert sorted({u for ln in lines for u in uuids if u in ln}) == sorted(uuids)
    inc = res["incidents"][0]
    assert (inc["kind"], inc["signature"]) == ("stall", "idle_held"), inc
    assert sorted(inc["devices"]) == sorted(uuids)
    assert_culprit_proven(inc)


@pytest.mark.slow
def test_record_nvml_trace_replays_to_the_live_finding(nvml_standin, tmp_path):
    """``gpu-watchdog record --backend nvml`` samples the stand-in while ``launch --backend nvml`` watches
    the same hang. Stacks are off in both, so the live agent and the replay confirm the same way (after
    detect.confirm_after_s): the replayed finding is the live one — kind, signature, job, ranks, GPUs,
    evidence, onset → confirmation — with onset and confirmation times a tick or so apart (the recorder and
    the live agent sample at different phases).
    Without stacks there is no evidence that the hang is in communication (idle GPUs, no spin): the live agent's
    first incident is observed, and the job is stopped only at detect.waiting_timeout_s (10 s here), so the hang
    outlives the live confirmation long enough for the recorder to see it confirmed too."""
    state = nvml_standin.require_scripted()
    uuids = add_gpus(state)
    config = {"detect": {"confirm_after_s": 6.0, "waiting_timeout_s": 10.0}, "stacks": {"enabled": False},
              "recovery": {**GIVE_UP, "checkpoint_signal": "SIGCONT", "checkpoint_grace_s": 4.0}}
    cfg = write_config(tmp_path / "watchdog.toml", config)
    events = tmp_path / "events.jsonl"
    trace = tmp_path / "trace.jsonl"
    placer = GpuPlacer(state, events, NPROC)
    run = start_launch(["--backend", "nvml", "--config", str(cfg)], train_argv(events, tmp_path, step_at=8),
                       env=nvml_standin.env, tmp_path=tmp_path, job_id="rec")
    rec = None
    try:
        with placer:
            run.wait_for("4 ranks on GPUs", lambda: len(placer.placed()) == NPROC, 90)
            rec = subprocess.Popen([CLI, "record", "--config", str(cfg), "--backend", "nvml", "--duration", "25",
                                    "--job", "rec", "--output", str(trace)], env=nvml_standin.env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            live = run.wait_for("the first incident, observed", lambda: next(
                (i for i in run.incidents()[:1] if i.get("verdict") == "waiting" and i.get("outcome")), None), 90)
            rc = run.wait(timeout=60)
            rec_out, _ = rec.communicate(timeout=60)
    finally:
        if rec is not None and rec.poll() is None:
            rec.kill()
            rec.wait()
        run.kill(placer.seen_pids)
    assert rc == EXIT_GAVE_UP, run.output()[-3000:]
    assert rec.returncode == 0, rec_out
    assert "recording with the nvml backend (requested" in rec_out
    head = json.loads(trace.read_text().splitlines()[0])
    assert head["backend"] == "nvml" and head["format"] == "gpu-watchdog-trace"

    replay = subprocess.run([CLI, "replay", "--config", str(cfg), "--json", str(trace)], capture_output=True,
                            text=True, check=True)
    found = json.loads(replay.stdout)
    assert len(found) == 1, replay.stdout  # --job rec: nothing of any other job on this node was recorded
    f = found[0]
    assert (f["kind"], f["signature"], f["job"]) == (live["kind"], live["signature"], live["job_id"])
    assert f["ranks"] == live["ranks"] == [0, 1, 2, 3]
    assert sorted(f["devices"]) == sorted(live["devices"]) == sorted(uuids)
    assert f["evidence"] == live["evidence"] == "time"
    # Two samplers at different phases: each sees the ranks' last CPU burst in a different window, so the
    # streak starts (and, detect.confirm_after_s later, ends) up to one tick apart, plus tick jitter.
    assert abs(f["onset"] - live["onset"]) <= 2 * INTERVAL_S, (f, live)
    assert abs(f["confirmed_at"] - live["detected_at"]) <= 2 * INTERVAL_S, (f, live)
    # Both confirm detect.confirm_after_s after their onset, at the first tick past it: one tick apart at most
    # when a loaded machine ran one sampler's onset tick late by more than detector.CLOCK_SLACK_S.
    assert abs((f["confirmed_at"] - f["onset"]) - (live["detected_at"] - live["onset"])) <= INTERVAL_S + 0.1, \
        (f, live)
    # Replay is deterministic, and the CLI's answer is the library's.
    again = subprocess.run([CLI, "replay", "--config", str(cfg), "--json", str(trace)], capture_output=True,
                           text=True, check=True)
    assert again.stdout == replay.stdout
    from gpu_watchdog.config.load import load_config
    from gpu_watchdog.detect.replay import replay_trace

    assert [x.to_json() for x in replay_trace(trace, load_config(cfg).detect)] == json.loads(replay.stdout)


# Short steps in lockstep: every rank stops using CPU within ~20 ms of the hang, so the tick of the hang
# rarely sees "rank 1 idle while the others still compute".
LATENCY_JOB = {"step_s": 0.02, "step_at": 60}
# Two ways to a confirmed stall. The usual one: no progress for suspect_after_s, then two stack dumps
# stack_confirm_gap_s apart, so at least their sum after the streak starts. The early one: the job was
# "waiting" for a tick at the hang (some ranks' evidence still moving), which dumps stacks at once, and the
# second dump confirms ~2-3 s sooner. The proc backend takes it more often: a rank at 5-10 % CPU in the
# tick of the hang is "not progressing" (progress_cpu_min_cores) while its virtual device is still "busy"
# (util_idle_max_percent). Latencies are compared path by path.
USUAL_PATH_MIN_S = DetectConfig().suspect_after_s + DetectConfig().stack_confirm_gap_s
LATENCY_RUNS = 3  # per backend; odd, so the median is a run and one outlier cannot move it far


def _latency(res: dict[str, Any]) -> tuple[float, float]:
    inc = res["incidents"][0]
    onset = hang_onset(res["events"])
    return inc["detected_at"] - onset, inc["detected_at"] - inc["onset"]


@pytest.mark.slow
def test_detection_latency_nvml_matches_proc(nvml_standin, tmp_path, record_property):
    """The same hang (train.py, rank 1 blocked in a receive at step 60), the same shipped config, under ``launch
    --backend proc`` and ``--backend nvml``, three times each, alternating: the same incident (signature,
    culprit, collective, actions) and detection latencies within one sampling interval (see the asserts).
    Medians of three: one run whose ranks took seconds longer to go quiet on a loaded CI machine (seen once:
    13.5 s against 6.4 s) must not decide the comparison, as it did with two runs per backend."""
    state = nvml_standin.require_scripted()
    add_gpus(state)
    config = {"recovery": GIVE_UP}
    lat: dict[str, list[float]] = {"proc": [], "nvml": []}
    own: dict[str, list[float]] = {"proc": [], "nvml": []}
    for i in range(LATENCY_RUNS):
        for backend in ("proc", "nvml"):
            env = nvml_standin.env if backend == "nvml" else base_env()
            res = run_train_hang(tmp_path / f"{backend}-{i}", backend, env=env,
                                 state=state if backend == "nvml" else None, config=config,
                                 job_id=f"lat-{backend}-{i}", job_kw=LATENCY_JOB)
            assert res["rc"] == EXIT_GAVE_UP, res["output"][-4000:]
            assert len(res["incidents"]) == 1, res["incidents"]
            inc = res["incidents"][0]
            assert (inc["kind"], inc["signature"]) == ("stall", "idle_held"), inc
            assert_culprit_proven(inc)
            assert [a["action"] for a in inc["actions"]] == ["dump_stacks", "checkpoint", "stop", "give_up"]
            if backend == "nvml":
                assert len(inc["devices"]) == NPROC and all(d.startswith("GPU-") for d in inc["devices"])
                assert "GPU memory released" in actions(inc)["stop"]["detail"]
                shown_lag = res["placer"].hang_shown_at[0] - res["placer"].hang_onsets[0]
                assert shown_lag < INTERVAL_S, shown_lag  # the GPUs showed the hang before the agent's next tick
            else:
                assert all(d.startswith("proc-") for d in inc["devices"])
            total, detector = _latency(res)
            lat[backend].append(total)
            own[backend].append(detector)
    usual = {b: [i for i, x in enumerate(own[b]) if x >= USUAL_PATH_MIN_S - 0.1] for b in own}
    figures = {b: {"onset_to_confirmed_s": [round(x, 2) for x in lat[b]],
                   "detector_onset_to_confirmed_s": [round(x, 2) for x in own[b]],
                   "usual_path_runs": usual[b]} for b in lat}
    record_property("detection_latency", json.dumps(figures))
    print(f"\ndetection latency (true onset -> confirmed): {json.dumps(figures)}", file=sys.stderr)
    # What the backend decides — the detector's streak start to the confirmed stall (the GPU signature, the
    # stack dumps, the confirmation) — agrees within one interval on the same path. The lag before it, from
    # the true onset to the streak start, is when the process counters show that the ranks stopped: psutil
    # in both backends, path-independent, and on a loaded 2-core machine noisy; its medians agree within one
    # interval too. So the whole latency agrees within two.
    for path in ("usual", "early"):
        pick = {b: [i for i in range(len(own[b])) if (i in usual[b]) == (path == "usual")] for b in own}
        if not pick["proc"] or not pick["nvml"]:
            continue  # only one backend took this path this time
        med = {b: statistics.median(own[b][i] for i in pick[b]) for b in own}
        assert abs(med["nvml"] - med["proc"]) <= INTERVAL_S, (path, figures)
    lag = {b: statistics.median(x - y for x, y in zip(lat[b], own[b], strict=True)) for b in lat}
    assert abs(lag["nvml"] - lag["proc"]) <= INTERVAL_S, (lag, figures)
    for b in lat:
        assert statistics.median(lat[b]) <= 10, figures  # the stack-evidence issue's goal: ≤10 s median
        # Every run's own decision is bounded; the lag before it is not the agent's: with another test file's jobs
        # on the same 2 cores, the healthy ranks once took 30 s to finish their step and reach the collective
        # (32.9 s from the culprit's onset, 3.0 s of it the detector's).
        assert all(x < 20 for x in own[b]), figures


@pytest.mark.slow
def test_daemon_nvml_finds_a_registered_hang_and_runs_the_restart_hook(nvml_standin):
    """The node daemon (``gpu-watchdog run --backend nvml``) on the same kind of hang: a 4-rank gloo job
    started outside it (rank 1 blocked in a receive, the others wait in all_reduce), its ranks on four fake GPUs that
    drop to 0 % with memory held, registered through ``gpu-watchdog hook job-start``: found through NVML,
    proven with stacks, culprit rank 1, stopped (NVML no longer lists the ranks) and handed to the restart
    hook once at fallback level 1."""
    import shutil

    from daemon_helpers import GW, records, register_when_up, short_dir, wait_for
    from daemon_helpers import write_config as daemon_config
    from gloo_jobs import start_job

    state = nvml_standin.require_scripted()
    uuids = add_gpus(state)
    base = short_dir()  # the control socket's path must stay short
    cfg = daemon_config(base)
    cfg.write_text(cfg.read_text().replace('backend = "proc"', 'backend = "nvml"'))
    log = base / "daemon.log"
    env = {**nvml_standin.env, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as f:
        daemon = subprocess.Popen([GW, "run", "--config", str(cfg)], stdout=f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    job = start_job("hang", nproc=NPROC, extra_args=("--rank-at", "1", "--step-at", "40", "--steps", "1000"),
                    tmp_path=base / "job", step_s=0.05)
    placer = GpuPlacer(state, job.events_path, NPROC)

    def daemon_log() -> str:
        return log.read_text(errors="replace")[-6000:]

    try:
        with placer:
            register_when_up(daemon, base, job, "nvml-42", daemon_log)
            wait_for(lambda: any(r.get("done") for r in records(base)), 120, "restart hook ran", daemon_log)

            from gpu_watchdog.store.incidents import IncidentStore

            inc = wait_for(lambda: [i for i in IncidentStore(base / "state").list()
                                    if i.get("outcome") and i["job_id"] == "nvml-42"], 30, "incident finished",
                           daemon_log)[0]
            wait_for(lambda: job.proc.poll() is not None, 15, "job stopped")
            assert daemon.poll() is None, daemon_log()
    finally:
        job.stop()
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
    text = log.read_text(errors="replace")
    calls = [r for r in records(base) if "argv" in r]
    shutil.rmtree(base, ignore_errors=True)
    assert "nvml backend" in text, text[-3000:]
    assert (inc["kind"], inc["signature"]) == ("stall", "idle_held"), inc
    assert sorted(inc["devices"]) == sorted(uuids), inc
    assert inc["culprit_ranks"] == [1] and inc["collective"] == "all_reduce", inc
    acts = actions(inc)
    assert acts["dump_stacks"]["ok"] and acts["dump_stacks"]["detail"].startswith("4/4 ranks dumped")
    assert acts["stop"]["ok"] and "GPU memory released" in acts["stop"]["detail"], acts["stop"]
    assert acts["restart_hook"]["ok"], acts
    assert len(calls) == 1 and calls[0]["argv"][:3] == ["requeue", "nvml-42", "--level=1"], calls
    assert calls[0]["env_level"] == "1"
    assert daemon.returncode == 0, text[-3000:]  # SIGTERM: a clean stop


def test_quiet_ranks_wait_on_the_rank_whose_gpu_works():
    """Every rank's process is quiet; GPU 1 works (100 % at high power, traffic rising), the others spin.
    The job is "waiting" on rank 1 — the rank on the working GPU — and, after detect.waiting_timeout_s,
    the stall names rank 1 as the culprit (before the fix, waiting_on and the culprit were empty)."""
    import dataclasses

    from gpu_watchdog.config.schema import DetectConfig
    from gpu_watchdog.detect.detector import WAITING, DetectorState, step
    from gpu_watchdog.model import DeviceSample, GpuProcess, JobIdentity, NodeSample, ProcessSample

    cfg = dataclasses.replace(DetectConfig(), waiting_timeout_s=10.0)
    pids = [4000 + r for r in range(NPROC)]
    procs = tuple(ProcessSample(pid, 1.0, 1, "sleeping", 5.0, 0, 1 << 30, job=JobIdentity("j", r, r, NPROC),
                                is_rank=True) for r, pid in enumerate(pids))
    st = DetectorState()
    findings = []
    for k in range(15):
        devs = tuple(DeviceSample(r, f"GPU-{r}", "H100", util_percent=100.0, mem_used_bytes=2 << 30,
                                  mem_total_bytes=80 << 30, power_w=560.0 if r == 1 else 60.0, power_limit_w=700.0,
                                  pcie_tx_bytes_total=(k * 4_000_000_000) if r == 1 else 0,
                                  processes=(GpuProcess(pid, 2 << 30),)) for r, pid in enumerate(pids))
        st, new = step(st, NodeSample(1_700_000_000.0 + k, "h", "nvml", devs, procs), cfg)
        findings += new
        if k == 5:
            assert st.jobs["j"].state == WAITING and st.jobs["j"].waiting_on == (1,), st.jobs["j"]
    (f,) = findings
    assert (f.kind, f.signature, f.culprit_ranks) == ("stall", "waiting_timeout", (1,)), f
