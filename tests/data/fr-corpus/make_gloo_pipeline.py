"""Regenerate tests/data/fr-corpus/gloo-pipeline/: real Flight Recorder dumps of a 3-stage gloo pipeline whose last
stage hangs in its own code before the job's third all_reduce (torch 2.13, CPU).

Each stage receives from the one before and sends to the one after, 3 times after each all_reduce: gloo counts
these sends and recvs in ``pg_status`` (op ids) but records none of them, so stages 0 and 1 wait in all_reduce #3 as
op ids 9 and 15 while stage 2 completed #2 as op 5 (tests/unit/evidence/test_fr_corpus.py). Every rank dumps
through the real FR API (``torch._C._distributed_c10d._dump_fr_trace()``) 12 s after the last stage stopped, from a
timer thread. Files::

    gloo-pipeline/trace_<rank>   the dumps as torch wrote them
    gloo-pipeline/case.json      {"culprit_ranks": [2], "dumped_at": {file: the dump's mtime}} (git keeps no mtimes)

Usage (from the repository root, ~20 s): .venv/bin/python tests/data/fr-corpus/make_gloo_pipeline.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "gloo-pipeline"
DUMP_AFTER_S = 12.0


def stage() -> None:
    import torch
    import torch.distributed as dist

    rank, world, out = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["FR_OUT"]
    dist.init_process_group("gloo")
    t = torch.ones(4)

    def dump() -> None:
        Path(out, f"trace_{rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace())
        os._exit(0)

    for _ in range(2):
        dist.all_reduce(t)
        for _ in range(3):
            if rank > 0:
                dist.recv(t, rank - 1)
            if rank < world - 1:
                dist.send(t, rank + 1)
    threading.Timer(DUMP_AFTER_S, dump).start()
    if rank == world - 1:
        time.sleep(600)  # the hang: the last stage never reaches all_reduce #3
    dist.all_reduce(t)
    time.sleep(600)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "FR_OUT": tmp, "TORCH_FR_BUFFER_SIZE": "200", "FR_STAGE": "1"}
        torchrun = Path(sys.executable).parent / "torchrun"
        subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "3", __file__], env=env, timeout=120,
                       check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        OUT.mkdir(exist_ok=True)
        dumped = {}
        for r in range(3):
            src, dst = Path(tmp, f"trace_{r}"), OUT / f"trace_{r}"
            dst.write_bytes(src.read_bytes())
            dumped[dst.name] = src.stat().st_mtime
    meta = {"culprit_ranks": [2], "dumped_at": dumped}
    (OUT / "case.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    stage() if os.environ.get("FR_STAGE") else main()
