"""What watching NCCL RAS costs the agent, per query and per core, against the job's size. Prints figures.

    .venv/bin/python benchmarks/bench_ras_watch.py [--quick]

The agent on rank 0's node asks NCCL RAS about each NCCL job every ``ras.watch_interval_s`` (2 s): one query is a
TCP connection to localhost:28028, the four-line handshake, the JSON report of every communicator of the whole
job (all nodes), its parsing and the comparison with the previous report (``evidence.nccl_ras.poll.comm_progress``).
Here a RAS stand-in in a child process (tests/support/ras_standin.py, NCCL's own report layout) serves reports
of a job with one world communicator plus one per node (8 ranks per node), so the agent's side is measured
alone: CPU seconds of this process (``time.process_time``) and wall time per query, for jobs of 2 ranks to
1,000 nodes. The last column is the agent's CPU at one query per ``watch_interval_s``.

What it cannot measure is NCCL's side: a RAS query makes the local NCCL process gather the counts from every
peer over RAS's own network; that cost lands in the job's processes and on its network (docs/nccl-ras.md gives
the paper estimate and why only rank 0's node watches).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from gpu_watchdog.evidence.nccl_ras.client import query, read_reply  # noqa: E402
from gpu_watchdog.evidence.nccl_ras.poll import comm_progress  # noqa: E402

SERVER = """
import sys, time
sys.path.insert(0, {support!r})
from ras_standin import Comm, Rank, RasStandIn, report_json
n = {ranks}
per_node = 8 if n >= 8 else n
def ranks(lo, hi, step):
    return [Rank(r, host=f"10.0.{{r // per_node // 250}}.{{r // per_node % 250}}", pid=1000 + r % per_node,
                 cuda_dev=r % per_node, counts={{"AllReduce": step, "AllGather": 3, "Broadcast": 4}})
            for r in range(lo, hi)]
reports = []
for step in range(100, 104):
    comms = [Comm(0xA0000 + 0, n, ranks(0, n, step))]
    comms += [Comm(0xB0000 + k, per_node, ranks(k * per_node, (k + 1) * per_node, step))
              for k in range(n // per_node)] if n > per_node else []
    reports.append(report_json(comms))
s = RasStandIn(reports * 10000).__enter__()
print(s.addr, len(reports[0]), flush=True)
time.sleep(3600)
"""


def measure(n_ranks: int, min_s: float, interval_s: float) -> tuple[int, float, float, float]:
    code = SERVER.format(support=str(REPO / "tests" / "support"), ranks=n_ranks)
    srv = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None
        addr, size = srv.stdout.readline().split()
        prev = read_reply(query(addr, 10.0))  # also the warm-up (imports, first connection)
        n, cpu0, wall0 = 0, time.process_time(), time.monotonic()
        while time.monotonic() - wall0 < min_s or n < 5:
            cur = read_reply(query(addr, 10.0))
            comm_progress("job", prev, cur, time.time())
            prev, n = cur, n + 1
        cpu, wall = (time.process_time() - cpu0) / n, (time.monotonic() - wall0) / n
        return int(size), cpu, wall, 100.0 * cpu / interval_s
    finally:
        srv.kill()
        srv.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter measurements (noisier)")
    ap.add_argument("--interval", type=float, default=2.0, help="ras.watch_interval_s for the last column")
    args = ap.parse_args()
    min_s = 1.0 if args.quick else 4.0
    print(f"RAS watch cost on this machine ({os.cpu_count()} cores), one query per {args.interval:g} s")
    print(f"{'job':>22} {'report KiB':>11} {'agent CPU ms/query':>19} {'wall ms/query':>14} {'% of a core':>12}")
    for label, n in (("2 ranks (1 node)", 2), ("16 ranks (2 nodes)", 16), ("128 ranks (16 nodes)", 128),
                     ("1024 ranks (128 nodes)", 1024), ("8000 ranks (1000 nodes)", 8000)):
        size, cpu, wall, pct = measure(n, min_s, args.interval)
        print(f"{label:>22} {size / 1024:>11.1f} {cpu * 1e3:>19.2f} {wall * 1e3:>14.2f} {pct:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
