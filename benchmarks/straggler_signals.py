"""Which cheap per-rank signal tells a straggler from its peers, and what does reading it cost?

    .venv/bin/python benchmarks/straggler_signals.py [--seconds 60] [--cases even,cpu,work,input] [--step-s 0]
                                                       [--batch 32]

Runs real 3-rank torchrun gloo DDP jobs (``tests/zoo/ddp_compute.py``, every rank the same code), one case at a
time: ``even``; ``cpu``: rank 1 held to 0.1 of a core by a cgroup quota (needs root); ``work``: rank 2 gets twice
the data every step (``--variant uneven``); ``input``: rank 2's DataLoader worker held to 0.03 of a core. For
``--seconds`` after a warm-up it reads, every second, each rank's main-thread scheduler clocks
(``evidence.straggler.signals``: running / queued / asleep shares, state, wait channel), and every 3 s takes the
straggler watch's own stack round (nonblocking py-spy, classified). Prints per rank, side by side: the cheap shares,
the stack states' shares, the rank's step rate, and the cost of one read of each kind (µs of the agent's CPU).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "watchdog"))

from cpu_quota import cpu_quota  # noqa: E402
from gpu_watchdog.config.schema import Config  # noqa: E402
from gpu_watchdog.detect.stragglers import take_round  # noqa: E402
from gpu_watchdog.evidence.straggler.signals import read_clock, shares  # noqa: E402
from launch_harness import torchrun  # noqa: E402

JOB = ROOT / "tests" / "zoo" / "ddp_compute.py"
CASES = {"even": ("healthy", None), "cpu": ("healthy", 1), "work": ("uneven", 2), "input": ("healthy", 2)}


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _start(case: str, tmp: Path, job_args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    variant, rank = CASES[case]
    events = tmp / f"{case}.jsonl"
    argv = [torchrun(), "--standalone", "--nproc-per-node", "3", str(JOB), "--events", str(events), "--workdir",
            str(tmp), "--ckpt-every", "1000000", "--steps", "100000", "--variant", variant, *job_args]
    if rank is not None:
        argv += ["--rank", str(rank)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True), events


def _rank_pids(events: Path, timeout: float = 120) -> dict[int, int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pids = {e["rank"]: e["pid"] for e in _events(events) if e["event"] == "start"}
        if len(pids) == 3:
            return pids
        time.sleep(0.5)
    raise RuntimeError(f"the job did not start 3 ranks in {timeout:.0f} s")


def _fault(case: str, pids: dict[int, int]) -> contextlib.AbstractContextManager[object]:
    import psutil

    if case == "cpu":
        return cpu_quota([pids[1]], cores=0.1)
    if case == "input":
        return cpu_quota([c.pid for c in psutil.Process(pids[2]).children()], cores=0.03)
    return contextlib.nullcontext()


def _kill_tree(job: subprocess.Popen[bytes]) -> None:
    """torchrun's workers leave its process group: every descendant is found first, then all are killed."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(job.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(case: str, seconds: float, warmup: float, tmp: Path, job_args: list[str]) -> dict[int, dict[str, object]]:
    job, events = _start(case, tmp, job_args)
    try:
        pids = _rank_pids(events)
        time.sleep(warmup)
        cfg = Config()
        cheap: dict[int, list] = collections.defaultdict(list)
        stacks: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        read_cpu, reads, round_cpu, rounds = 0.0, 0, 0.0, 0
        with _fault(case, pids):
            t0 = time.time()
            steps0 = collections.Counter(e["rank"] for e in _events(events) if e["event"] == "step")
            last = {r: read_clock(p, time.monotonic()) for r, p in pids.items()}
            next_round = time.monotonic()
            while time.time() - t0 < seconds:
                time.sleep(1.0)
                c0 = _cpu_s()
                now = {r: read_clock(p, time.monotonic()) for r, p in pids.items()}
                read_cpu += _cpu_s() - c0
                reads += len(pids)
                for r, clock in now.items():
                    if clock is not None and last.get(r) is not None:
                        sh = shares(last[r], clock)
                        if sh is not None:
                            cheap[r].append((sh, clock.state, clock.wchan))
                last = now
                if time.monotonic() >= next_round:
                    next_round = time.monotonic() + 3.0
                    sampled = take_round(pids, cfg, frozenset(), {}, time.monotonic())
                    round_cpu += sampled.cpu_s
                    rounds += 1
                    for r, s in sampled.states.items():
                        stacks[r][s] += 1
            steps1 = collections.Counter(e["rank"] for e in _events(events) if e["event"] == "step")
            elapsed = time.time() - t0
    finally:
        _kill_tree(job)
    out: dict[int, dict[str, object]] = {}
    for r in sorted(pids):
        rows = cheap[r]
        n = sum(stacks[r].values()) or 1
        out[r] = {
            "running": statistics.mean(s.running for s, _, _ in rows) if rows else float("nan"),
            "queued": statistics.mean(s.queued for s, _, _ in rows) if rows else float("nan"),
            "asleep": statistics.mean(s.asleep for s, _, _ in rows) if rows else float("nan"),
            "wchan": collections.Counter(w for _, st, w in rows if st != "R").most_common(4),
            "stacks": {k: round(v / n, 2) for k, v in stacks[r].most_common()},
            "steps_per_s": (steps1[r] - steps0[r]) / elapsed,
        }
    out[-1] = {"read_us": 1e6 * read_cpu / max(1, reads), "round_ms": 1e3 * round_cpu / max(1, rounds)}
    return out


