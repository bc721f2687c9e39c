"""Recovery benchmark: the demo job under ``gpu-watchdog launch`` N times, on the shipped default settings.

    .venv/bin/python benchmarks/bench_recovery.py [--runs 5] [--nproc 3] [--keep DIR] [--json]

Each run starts ``gpu_watchdog/demo/train.py`` (in-job client, hangs at step 12 in a P2P receive on rank 1) under
torchrun through the real console script, with no config file. Measured from the job's own events and the
incident record (wall clock, same host):
- detection latency: true onset (the job's ``hang_onset`` event) → the incident's ``detected_at``
- time to recovery:  true onset → the restarted job's ``step`` event for the hung step
and, as a breakdown, onset → the restart decision (incident ``restart`` action) and onset → the restarted ranks'
first ``start`` event. Targets: detection ≤ 10 s, recovery ≤ 45 s (medians). Exit 0 when both are met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_watchdog.demo.runner import demo_command, read_events

TARGET_DETECT_S = 10.0
TARGET_RECOVER_S = 45.0
HANG_AT = 12


def _gpu_watchdog() -> str:
    beside = Path(sys.executable).parent / "gpu-watchdog"
    return str(beside) if beside.exists() else (shutil.which("gpu-watchdog") or "gpu-watchdog")


def _kill_job(job_id: str) -> None:
    """Safety net: no process of this run may outlive it."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.environ().get("GPU_WATCHDOG_JOB_ID") == job_id:
                p.kill()
        except (psutil.Error, OSError):
            continue


def one_run(base: Path, i: int, nproc: int, timeout_s: float) -> dict[str, Any]:
    work, state = base / f"run-{i}" / "job", base / f"run-{i}" / "state"
    work.mkdir(parents=True, exist_ok=True)
    job_id = f"bench-{os.getpid()}-{i}"
    cmd = [_gpu_watchdog(), "launch", "--state-dir", str(state), "--job-id", job_id, "--",
           *demo_command(work, nproc=nproc, hang_at=HANG_AT)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    with open(base / f"run-{i}" / "launcher.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        finally:
            _kill_job(job_id)
    wall = time.time() - t0
    events = read_events(work / "events.jsonl")
    incidents = json.loads(subprocess.run([_gpu_watchdog(), "incidents", "--json", "--state-dir", str(state)],
                                          capture_output=True, text=True, check=True).stdout)
    onset = next((e["t"] for e in events if e["event"] == "hang_onset"), None)
    res: dict[str, Any] = {"run": i, "exit_code": rc, "wall_s": wall, "incidents": len(incidents),
                           "detect_s": None, "restart_decided_s": None, "ranks_restarted_s": None,
                           "recover_s": None, "culprit_ranks": None}
    if onset is None or not incidents:
        return res
    inc = incidents[0]
    res["culprit_ranks"] = inc["culprit_ranks"]
    res["detect_s"] = inc["detected_at"] - onset
    restart = next((a for a in inc["actions"] if a["action"] == "restart"), None)
    if restart is not None:
        res["restart_decided_s"] = restart["at"] - onset
    starts = [e["t"] for e in events if e["event"] == "start" and e.get("restart") == "1"]
    if starts:
        res["ranks_restarted_s"] = min(starts) - onset
    past = [e["t"] for e in events if e["event"] == "step" and e["step"] == HANG_AT and e["t"] > onset]
    if past:
        res["recover_s"] = min(past) - onset
    return res


def _fmt(v: Any) -> str:
    return f"{v:6.1f}" if isinstance(v, float) else f"{v!s:>6}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=3, help="ranks (the demo's 3 by default)")
    ap.add_argument("--timeout", type=float, default=240.0, help="per-run limit, seconds")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args(argv)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu-watchdog-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    cols = ("run", "exit_code", "detect_s", "restart_decided_s", "ranks_restarted_s", "recover_s", "wall_s")
    print(f"bench_recovery: {args.runs} runs of the demo job ({args.nproc} ranks, hang at step {HANG_AT}) under "
          f"gpu-watchdog launch, shipped defaults; work dir {base}", flush=True)
    print("  " + " ".join(f"{c:>18}" for c in cols), flush=True)
    results = []
    try:
        for i in range(args.runs):
            r = one_run(base, i, args.nproc, args.timeout)
            results.append(r)
            print("  " + " ".join(f"{_fmt(r[c]):>18}" for c in cols), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    def median(key: str) -> float | None:
        vals = [r[key] for r in results if r[key] is not None]
        return statistics.median(vals) if vals else None

    med = {k: median(k) for k in ("detect_s", "restart_decided_s", "ranks_restarted_s", "recover_s", "wall_s")}
    print("  median " + ", ".join(f"{k} {v:.1f}" if v is not None else f"{k} -" for k, v in med.items()))
    ok_runs = all(r["exit_code"] == 0 and r["incidents"] == 1 and r["recover_s"] is not None for r in results)
    ok_detect = med["detect_s"] is not None and med["detect_s"] <= TARGET_DETECT_S
    ok_recover = med["recover_s"] is not None and med["recover_s"] <= TARGET_RECOVER_S
    print(f"  detection latency median {_fmt(med['detect_s']).strip()} s (target <= {TARGET_DETECT_S:.0f} s): "
          f"{'PASS' if ok_detect else 'FAIL'}")
    print(f"  time to recovery  median {_fmt(med['recover_s']).strip()} s (target <= {TARGET_RECOVER_S:.0f} s): "
          f"{'PASS' if ok_recover else 'FAIL'}")
    if not ok_runs:
        print("  some runs did not recover cleanly (exit code, incident count or no step past the hang)")
    if args.json:
        print(json.dumps({"runs": results, "median": med}, indent=1))
    return 0 if ok_runs and ok_detect and ok_recover else 1


if __name__ == "__main__":
    raise SystemExit(main())
