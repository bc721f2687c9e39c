"""The zoo's table: each program × variant under ``gpu-watchdog launch`` → detected after N s, culprit, collective,
action, NCCL change, false action. tests/zoo/test_zoo.py asserts the rows; this prints them all, slow variants
included (the tests keep what proves each rule).

    .venv/bin/python benchmarks/zoo.py [--variants poll,event_wait] [--waiting-timeout-s 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from zoo_runs import Row, data_service, run_variant  # noqa: E402

HEALTHY = ("healthy", "poll", "slow_reader", "slow_save", "eval", "straggler")
HANGS = ("event_wait", "lock", "recv", "subprocess_wait", "desync", "busy", "crash", "sigstop")
PROGRAMS = {"ddp_plain": HEALTHY + HANGS}


def _row(tmp: Path, program: str, variant: str, timeout_s: float) -> Row:
    cfg = {"detect": {"waiting_timeout_s": timeout_s}}
    args = ("--steps", "8", "--pause-s", "20")
    if variant in ("slow_reader", "recv"):
        with data_service(2.0, 10) as addr:
            return run_variant(tmp, program, variant, args=args, config=cfg, data_addr=addr)
    return run_variant(tmp, program, variant, args=args, config=cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="", help="comma-separated; default: all")
    p.add_argument("--waiting-timeout-s", type=float, default=30.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    want = set(filter(None, a.variants.split(",")))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for program, variants in PROGRAMS.items():
            for v in variants:
                if want and v not in want:
                    continue
                t0 = time.monotonic()
                row = _row(Path(tmp) / f"{program}-{v}", program, v, a.waiting_timeout_s)
                rows.append((row, time.monotonic() - t0))
    if a.json:
        print(json.dumps([r.as_json() for r, _ in rows], indent=1))
        return
    print(f"{'program':<10} {'variant':<16} {'detected':>8} {'culprit':<8} {'collective':<15} {'action':<9} "
          f"{'NCCL':<5} {'false action':<12} {'exit':>4} {'wall':>6}")
    for r, wall in rows:
        healthy = r.variant in HEALTHY
        print(f"{r.program:<10} {r.variant:<16} {_s(r.detected_after_s):>8} {_ranks(r.culprit):<8} "
              f"{(r.collective or '-'):<15} {r.verdict:<9} {'yes' if r.nccl_change else 'no':<5} "
              f"{'YES' if healthy and r.verdict == 'acted' else 'no':<12} {r.rc:>4} {wall:>5.0f}s")


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def _ranks(rs: tuple[int, ...]) -> str:
    return ",".join(map(str, rs)) or "-"


if __name__ == "__main__":
    main()