def watch_cost(ranks: int, ticks: int) -> None:
    """The straggler watch's own CPU per tick for a job of ``ranks`` real processes (their main threads asleep on a
    futex), the cheap signal on and off side by side (stack sampling off in both: its cost is budgeted apart)."""
    import dataclasses

    from gpu_watchdog.detect.stragglers import StragglerWatch
    from gpu_watchdog.model import JobStatus, NodeSample

    procs = [subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
             for _ in range(ranks)]
    try:
        time.sleep(1.0)
        pids = {r: p.pid for r, p in enumerate(procs)}
        job = JobStatus("bench", ranks=tuple(pids), rank_pids=pids)
        base = Config()
        for signals in (False, True, False, True):
            cfg = dataclasses.replace(base, stacks=dataclasses.replace(base.stacks, enabled=True),
                                      straggler=dataclasses.replace(base.straggler, signals=signals,
                                                                    interval_s=1e9))
            watch = StragglerWatch(lambda cfg=cfg: cfg)
            c0 = time.process_time()
            for i in range(ticks):
                watch.watch({"bench": job}, NodeSample(t=float(i), hostname="bench", backend="proc"))
            per_tick = (time.process_time() - c0) / ticks
            watch.close()
            print(f"signals {'on ' if signals else 'off'}: {1e6 * per_tick:7.1f} µs of CPU per tick "
                  f"({ranks} ranks, {ticks} ticks) = {100 * per_tick:.4f} % of a core at 1 tick/s")
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--step-s", type=float, default=0.0, help="each rank sleeps this long after each step (a job "
                    "that does not keep the host's CPUs busy: on a small host a rank with more work slows the job "
                    "only where the host has CPU to spare)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step (ddp_compute.py --batch: at 32 "
                    "gloo's all-reduce bounds the step, at 384 compute does)")
    ap.add_argument("--watch-cost", type=int, metavar="RANKS", help="measure only the straggler watch's CPU per "
                    "tick for RANKS ranks, the cheap signal on and off")
    args = ap.parse_args()
    if args.watch_cost:
        watch_cost(args.watch_cost, 600)
        return 0
    cases = args.cases.split(",")
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {', '.join(bad)}: choose from {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="straggler-signals-", ignore_cleanup_errors=True) as tmp:
        for case in cases:
            res = measure(case, args.seconds, args.warmup, Path(tmp),
                          ["--step-s", str(args.step_s), "--batch", str(args.batch)])
            cost = res.pop(-1)
            print(f"\n== {case}: cheap read {cost['read_us']:.0f} µs CPU per rank, stack round "
                  f"{cost['round_ms']:.1f} ms CPU (3 ranks)")
            print(f"{'rank':>4} {'steps/s':>8} {'running':>8} {'queued':>7} {'asleep':>7}  wchan (asleep)  stacks")
            for r, row in res.items():
                wchan = ",".join(f"{w}:{n}" for w, n in row["wchan"])
                print(f"{r:>4} {row['steps_per_s']:>8.2f} {row['running']:>8.2f} {row['queued']:>7.2f} "
                      f"{row['asleep']:>7.2f}  {wchan:<14}  {row['stacks']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
