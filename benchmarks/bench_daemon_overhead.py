"""The node daemon's own CPU while it watches one healthy 4-rank job: straggler sampling off and on, NCCL RAS watching.

    .venv/bin/python benchmarks/bench_daemon_overhead.py [--window S] [--rounds N] [--baseline DIR]

P3's goal: the agent costs at most 0.5 % of a core with one job on the node. A real ``gpu-watchdog run`` daemon
(default config: 1 s ticks, proc backend since this box has no GPU) watches a real 4-rank torchrun job
(tests/jobs/train.py, healthy, 0.3 s steps). Four daemons are measured side by side in one run, alternating
window by window: ``[straggler] enabled = false`` with no RAS watching, the shipped straggler watch (the cheap
signal every tick, a nonblocking py-spy dump of each rank every 30 s at most) with no RAS watching
(``ras.watch_interval_s = 0``), the stack samples alone (``[straggler] signals = false``), and both
with the default 2 s RAS watching against a RAS stand-in
(tests/support/ras_standin.py, ``ras.enabled = on``) whose report follows a running job — counts that rise at
every query, so every poll pair is a "moving" observation the detector consumes. CPU is the daemon process's
user + system time (psutil) over each window, after a warm-up; the job keeps running across all windows, and
only one daemon runs at a time; the py-spy processes it runs count as its own CPU (its reaped children's times).
Prints each window, then the median of each configuration and their ratio.
``--baseline DIR``: a source tree of another release (``git worktree add DIR REV``) measured the same way in the
same run, as a third configuration (its daemon with no RAS section: run from DIR/watchdog with this Python).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from ras_standin import Comm, Rank, RasStandIn, report_json  # noqa: E402

GW = str(Path(sys.executable).parent / "gpu-watchdog")


def daemon_config(base: Path, name: str, ras_addr: str, watch_s: float, stragglers: bool = True,
                  signals: bool = True) -> Path:
    off = "signals = false" if stragglers else "enabled = false"
    straggler = "" if stragglers and signals else f"[straggler]\n{off}"
    cfg = base / f"{name}.toml"
    cfg.write_text(f"""
[agent]
backend = "proc"
state_dir = "{base / name / 'state'}"

[daemon]
control_socket = "{base / name / 'control.sock'}"
socket_group = ""

[ras]
enabled = "on"
addr = "{ras_addr}"
watch_interval_s = {watch_s}
{straggler}
""")
    (base / name).mkdir(exist_ok=True)
    return cfg


def baseline_config(base: Path) -> Path:
    """The same daemon settings without the [ras] keys an older release may not know."""
    cfg = base / "baseline.toml"
    cfg.write_text(f"""
[agent]
backend = "proc"
state_dir = "{base / 'baseline' / 'state'}"

