"""Does `gpu-watchdog launch` find real NCCL hangs on a real GPU? Several NCCL ranks on one GPU, one table.

    python benchmarks/nccl_gpu.py [--only ROW ...] [--out-dir DIR] [--budget-s 480]
    python benchmarks/nccl_gpu.py --cpu-dry-run      # the same harness on gloo + the proc backend, no GPU

Each row runs tests/jobs/nccl_real.py (plain DDP over NCCL, ``loss.item()`` every step, 2 GiB held per rank, the
in-job client) under ``gpu-watchdog launch --backend nvml`` with every rank on GPU 0, each rank its own NCCL "host"
(a distinct ``NCCL_HOSTID``, the socket transport over ``lo``: shared/real-gpu/README.md). ``TORCH_NCCL_*`` stay at
their defaults. The agent's config: ``[detect] confirm_after_s = 8``, ``waiting_timeout_s = 60`` (longer than any
window here, so no verdict can come from the waiting timeout), NCCL RAS ``auto`` with 1 s polls, short grace times,
``max_restarts = 1``. The rows are the hangs of tests/e2e/test_nccl_standin.py and their healthy twins, for real:

  own_code       rank 1 blocks in Event().wait() before its backward; rank 0 waits in DDP's all-reduce
  sigstop        rank 1 SIGSTOPs itself before its backward
  desync         3 ranks: rank 1 all_gathers where ranks 0 and 2 broadcast
  transport      every rank's NCCL proxy thread gets EAGAIN from every send/recv (a network gone silent)
  slow_save      healthy: rank 0 writes a checkpoint for 20 s (fsync'd 64 KiB chunks) while rank 1 waits
  big_allreduce  healthy: a 256 MiB all-reduce every step

A hang row matches when launch exits 0 after exactly one acting incident (a stall confirmed at most 10 s after the
job's own ``hang_onset``, with the expected culprit ranks, desync flag and fallback level) and a second run that
finishes; a healthy row when it finishes in one run with no acting incident. Per row it prints onset → confirmed,
the incident's signature, culprits and fallback level, and NVML's view averaged over the hang (GPU utilization,
memory-controller utilization, power), read from the incident's trace.jsonl (healthy rows: a ``gpu-watchdog
record`` of the slow phase). Exit 0 when every row matches, 1 otherwise, 69 without a GPU or without a
prerequisite (one line saying what is missing: the GPU machine has no package registry). Per-row time limits keep
the whole run under ``--budget-s`` (480 s: a device session has 15 minutes, start-up included).

``--cpu-dry-run``: gloo on the CPU under ``--backend proc``, to prove the harness where no GPU is. A gloo rank
waiting in a collective sleeps where an NCCL rank spins, so some verdicts differ from the GPU's: the expected
column shows gloo's own expectation there (``(gloo)``), or ``harness only`` where gloo gives no stable one; the
dry run checks the harness, not the GPU verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "jobs" / "nccl_real.py"
WATCHDOG_SRC = REPO / "watchdog"
PROG = "nccl_gpu"
EXIT_UNAVAILABLE = 69  # gpu_watchdog.errors.EXIT_UNAVAILABLE (not imported: it may be what is missing)
ONSET_TO_CONFIRMED_S = 10.0  # the goal, as tests/e2e/test_nccl_standin.py asserts it
DETECT = {"confirm_after_s": 8.0, "waiting_timeout_s": 60.0}
RAS = {"enabled": "auto", "timeout_s": 3.0, "poll_interval_s": 1.0, "watch_interval_s": 1.0, "confirm_gap_s": 1.0}
RECOVERY = {"stop_grace_s": 5.0, "checkpoint_grace_s": 10.0, "memory_release_timeout_s": 15.0, "max_restarts": 1}
ACTING = ("checkpoint", "stop", "restart", "restart_hook", "give_up")  # actions that interrupt the job
BUDGET_S = 480.0  # the issue: the whole run fits in 8 minutes of device time
DRY_RUN_SCALE = 4.0  # per-row limits on a small CPU box (torch's import alone takes ~20 s there)
MIN_ROW_S = 40.0  # a row is not started with less of the budget left
STOP_GRACE_S = 15.0
RECORD_S = 10.0  # healthy rows: how long NVML is recorded during the slow phase
COMMON_ARGS = ("--steps", "20", "--step-at", "10", "--step-s", "0.1", "--rank-at", "1")


@dataclass(frozen=True)
class Expect:
    hang: bool  # a stall confirmed, the job stopped and restarted once; else: no acting incident, one run
    culprit: tuple[int, ...] = ()
    desync: bool = False
    level: int = 0  # the fallback level the restart runs at (1: an NCCL setting changed)

    def text(self) -> str:
        if not self.hang:
            return "no incident"
        return f"stall c={list(self.culprit)} L{self.level}" + (" desync" if self.desync else "")


@dataclass(frozen=True)
class Row:
    name: str
    nproc: int
    what: str
    gpu: Expect
    gloo: Expect | None  # None: no stable gloo verdict (harness only)
    args: tuple[str, ...] = ()
    gpu_args: tuple[str, ...] = ()
    gloo_args: tuple[str, ...] = ()
    limit_s: float = 85.0  # on a GPU; the limits of all rows add up to less than BUDGET_S
    phase_event: str = "hang_onset"  # healthy rows: the event that starts their NVML recording


HANG_1 = Expect(True, (1,))
ROWS = (
    Row("own_code", 2, "rank 1 in Event().wait() before its backward; rank 0 in DDP's all-reduce", HANG_1, HANG_1),
    Row("sigstop", 2, "rank 1 SIGSTOPs itself before its backward", HANG_1, HANG_1),
    # On gloo one broadcast leaf gets through against the all_gather: no stable culprit there (harness only).
    Row("desync", 3, "rank 1 all_gathers where ranks 0 and 2 broadcast", Expect(True, (1,), desync=True), None),
    Row("transport", 2, "every rank's transport threads get EAGAIN from send/recv", Expect(True, (), level=1),
        Expect(True, (), level=1)),
    Row("slow_save", 2, "rank 0 writes 64 KiB fsync'd chunks for 20 s while rank 1 waits", Expect(False),
        Expect(False), args=("--pause-s", "20"), limit_s=70.0),
    Row("big_allreduce", 2, "an extra all-reduce every step (256 MiB; 8 MiB on gloo)", Expect(False), Expect(False),
        args=("--steps", "40"), gpu_args=("--big-mib", "256"), gloo_args=("--big-mib", "8"), limit_s=60.0,
        phase_event="phase_start"),
)
BY_NAME = {r.name: r for r in ROWS}


# -- prerequisites ----------------------------------------------------------------------------------------
def gpu_missing() -> str | None:
    """Why this machine has no usable GPU, or None. NVML first (fast, no torch import), then torch.cuda."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as e:
            return f"NVML: {e}"
        if count == 0:
            return "NVML sees no GPU"
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no device visible"
        return f"torch.cuda.is_available() is false (torch {torch.__version__}, {build})"
    return None


