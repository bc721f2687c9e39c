"""How often a healthy gloo job that finished all its steps dies at exit, with the Flight Recorder variables the agent
exports (``launch``, the Slurm TaskProlog) and without them, side by side (issue 35 item 8; docs/evidence.md).

    .venv/bin/python benchmarks/bench_teardown_abort.py [--jobs N] [--program ddp_plain|lightning_ddp_spawn]

Each job is ``--nproc`` ranks of a zoo program (tests/zoo), started the way ``srun`` starts tasks (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` per process; ``lightning_ddp_spawn`` spawns its ranks itself and,
with ``--leave-group``, leaves each rank's group to interpreter exit as Lightning does), healthy,
a few steps. The two arms alternate job by job, so drift in the machine's load hits both alike. "with FR" adds what
``flight_recorder.recording_env`` gives a job (recording buffer, dump file prefix, NCCL's dump pipe prefix) in a fresh
directory per job. A job *died at teardown* when every rank logged its last step ("done") but some process exited
non-zero or by a signal (``terminate called without an active exception`` then SIGABRT is PyTorch's known one). Prints
each arm's count, rate and 95 % Wilson interval, and Fisher's exact test of the difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "watchdog"))
from gpu_watchdog.evidence.flight_recorder.dumps import recording_env  # noqa: E402

ZOO = REPO / "tests" / "zoo"
ARMS = ("without FR", "with FR")


@dataclass(frozen=True)
class JobRun:
    arm: str
    finished: bool  # every rank logged "done"
    codes: tuple[int, ...]  # every process's return code (negative: killed by that signal)
    terminate_called: bool  # "terminate called without an active exception" in its output

    @property
    def died_at_teardown(self) -> bool:
        return self.finished and any(c != 0 for c in self.codes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(arm: str, program: str, nproc: int, steps: int, base: Path) -> JobRun:
    work = Path(tempfile.mkdtemp(prefix="job-", dir=base))
    events = work / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR", "TORCH_NCCL"))}
    env.update(PYTHONPATH=str(ZOO), OMP_NUM_THREADS="1")
    if arm == "with FR":
        (work / "fr").mkdir()
        env.update(recording_env(env, 2000, work / "fr"))
    args = [str(ZOO / f"{program}.py"), "--variant", "healthy", "--steps", str(steps), "--step-s", "0.05",
            "--workdir", str(work), "--events", str(events)]
    if program == "lightning_ddp_spawn":
        # --leave-group: the group left to interpreter exit, as Lightning leaves it (the zoo's default destroys it)
        procs = [subprocess.Popen([sys.executable, *args, "--nproc", str(nproc), "--leave-group"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
    else:
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(nproc)]
    outputs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append(out.decode(errors="replace"))
        codes.append(p.returncode)
    done = set()
    if events.exists():
        for line in events.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "done":
                done.add(e["rank"])
    return JobRun(arm, done == set(range(nproc)), tuple(codes),
                  any("terminate called without an active exception" in o for o in outputs))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def fisher_two_sided(a: int, b: int, c: int, d: int) -> float:
    """Fisher's exact test for the 2×2 table [[a, b], [c, d]]: the probability of a table as extreme or more."""
    n1, n2, k = a + b, c + d, a + c

    def prob(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, k - x) / math.comb(n1 + n2, k)

    observed = prob(a)
    return min(1.0, sum(prob(x) for x in range(max(0, k - n2), min(k, n1) + 1) if prob(x) <= observed * (1 + 1e-9)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=200, help="jobs per arm")
    ap.add_argument("--program", default="ddp_plain", choices=("ddp_plain", "lightning_ddp_spawn"))
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=2, help="jobs at a time")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gw-teardown-", dir="/tmp"))
    order = [ARMS[i % 2] for i in range(2 * args.jobs)]  # alternating: drift hits both arms alike
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda arm: run_job(arm, args.program, args.nproc, args.steps, base), order))
    print(f"{args.program}, {args.nproc} gloo ranks, {args.steps} steps, {args.jobs} jobs per arm, "
          f"{args.parallel} at a time ({os.cpu_count()} cores, {time.monotonic() - t0:.0f} s)")
    counts = {}
    for arm in ARMS:
        mine = [r for r in runs if r.arm == arm]
        died = sum(r.died_at_teardown for r in mine)
        unfinished = sum(not r.finished for r in mine)
        lo, hi = wilson(died, len(mine))
        counts[arm] = (died, len(mine) - died)
        print(f"  {arm:<11} died at teardown {died:>3}/{len(mine)} = {100 * died / len(mine):5.2f} % "
              f"(95 % CI {100 * lo:.2f}-{100 * hi:.2f} %); 'terminate called' in "
              f"{sum(r.terminate_called for r in mine)}; did not finish {unfinished}; exit codes "
              f"{sorted({c for r in mine if r.died_at_teardown for c in r.codes if c})}")
    p = fisher_two_sided(*counts[ARMS[1]], *counts[ARMS[0]])
    print(f"Fisher's exact test, with vs without: p = {p:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
