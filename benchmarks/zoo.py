"""The zoo's table: each program × variant under ``gpu-watchdog launch`` → detected after N s, culprit, collective,
action, NCCL change, false action. tests/zoo/test_zoo.py asserts the rows of ``zoo_runs.CASES``; this prints them
and the slow variants the tests leave out (EXTRA).

    .venv/bin/python benchmarks/zoo.py [--only ddp_plain,fsdp2-event_wait] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from zoo_runs import CASES, COMM_HANG, HEALTHY, OWN_TIMEOUT, SPAWNED, WAITING, Case, Row, run_case  # noqa: E402

MORE = ("ddp_activation_checkpointing", "ddp_autocast", "fsdp2_dcp", "zero_optimizer", "ddp_comm_hook",
        "ddp_join", "dcp_checkpoint", "ddp_no_sync", "ddp_unused", "dtensor_tp", "pipeline")
EXTRA = (
    Case("ddp_plain", "eval", HEALTHY, args=("--pause-s", "40")),
    Case("ddp_plain", "slow_save", HEALTHY, args=("--pause-s", "30")),
    Case("ddp_plain", "straggler", HEALTHY),
    Case("hf_trainer", "poll", HEALTHY, args=("--pause-s", "10")),
    Case("ddp_plain", "recv", COMM_HANG, (2,), data_service=True),
    Case("ddp_plain", "subprocess_wait", COMM_HANG, (2,)),
    Case("ddp_plain", "sigstop", COMM_HANG, (2,)),
    Case("ddp_plain", "crash", COMM_HANG, (2,), finishes=False),
    Case("dcp_checkpoint", "event_wait", COMM_HANG, (2,)),
    Case("compiled", "lock", COMM_HANG, (2,)),
    Case("ddp_plain", "desync", COMM_HANG, args=("--hang-runs", "9"), desync=True, finishes=False),
    *(Case(p, "poll", HEALTHY, args=("--pause-s", "10")) for p in MORE),
    *(Case(p, "event_wait", COMM_HANG, (2,)) for p in MORE),
    Case("tp_dp_groups", "poll", HEALTHY, args=("--pause-s", "10"), nproc=4),
    Case("ddp_join", "busy", OWN_TIMEOUT, (2,), waiting_timeout_s=20.0, pg_timeout_s=25.0, finishes=False),
    # a rank in D on a dead NFS mount: nothing visibly moves, so waiting_timeout_s stands, not the job's deadline
    Case("ddp_plain", "dstate", WAITING, (2,), waiting_timeout_s=20.0, still_max_s=5.0),
)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated program or program-variant names; default: all")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    want = set(filter(None, a.only.split(",")))
    rows: list[tuple[Case, Row, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate((*CASES, *SPAWNED, *EXTRA)):
            if want and case.program not in want and case.name not in want:
                continue
            t0 = time.monotonic()
            rows.append((case, run_case(Path(tmp) / f"{i}-{case.name}", case), time.monotonic() - t0))
    if a.json:
        print(json.dumps([r.as_json() for _, r, _ in rows], indent=1))
        return
    print(f"{'program':<18} {'variant':<16} {'expect':<8} {'detected':>8} {'culprit':<8} {'collective':<15} "
          f"{'action':<9} {'NCCL':<5} {'false action':<12} {'exit':>4} {'wall':>6}")
    for case, r, wall in rows:
        bound = case.pg_timeout_s if case.expect == OWN_TIMEOUT else case.waiting_timeout_s
        early = (r.detected_after_s or 0.0) < (bound or 600.0) - 1.0
        false_action = r.verdict == "acted" and (case.expect == HEALTHY or (case.expect != COMM_HANG and early))
        print(f"{r.program:<18} {r.variant:<16} {case.expect:<8} {_s(r.detected_after_s):>8} "
              f"{_ranks(r.culprit):<8} {(r.collective or '-'):<15} {r.verdict:<9} "
              f"{'yes' if r.nccl_change else 'no':<5} {'YES' if false_action else 'no':<12} {r.rc:>4} {wall:>5.0f}s")


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def _ranks(rs: tuple[int, ...]) -> str:
    return ",".join(map(str, rs)) or "-"


if __name__ == "__main__":
    main()