WARM_UP = """
import torch, torch.distributed as dist
x = torch.ones(1 << 20, device="cuda")
assert x.sum().item() == 1 << 20
print(torch.cuda.get_device_name(0), "NCCL available" if dist.is_nccl_available() else "NO NCCL")
"""


def warm_up() -> str | None:
    """One CUDA start in a child process (it must not hold a context for the whole run: the agent waits for the
    GPU's memory to be released before a restart): the first row then does not pay the cold start alone, and a GPU
    that does not work is found before any row. None when it worked, else why not."""
    try:
        cp = subprocess.run([sys.executable, "-c", WARM_UP], capture_output=True, text=True, timeout=180,
                            stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "a CUDA warm-up did not finish within 180 s"
    if cp.returncode != 0:
        last = (cp.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"a CUDA warm-up failed: {last}"
    return None


def ensure_watchdog_importable() -> bool:
    """The repo's own gpu_watchdog: installed (a venv), else from its source tree (the GPU machine)."""
    try:
        import gpu_watchdog  # noqa: F401
        return True
    except ImportError:
        sys.path.insert(0, str(WATCHDOG_SRC))
    try:
        import gpu_watchdog  # noqa: F401,F811
        return True
    except ImportError:
        return False


def find_py_spy() -> str | None:
    from gpu_watchdog.evidence.stacks.dump import find_py_spy as find  # beside the interpreter, then PATH

    return find()


def missing_prerequisites(dry_run: bool, rows: list[Row]) -> list[str]:
    """Everything the run needs that is not here, each with how to get it (one line in all)."""
    missing: list[str] = []

    def need(module: str, what: str) -> bool:
        try:
            __import__(module)
            return True
        except ImportError:
            missing.append(what)
            return False

    if need("torch", "torch"):
        import torch.distributed as dist

        if not dist.is_available():
            missing.append("torch.distributed")
        elif not dry_run and not dist.is_nccl_available():
            missing.append("NCCL in torch (torch.distributed.is_nccl_available() is false)")
    need("psutil", "psutil")
    need("prometheus_client", "prometheus-client")
    if not dry_run:
        need("pynvml", "nvidia-ml-py (pynvml)")
    if not ensure_watchdog_importable():
        missing.append(f"gpu_watchdog (not importable, not even from {WATCHDOG_SRC})")
    elif "psutil" not in " ".join(missing):
        exe = find_py_spy()
        if exe is None:
            missing.append("py-spy (no executable beside this Python or on PATH: carry its wheel, install it with "
                           "pip --target T and put T/bin on PATH)")
        else:
            try:
                ok = subprocess.run([exe, "--version"], capture_output=True, timeout=30).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            if not ok:
                missing.append(f"py-spy (found at {exe} but `py-spy --version` fails)")
    if any(r.name == "transport" for r in rows) and shutil.which("cc") is None:
        missing.append("cc (the transport row builds its fault shim; leave it out with --only)")
    return missing


# -- processes --------------------------------------------------------------------------------------------
class Children:
    """Every process the benchmark starts, each in its own session, and every descendant seen (pid and start
    time), so that all of them can be stopped: the job runs in a session of its own under launch."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []
        self._seen: dict[int, float] = {}

    def start(self, cmd: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 cwd=cwd, start_new_session=True)
        self._procs.append(p)
        return p

    def track(self, extra_pids: list[int] = ()) -> None:  # type: ignore[assignment]
        import psutil

        procs = []
        for p in self._procs:
            if p.poll() is None:
                try:
                    procs += psutil.Process(p.pid).children(recursive=True)
                except psutil.Error:
                    pass
        for pid in extra_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        for q in procs:
            try:
                self._seen.setdefault(q.pid, q.create_time())
            except psutil.Error:
                continue

    @staticmethod
    def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(p.pid, sig)  # its session's group: the pid is ours until it is reaped
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, p: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (launch then stops its job itself), SIGKILL after ``grace_s``."""
        if p.poll() is None:
            self._signal(p, signal.SIGTERM)
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.wait()

    def kill_seen(self) -> None:
        import psutil

        for pid, ctime in list(self._seen.items()):
            try:
                q = psutil.Process(pid)
                if q.create_time() == ctime:
                    q.kill()  # SIGKILL ends a stopped process too
            except psutil.Error:
                pass
        self._seen.clear()

    def stop_all(self) -> None:
        self.track()
        for p in reversed(self._procs):
            self.stop(p)
        self.kill_seen()


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_WATCHDOG_", "TORCHELASTIC_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WATCHDOG_SRC), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def gpu_watchdog_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpu_watchdog", *args]


# -- one row ----------------------------------------------------------------------------------------------
def write_config(path: Path, py_spy: str | None) -> None:
    def value(v: Any) -> str:
        return json.dumps(v) if isinstance(v, str) else repr(v)

    sections: dict[str, dict[str, Any]] = {"detect": DETECT, "ras": RAS, "recovery": RECOVERY,
                                           **({"stacks": {"py_spy": py_spy}} if py_spy else {})}
    lines = ["# benchmarks/nccl_gpu.py: short windows; waiting_timeout_s longer than any hang window here"]
    for name, keys in sections.items():
        lines += [f"[{name}]", *(f"{k} = {value(v)}" for k, v in keys.items()), ""]
    path.write_text("\n".join(lines))


def read_events(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return out


def row_command(row: Row, dry_run: bool, d: Path, cfg: Path, job_id: str, limit_s: float) -> list[str]:
    backend = "gloo" if dry_run else "nccl"
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(row.nproc),
           str(JOB), "--scenario", row.name, "--backend", backend, "--events", str(d / "events.jsonl"),
           "--workdir", str(d / "work"), *COMMON_ARGS, *row.args, *(row.gloo_args if dry_run else row.gpu_args)]
    timeout_bin = shutil.which("timeout")
    if timeout_bin:  # a safety net: the job never outlives its row by much
        job = [timeout_bin, "-s", "KILL", str(int(limit_s + 60)), *job]
    return gpu_watchdog_cli("launch", "--backend", "proc" if dry_run else "nvml", "--config", str(cfg),
                            "--state-dir", str(d / "state"), "--job-id", job_id, "--", *job)


def acting(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The incidents that interrupted the job (an action that ran, not one skipped)."""
    return [i for i in incidents if any(a.get("action") in ACTING and a.get("outcome") != "skipped"
                                        for a in i.get("actions", []))]


def run_row(row: Row, base: Path, dry_run: bool, limit_s: float, py_spy: str | None,
            children: Children) -> dict[str, Any]:
    d = base / row.name
    if d.exists():
        shutil.rmtree(d)
    (d / "work").mkdir(parents=True)
    cfg = d / "watchdog.toml"
    write_config(cfg, py_spy)
    job_id = f"nccl-gpu-{row.name}-{os.getpid()}"
    events_path = d / "events.jsonl"
    res: dict[str, Any] = {"row": row.name, "nproc": row.nproc, "job_id": job_id, "dir": str(d), "rc": None,
                           "timed_out": False, "limit_s": limit_s, "error": None, "notes": []}
    env = child_env()
    print(f"{PROG}: {row.name}: {row.what} ({row.nproc} ranks, limit {limit_s:.0f} s)", flush=True)
    t0 = time.monotonic()
    launch = children.start(row_command(row, dry_run, d, cfg, job_id, limit_s), d / "launch.log", env, d)
    recorder: subprocess.Popen[bytes] | None = None
    rec_t0 = 0.0
    trace = d / "phase.trace"
    try:
        while True:
            evs = read_events(events_path)
            children.track([e["pid"] for e in evs if e.get("event") == "start" and "pid" in e])
            if launch.poll() is not None:
                break
            if time.monotonic() - t0 > limit_s:
                res["timed_out"] = True
                break
            if not row_expect(row, dry_run).hang and recorder is None and \
                    any(e.get("event") == row.phase_event for e in evs):
                recorder = children.start(gpu_watchdog_cli("record", "--backend", "proc" if dry_run else "nvml",
                                                           "--duration", repr(RECORD_S), "--output", str(trace),
                                                           "--job", job_id), d / "record.log", env, d)
                rec_t0 = time.monotonic()
            time.sleep(0.25)
    finally:
        res["wall_s"] = round(time.monotonic() - t0, 1)
        if recorder is not None:
            try:
                recorder.wait(max(0.0, RECORD_S + 20.0 - (time.monotonic() - rec_t0)))
            except subprocess.TimeoutExpired:
                pass
            children.stop(recorder, 5.0)
        children.stop(launch)
        children.kill_seen()
    res["rc"] = launch.returncode if not res["timed_out"] else None
    collect(row, res, d, trace if recorder is not None else None, dry_run)
    return res


def row_expect(row: Row, dry_run: bool) -> Expect:
    return (row.gloo or row.gpu) if dry_run else row.gpu


def collect(row: Row, res: dict[str, Any], d: Path, phase_trace: Path | None, dry_run: bool) -> None:
    """What the row showed: events, incidents, NVML figures."""
    from gpu_watchdog.store.incidents import IncidentStore

    evs = read_events(d / "events.jsonl")
    onsets = [e["t"] for e in evs if e.get("event") == "hang_onset"]
    res["onset"] = min(onsets) if onsets else None
    runs: dict[int, list[dict[str, Any]]] = {}
    for e in evs:
        if e.get("event") == "start":
            runs.setdefault(int(e.get("restart") or 0), []).append(e)
    res["runs"] = len(runs)
    res["run_env"] = {r: sorted({f"{k}={v}" for e in es for k, v in (e.get("nccl") or {}).items()
                                 if k != "NCCL_HOSTID"}) for r, es in sorted(runs.items())}
    res["finished"] = sorted({e["rank"] for e in evs if e.get("event") == "done"}) == list(range(row.nproc))
    res["fault_blocked"] = [e.get("calls") for e in evs if e.get("event") == "fault_blocked"]
    res["checkpoints"] = sorted({e.get("step") for e in evs if e.get("event") == "checkpoint"})
    res["resumed_from"] = sorted({e.get("step") for e in evs if e.get("event") == "resume"})
    try:
        incidents = IncidentStore(d / "state").list() if (d / "state").exists() else []
    except Exception as e:  # a half-written store after a kill: say so, judge the rest
        incidents = []
        res["notes"].append(f"incidents unreadable: {e}")
    res["incidents"] = [incident_summary(i, res["onset"]) for i in incidents]
    res["acting"] = len(acting(incidents))
    res["figures"] = None
    first = incidents[0] if incidents else None
    if first is not None and first.get("trace"):
        path = Path(first["stacks_dir"]).parent / first["trace"]
        t_end = first.get("detected_at") or 0.0
        t_start = res["onset"] if res["onset"] is not None else t_end - 10.0
        res["figures"] = trace_figures(path, t_start, t_end)
        res["figures_from"] = "incident trace, onset → confirmed"
    elif phase_trace is not None and phase_trace.exists():
        res["figures"] = trace_figures(phase_trace, None, None)
        res["figures_from"] = f"a {RECORD_S:.0f} s gpu-watchdog record from the job's {row.phase_event} event"
    res["ok"], res["why"] = judge(row_expect(row, dry_run), res)
    if dry_run and row.gloo is None:
        res["ok"] = harness_ran(res)  # gloo gives no stable verdict for this row: only the harness is checked
        res["why"] = [] if res["ok"] else ["the harness did not run the row to its end"]


def incident_summary(inc: dict[str, Any], onset: float | None) -> dict[str, Any]:
    keys = ("id", "kind", "signature", "verdict", "culprit_ranks", "collective", "desync", "culprit_evidence",
            "action_evidence", "ras_culprit_ranks", "evidence_disagreements", "onset", "detected_at")
    out: dict[str, Any] = {k: inc.get(k) for k in keys if k in inc}
    fb = inc.get("fallback") or {}
    out["fallback"] = {k: fb.get(k) for k in ("level", "env", "reason")} if fb else None
    out["actions"] = [(a.get("action"), a.get("outcome") or ("ok" if a.get("ok") else "failed"),
                       (a.get("detail") or "")[:100]) for a in inc.get("actions", [])]
    if onset is not None and inc.get("detected_at"):
        out["onset_to_confirmed_s"] = round(inc["detected_at"] - onset, 2)
    return out


def trace_figures(path: Path, t_start: float | None, t_end: float | None) -> dict[str, Any] | None:
    """NVML's view averaged over [t_start, t_end] of a trace (all of it when None): GPU utilization, memory
    controller utilization, power and its share of the limit. Virtual (proc backend) devices are skipped."""
    from gpu_watchdog.model import NodeSample
    from gpu_watchdog.sample.trace import read_trace

    try:
        _head, records = read_trace(path)
    except Exception:
        return None
    util: list[float] = []
    mem_util: list[float] = []
    power: list[float] = []
    limit: list[float] = []
    ticks = 0
    name = None
    for s in records:
        if not isinstance(s, NodeSample):
            continue
        if (t_start is not None and s.t < t_start) or (t_end is not None and s.t > t_end):
            continue
        ticks += 1
        for dev in {d.uuid: d for d in s.devices if not d.virtual}.values():
            name = dev.name
            for acc, v in ((util, dev.util_percent), (mem_util, dev.mem_util_percent), (power, dev.power_w),
                           (limit, dev.power_limit_w)):
                if v is not None:
                    acc.append(float(v))

    def mean(v: list[float]) -> float | None:
        return sum(v) / len(v) if v else None

    return {"ticks": ticks, "gpu": name, "util_percent": mean(util), "mem_util_percent": mean(mem_util),
            "power_w": mean(power), "power_limit_w": mean(limit)}


def harness_ran(res: dict[str, Any]) -> bool:
    return not res["timed_out"] and res["rc"] is not None and res["runs"] >= 1 and res["finished"]


def judge(exp: Expect, res: dict[str, Any]) -> tuple[bool, list[str]]:
    """(matches, why not)."""
    why: list[str] = []
    if res["timed_out"]:
        why.append(f"not finished within its limit ({res['limit_s']:.0f} s)")
    elif res["rc"] != 0:
        why.append(f"launch exited with {res['rc']}")
    incs = res["incidents"]
    if exp.hang:
        if res["onset"] is None:
            why.append("the job never logged its hang_onset")
        if res["acting"] != 1:
            why.append(f"{res['acting']} acting incidents, expected 1")
        if incs:
            inc = incs[0]
            if inc.get("kind") != "stall":
                why.append(f"incident kind {inc.get('kind')}")
            if list(inc.get("culprit_ranks") or []) != list(exp.culprit):
                why.append(f"culprit {inc.get('culprit_ranks')}, expected {list(exp.culprit)}")
            if bool(inc.get("desync")) != exp.desync:
                why.append(f"desync {bool(inc.get('desync'))}, expected {exp.desync}")
            level = (inc.get("fallback") or {}).get("level")
            if level != exp.level:
                why.append(f"fallback level {level}, expected {exp.level}")
            lag = inc.get("onset_to_confirmed_s")
            if lag is not None and lag > ONSET_TO_CONFIRMED_S:
                why.append(f"confirmed {lag:.1f} s after the onset (goal ≤ {ONSET_TO_CONFIRMED_S:.0f} s)")
        else:
            why.append("no incident")
        if res["runs"] != 2:
            why.append(f"{res['runs']} runs, expected 2 (the fault fires in the first only)")
        elif exp.level >= 1 and not any(x.startswith("NCCL_P2P_DISABLE=1") for x in res["run_env"].get(1, [])):
            why.append("the second run did not get the fallback's NCCL setting")
    else:
        if res["acting"]:
            why.append(f"{res['acting']} acting incident(s), expected none")
        if res["runs"] != 1:
            why.append(f"{res['runs']} runs, expected 1")
    if not res["timed_out"] and not res["finished"]:
        why.append("the last run did not finish (not every rank logged done)")
    return not why, why


# -- output -----------------------------------------------------------------------------------------------
def got_text(res: dict[str, Any]) -> str:
    if res.get("error"):
        return "error"
    parts = []
    incs = res["incidents"]
    if incs:
        inc = incs[0]
        level = (inc.get("fallback") or {}).get("level")
        parts.append(f"{inc.get('kind')} {inc.get('signature')} c={inc.get('culprit_ranks')}"
                     + (f" L{level}" if level is not None else "") + (" desync" if inc.get("desync") else ""))
        if inc.get("verdict") and inc.get("verdict") != "stall":
            parts.append(f"verdict {inc['verdict']}")
        if len(incs) > 1:
            parts.append(f"+{len(incs) - 1} more")
    else:
        parts.append("no incident")
    if res["timed_out"]:
        parts.append("TIMEOUT")
    elif res["rc"] != 0:
        parts.append(f"rc={res['rc']}")
    return ", ".join(parts)


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


COLUMNS = (("row", 13), ("ranks", 5), ("expected", 26), ("got", 40), ("match", 5), ("onset→confirmed s", 17),
           ("wall s", 6), ("util %", 6), ("mem-ctl %", 9), ("power W (limit %)", 17), ("rc", 3))


def table_rows(results: list[dict[str, Any]], dry_run: bool) -> list[str]:
    lines = ["  ".join(f"{h:<{w}}" for h, w in COLUMNS).rstrip()]
    for r in results:
        row = BY_NAME[r["row"]]
        if dry_run and row.gloo is None:
            expected = "harness only"
        elif dry_run and row.gloo != row.gpu:
            expected = f"{row.gloo.text()} (gloo)" if row.gloo else "harness only"
        else:
            expected = row_expect(row, dry_run).text()
        f = r.get("figures") or {}
        power, limit = f.get("power_w"), f.get("power_limit_w")
        pw = _num(power, ".0f")
        if power is not None and limit:
            pw += f" ({100.0 * power / limit:.0f} %)"
        lag = next((i.get("onset_to_confirmed_s") for i in r["incidents"][:1]), None)
        cells = (r["row"], str(r["nproc"]), expected, got_text(r), "yes" if r["ok"] else "NO", _num(lag, ".1f"),
                 _num(r.get("wall_s"), ".0f"), _num(f.get("util_percent"), ".0f"), _num(f.get("mem_util_percent"),
                                                                                       ".0f"),
                 pw, "-" if r["rc"] is None else str(r["rc"]))
        lines.append("  ".join(f"{c:<{w}}" for c, (_h, w) in zip(cells, COLUMNS, strict=True)).rstrip())
    return lines


def notes(r: dict[str, Any]) -> list[str]:
    out = list(r["why"]) + r["notes"]
    if r.get("error"):
        out.insert(0, f"error: {r['error']}")
    for inc in r["incidents"][:2]:
        fb = inc.get("fallback") or {}
        out.append(f"incident {inc.get('id')}: culprit by {inc.get('culprit_evidence')}, acted on "
                   f"{(inc.get('action_evidence') or '-')!s:.90}; RAS culprits {inc.get('ras_culprit_ranks')}; "
                   f"fallback {fb.get('level')} {fb.get('env') or {}}")
        if inc.get("evidence_disagreements"):
            out.append(f"evidence disagreements: {str(inc['evidence_disagreements'])[:160]}")
        out.append("actions: " + "; ".join(f"{a} {outcome}" for a, outcome, _d in inc.get("actions", [])))
    if r.get("fault_blocked"):
        out.append(f"transport shim: {r['fault_blocked']} calls refused per rank in its first 5 s"
                   + ("" if any(r["fault_blocked"]) else ": THE FAULT DID NOT TAKE"))
    f = r.get("figures")
    if f:
        shown = any(f.get(k) is not None for k in ("util_percent", "mem_util_percent", "power_w"))
        out.append(f"NVML figures: {r['figures_from']}, {f['ticks']} ticks"
                   + ("" if shown else " (no GPU in it: the proc backend's devices are virtual)"))
    if r.get("checkpoints") or r.get("resumed_from"):
        out.append(f"checkpoint saved at step {r.get('checkpoints') or 'none'}; run 2 resumed from step "
                   f"{r.get('resumed_from') or 'none (started over)'}")
    if len(r.get("run_env") or {}) > 1:
        settings = [x for x in r["run_env"].get(1, []) if not x.startswith("NCCL_DEBUG")]  # not the diagnostics
        out.append(f"run 2's NCCL settings (NCCL_DEBUG* left out): {', '.join(settings) or 'none'}")
    return out


def versions(dry_run: bool) -> str:
    import platform

    import torch

    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if not dry_run:
        try:
            nccl = torch.cuda.nccl.version()
            parts.append("NCCL " + ".".join(map(str, nccl)) if isinstance(nccl, tuple) else f"NCCL {nccl}")
        except Exception:
            pass
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            drv = pynvml.nvmlSystemGetDriverVersion()
            drv = drv.decode() if isinstance(drv, bytes) else drv
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total >> 20
            lim = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            pynvml.nvmlShutdown()
            parts.insert(0, f"{name} ({mem} MiB, power limit {lim:.0f} W, driver {drv})")
        except Exception:
            pass
    import gpu_watchdog

    commit = "unknown"
    try:
        cp = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            timeout=10)
        if cp.returncode == 0:
            commit = cp.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    parts.append(f"gpu-watchdog {getattr(gpu_watchdog, '__version__', '?')} at {commit}")
    return ", ".join(parts)


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", choices=[r.name for r in ROWS], metavar="ROW",
                    help=f"run only this row (repeatable): {', '.join(r.name for r in ROWS)}")
    ap.add_argument("--out-dir", metavar="DIR", help="keep logs, events, incidents and summary.json here "
                                                     "(default: a temporary directory, removed)")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help=f"stop starting rows past this many seconds ({BUDGET_S:.0f} on a GPU; none in a dry run)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="gloo on the CPU under --backend proc: checks the harness, not the GPU verdicts")
    return ap.parse_args(argv)


def _raise_on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dry = args.cpu_dry_run
    rows = [BY_NAME[n] for n in dict.fromkeys(args.only)] if args.only else list(ROWS)
    if not dry:
        why = gpu_missing()
        if why:
            print(f"{PROG}: needs a CUDA GPU with NVML (or --cpu-dry-run); none here: {why}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    missing = missing_prerequisites(dry, rows)
    if missing:
        print(f"{PROG}: missing prerequisites: {'; '.join(missing)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if not dry:
        why = warm_up()
        if why:
            print(f"{PROG}: the GPU is not usable: {why}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    py_spy = find_py_spy()
    budget = args.budget_s if args.budget_s is not None else (None if dry else BUDGET_S)
    scale = DRY_RUN_SCALE if dry else 1.0
    base = Path(args.out_dir).resolve() if args.out_dir else Path(tempfile.mkdtemp(prefix="nccl-gpu-"))
    base.mkdir(parents=True, exist_ok=True)
    header = versions(dry)
    mode = ("DRY RUN: gloo on the CPU, launch --backend proc (checks the harness, not the GPU verdicts)" if dry
            else "launch --backend nvml, every rank on GPU 0 with its own NCCL_HOSTID")
    print(f"{PROG}: {', '.join(r.name for r in rows)}; {mode}; {header}; work dir {base}", flush=True)
    children = Children()
    old = {s: signal.signal(s, _raise_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    interrupted = None
    try:
        for row in rows:
            limit = row.limit_s * scale
            if budget is not None:
                left = budget - (time.monotonic() - started)
                if left < MIN_ROW_S:
                    print(f"{PROG}: {row.name}: skipped, {left:.0f} s of the {budget:.0f} s budget left", flush=True)
                    continue
                limit = min(limit, left)
            results.append(run_row(row, base, dry, limit, py_spy, children))
            r = results[-1]
            print(f"{PROG}: {row.name}: {'as expected' if r['ok'] else 'MISMATCH'} ({got_text(r)}, "
                  f"{r['wall_s']:.0f} s)", flush=True)
    except KeyboardInterrupt as e:
        interrupted = str(e) or "SIGINT"
        print(f"{PROG}: interrupted ({interrupted}); stopping the job", file=sys.stderr, flush=True)
    finally:
        children.stop_all()
        for s, h in old.items():
            signal.signal(s, h)
    total = time.monotonic() - started
    print(f"\n{header}; {'DRY RUN (gloo, proc backend)' if dry else 'launch --backend nvml'}; {total:.0f} s in all")
    for line in table_rows(results, dry):
        print("  " + line)
    for r in results:
        for line in notes(r):
            print(f"  {r['row']}: {line}")
    if args.out_dir:
        (base / "summary.json").write_text(json.dumps({"versions": header, "dry_run": dry, "seconds": total,
                                                       "results": results}, indent=1, default=str) + "\n")
        print(f"  logs, events, incidents and summary.json kept in {base}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    ok = sum(r["ok"] for r in results)
    skipped = len(rows) - len(results)
    all_ok = ok == len(rows) and interrupted is None
    what = ("rows ran through the harness as gloo is expected to give them (not the GPU verdicts)" if dry
            else "rows as expected on the GPU")
    print(f"  VERDICT: {'PASS' if all_ok else 'FAIL'}: {ok}/{len(rows)} {what}"
          + (f"; {skipped} not run" if skipped else "") + (f"; interrupted by {interrupted}" if interrupted else "")
          + f"; {total:.0f} s")
    if interrupted:
        return 130
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
