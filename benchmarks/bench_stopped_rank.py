"""Recovery of a stopped rank (SIGSTOP) against a sleeping rank, side by side, on the shipped default settings.

    .venv/bin/python benchmarks/bench_stopped_rank.py [--runs 3] [--nproc 4] [--keep DIR] [--json]

Each round runs tests/jobs/train.py under ``gpu-watchdog launch`` twice, alternately: rank 1 sleeps forever at
step 4 (``--scenario hang``), or stops itself with SIGSTOP at step 4 (``--scenario stop``); in both the fault is
armed only in the first run (``--cured-by GPU_WATCHDOG_RESTART_COUNT=1``), so the restarted job finishes. From the
job's own events and the incident (wall clock, same host):
- detect_s:  true onset → the incident's ``detected_at``
- recover_s: true onset → the restarted ranks' first ``start`` event
Target: the stopped rank's median recovery within 1.5× the sleeping rank's. Exit 0 when met.
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

from gpu_watchdog.demo.runner import read_events
from gpu_watchdog.store.incidents import IncidentStore

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "tests" / "jobs" / "train.py"
TARGET_RATIO = 1.5


def _bin(name: str) -> str:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def one_run(base: Path, scenario: str, i: int, nproc: int, timeout_s: float) -> dict[str, Any]:
    run = base / f"{scenario}-{i}"
    run.mkdir(parents=True, exist_ok=True)
    events_path = run / "events.jsonl"
    job_id = f"bench-{scenario}-{os.getpid()}-{i}"
    cmd = [_bin("gpu-watchdog"), "launch", "--backend", "proc", "--state-dir", str(run / "state"), "--job-id", job_id,
           "--", _bin("torchrun"), "--standalone", "--nproc-per-node", str(nproc), str(TRAIN),
           "--scenario", scenario, "--rank-at", "1", "--step-at", "4", "--steps", "8", "--step-s", "0.2",
           "--events", str(events_path), "--workdir", str(run), "--cured-by", "GPU_WATCHDOG_RESTART_COUNT=1"]
    t0 = time.time()
    with open(run / "launcher.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
        except subprocess.TimeoutExpired:
            rc = None
    events = read_events(events_path)
    incidents = IncidentStore(run / "state").list()
    onset = next((e["t"] for e in events if e["event"] == "hang_onset"), None)
    starts = sorted(e["t"] for e in events if e["event"] == "start")
    res: dict[str, Any] = {"scenario": scenario, "run": i, "exit_code": rc, "incidents": len(incidents),
                           "detect_s": None, "recover_s": None, "wall_s": round(time.time() - t0, 1)}
    if onset is not None and incidents:
        res["detect_s"] = round(incidents[0]["detected_at"] - onset, 2)
    if onset is not None and len(starts) > nproc:
        res["recover_s"] = round(starts[nproc] - onset, 2)  # the first start of the restarted run
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="rounds (each runs both scenarios)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=180.0, help="per-run limit, seconds")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu-watchdog-bench-stop-"))
    base.mkdir(parents=True, exist_ok=True)
    cols = ("scenario", "run", "exit_code", "incidents", "detect_s", "recover_s", "wall_s")
    print(f"bench_stopped_rank: {args.runs} rounds of a {args.nproc}-rank gloo job, rank 1 sleeping vs stopped at "
          f"step 4, shipped defaults; work dir {base}", flush=True)
    print("  " + " ".join(f"{c:>10}" for c in cols), flush=True)
    results: list[dict[str, Any]] = []
    try:
        for i in range(args.runs):
            for scenario in ("hang", "stop"):  # alternate: both see the same machine load
                r = one_run(base, scenario, i, args.nproc, args.timeout)
                results.append(r)
                print("  " + " ".join(f"{r[c]!s:>10}" for c in cols), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    def median(scenario: str, key: str) -> float | None:
        vals = [r[key] for r in results if r["scenario"] == scenario and r[key] is not None]
        return statistics.median(vals) if vals else None

    sleep_s, stop_s = median("hang", "recover_s"), median("stop", "recover_s")
    ok = all(r["exit_code"] == 0 and r["incidents"] == 1 and r["recover_s"] is not None for r in results)
    ratio = stop_s / sleep_s if sleep_s and stop_s else None
    print(f"  median detect_s: sleeping {median('hang', 'detect_s')}, stopped {median('stop', 'detect_s')}")
    print(f"  median recover_s: sleeping {sleep_s}, stopped {stop_s}; ratio "
          f"{f'{ratio:.2f}' if ratio else '-'} (target <= {TARGET_RATIO}): "
          f"{'PASS' if ok and ratio is not None and ratio <= TARGET_RATIO else 'FAIL'}")
    if args.json:
        print(json.dumps({"runs": results, "ratio": ratio}, indent=1))
    return 0 if ok and ratio is not None and ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