[daemon]
control_socket = "{base / 'baseline' / 'control.sock'}"
socket_group = ""
""")
    (base / "baseline").mkdir(exist_ok=True)
    return cfg


def measure(cfg: Path, warmup_s: float, window_s: float, source: Path | None = None,
            after_start: Callable[[], None] | None = None, profile: Path | None = None) -> float:
    """The daemon's CPU over one window, as a percentage of one core, its helpers included: the py-spy dumps it
    runs (stack samples, rank finding) count as its own, from its reaped children's times (``source``: another
    release's tree; ``after_start``: called once the daemon runs, before the warm-up — a registration;
    ``profile``: where ``py-spy record`` writes the daemon's busy stacks over the window, collapsed — py-spy's own
    CPU is not the daemon's)."""
    argv = [GW, "run", "--config", str(cfg)]
    env = None
    if source is not None:
        argv = [sys.executable, "-m", "gpu_watchdog", "run", "--config", str(cfg)]
        env = {**os.environ, "PYTHONPATH": str(source / "watchdog")}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        if after_start is not None:
            after_start()
        time.sleep(warmup_s)
        p = psutil.Process(proc.pid)
        recorder = None if profile is None else subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(proc.pid), "--duration",
             str(int(window_s)), "--rate", "100", "--nonblocking", "--format", "raw", "--output", str(profile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c0, t0 = p.cpu_times(), time.monotonic()
        time.sleep(window_s)
        c1, t1 = p.cpu_times(), time.monotonic()
        if recorder is not None:
            recorder.wait(30)
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited {proc.returncode}")
        used = (c1.user + c1.system + c1.children_user + c1.children_system) - (
            c0.user + c0.system + c0.children_user + c0.children_system)
        return 100.0 * used / (t1 - t0)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def hot_functions(collapsed: Path, top: int = 15) -> list[str]:
    """The functions the daemon was busy in (inclusive: each counted once per stack), most first, as lines
    ``share of busy samples  function (file:line)`` from ``py-spy record --format raw`` output."""
    counts: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        for frame in set(stack.split(";")[1:]):  # the first frame is the thread
            counts[frame] = counts.get(frame, 0) + int(n)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [f"{100.0 * c / total:5.1f} %  {f}" for f, c in ranked] if total else ["(no busy samples)"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=float, default=60.0, help="seconds measured per window")
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds after a daemon starts before measuring")
    ap.add_argument("--rounds", type=int, default=3, help="windows per configuration")
    ap.add_argument("--baseline", type=Path, help="another release's source tree, measured side by side")
    args = ap.parse_args()
    if args.baseline is not None and not (args.baseline / "watchdog" / "gpu_watchdog").is_dir():
        ap.error(f"--baseline {args.baseline}: no watchdog/gpu_watchdog there (make one with git worktree add)")

    counter = itertools.count(100)

    def moving_report() -> str:  # a running job: every rank one AllReduce further at each query
        n = next(counter)
        return report_json([Comm(0xBEEF, 4, [Rank(r, host="127.0.0.1", pid=100 + r, counts={"AllReduce": n})
                                             for r in range(4)])])

    base = Path(tempfile.mkdtemp(prefix="gw-bench-", dir="/tmp"))
    env = {**os.environ, "GPU_WATCHDOG_JOB_ID": "bench-overhead"}
    configs_n = 3 + (args.baseline is not None)
    # enough steps for every window (a step takes 0.3 s of compute plus its all-reduce: half again as many)
    steps = int(1.5 * (args.rounds * configs_n * (args.window + args.warmup + 5) + 60) / 0.3)
    job = subprocess.Popen([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "4",
                            str(REPO / "tests" / "jobs" / "train.py"), "--scenario", "healthy", "--steps", str(steps),
                            "--step-s", "0.3", "--workdir", str(base)], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    names = ("stragglers off, no RAS", "stragglers on, no RAS", "stragglers on, RAS every 2 s",
             "stacks only (no signal), no RAS")
    results: dict[str, list[float]] = {n: [] for n in names}
    baseline = f"baseline {args.baseline.name}" if args.baseline is not None else None
    if baseline:
        results[baseline] = []
    try:
        with RasStandIn(source=moving_report) as ras:
            configs = {names[0]: daemon_config(base, "bare", ras.addr, 0.0, stragglers=False),
                       names[1]: daemon_config(base, "off", ras.addr, 0.0),
                       names[2]: daemon_config(base, "on", ras.addr, 2.0),
                       names[3]: daemon_config(base, "stacks", ras.addr, 0.0, signals=False)}
            if baseline:
                configs[baseline] = baseline_config(base)
            time.sleep(10)  # the job's ranks are up and training
            print(f"daemon CPU, % of one core, {args.window:g} s windows ({os.cpu_count()} cores; a healthy 4-rank "
                  "torchrun job, 0.3 s steps)")
            for rnd in range(args.rounds):
                for name, cfg in configs.items():
                    if job.poll() is not None:
                        raise RuntimeError(f"the job exited {job.returncode} early")
                    before = ras.connections
                    pct = measure(cfg, args.warmup, args.window, args.baseline if name == baseline else None)
                    results[name].append(pct)
                    print(f"  round {rnd + 1}  {name:<30} {pct:6.3f} %   RAS queries: {ras.connections - before}")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 15)
        job.wait(30)
    bare, off, on, stacks = (statistics.median(results[n]) for n in names)
    print(f"median: {names[0]} {bare:.3f} %, {names[1]} {off:.3f} % (+{off - bare:.3f}), {names[2]} {on:.3f} % "
          f"(+{on - off:.3f} for RAS), {names[3]} {stacks:.3f} % (the cheap signal: {off - stacks:+.3f}); goal ≤ 0.5 %")
    if baseline:
        old = statistics.median(results[baseline])
        print(f"median: {baseline} {old:.3f} %; this tree without RAS watch / {baseline}: {off / old:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
