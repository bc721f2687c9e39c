"""Regenerate tests/data/fr/: real Flight Recorder dumps of the 2x2 TP x DP gloo job (tests/jobs/groups.py).

Each case is one real 4-rank torchrun job hung (or not) in a sub-group; every rank's dump is taken through the real
FR API (``torch._C._distributed_c10d._dump_fr_trace()`` behind a FIFO, train.py's ``--fr-pipe`` helper) 12 s after
the fault, so the waiting ranks have waited longer than ``flight_recorder.analysis.DEFAULT_MIN_WAIT_S``. Files::

    tests/data/fr/<case>/trace_<rank>     the dumps, as torch wrote them (pickles, version 2.10 on torch 2.13)
    tests/data/fr/<case>/case.json        {"scenario", "rank_at", "culprit_ranks": the faulted ranks,
                                           "dumped_at": {file: the dump's mtime}}  (git keeps no mtimes)

Usage (from the repository root; ~40 s per case)::

    PYTHONPATH=watchdog .venv/bin/python tests/data/make_fr_dumps.py            # every case
    PYTHONPATH=watchdog .venv/bin/python tests/data/make_fr_dumps.py missing    # some
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))

# case: (scenario, faulted rank, the ranks analyze must name)
CASES: dict[str, tuple[str, int, list[int]]] = {
    "healthy": ("healthy", 1, []),
    "slow": ("slow", 1, []),
    "missing": ("missing", 1, [1]),
    "chain": ("chain", 3, [3]),
    "mismatch": ("mismatch", 1, [1]),
    "p2p": ("p2p", 2, [2]),
}


def make(case: str) -> None:
    from fr_jobs import take_group_dumps

    scenario, rank_at, culprits = CASES[case]
    out = HERE / "fr" / case
    with tempfile.TemporaryDirectory() as tmp:
        dumps = take_group_dumps(scenario, rank_at=rank_at, tmp_path=Path(tmp))
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for rank, src in sorted(dumps.items()):
            shutil.copy2(src, out / f"trace_{rank}")
    meta = {"scenario": scenario, "rank_at": rank_at, "culprit_ranks": culprits,
            "dumped_at": {p.name: p.stat().st_mtime for p in sorted(out.glob("trace_*"))}}
    (out / "case.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{case}: {len(dumps)} dumps")


if __name__ == "__main__":
    for c in sys.argv[1:] or list(CASES):
        make(c)
