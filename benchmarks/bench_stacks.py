"""How long does dumping every rank of a hung job take, in parallel versus one by one?

    .venv/bin/python benchmarks/bench_stacks.py [--nproc 8] [--repeat 3] [--native]

Starts a real ``--scenario hang`` gloo job under torchrun, waits for the hang, then times
``dump_stacks`` over all rank pids with concurrency = nproc and with concurrency = 1. Prints the
median wall times, the ratio, and checks the diagnosis names rank 1. The job is always killed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gloo_jobs import start_job  # noqa: E402
from gpu_watchdog.evidence.stacks.classify import classify_threads  # noqa: E402
from gpu_watchdog.evidence.stacks.diagnosis import diagnose  # noqa: E402
from gpu_watchdog.evidence.stacks.dump import dump_stacks  # noqa: E402


def timed(pids: list[int], concurrency: int, native: bool) -> tuple[float, list]:
    t0 = time.monotonic()
    res = dump_stacks(pids, concurrency=concurrency, native=native, timeout_s=30)
    return time.monotonic() - t0, res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--native", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-stacks-") as tmp:
        t_start = time.monotonic()
        job = start_job("hang", nproc=args.nproc, extra_args=("--rank-at", "1"), tmp_path=Path(tmp))
        try:
            job.wait_event("hang_onset", timeout=180)
            rank_pids = job.wait_ranks(timeout=60)
            time.sleep(1.0)
            print(f"{args.nproc}-rank job hung after {time.monotonic() - t_start:.1f} s")
            ranks = sorted(rank_pids)
            pids = [rank_pids[r] for r in ranks]
            par: list[float] = []
            seq: list[float] = []
            per_pid: list[float] = []
            res: list = []
            for _ in range(args.repeat):
                dt, res = timed(pids, len(pids), args.native)
                par.append(dt)
                dt, res_seq = timed(pids, 1, args.native)
                seq.append(dt)
                per_pid.extend(r.elapsed_s for r in res_seq)
            bad = [r for r in res if not r.ok]
            if bad:
                print("failed dumps:", [(r.pid, r.outcome, r.detail) for r in bad])
                return 1
            stacks = [classify_threads(r.threads, rank, r.pid) for rank, r in zip(ranks, res, strict=True)]
            diag = diagnose([s for s in stacks if s is not None], world_size=args.nproc)
        finally:
            job.stop()
    p, s = statistics.median(par), statistics.median(seq)
    mode = "native" if args.native else "python"
    print(f"py-spy dump ({mode} frames) of {args.nproc} ranks, median of {args.repeat}:")
    print(f"  parallel   (concurrency {args.nproc}): {p * 1000:7.1f} ms   runs: {[round(x * 1000) for x in par]}")
    print(f"  sequential (concurrency 1):  {s * 1000:7.1f} ms   runs: {[round(x * 1000) for x in seq]}")
    print(f"  per pid (sequential):        {statistics.median(per_pid) * 1000:7.1f} ms median")
    print(f"  speed-up sequential/parallel: {s / p:.2f}x")
    print(f"diagnosis: culprit {diag.culprit_ranks}, {diag.reason}")
    return 0 if diag.culprit_ranks == (1,) else 1


if __name__ == "__main__":
    sys.exit(main())
