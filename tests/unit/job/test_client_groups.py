"""The in-job client reports every process group's timeout (a real 2-rank torchrun gloo job): the deadline source
for jobs whose ranks serve no Flight Recorder dump (gloo has no dump pipe)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpu_watchdog.evidence.deadline.sources import from_client
from gpu_watchdog.job.protocol import CONTROL_DIR_ENV, ControlDir

JOB = r"""
import datetime, torch, torch.distributed as dist
from gpu_watchdog.job import Client
client = Client.from_env()
client.step(0)  # before init_process_group: nothing to report, never an error
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
with client.training():
    client.step(1)
    tp = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=120), group_desc="tp")
    client.step(2)  # a new group: reported again
    dist.all_reduce(torch.ones(1), group=tp)
    client.step(3)
dist.destroy_process_group()
"""


def test_the_client_reports_each_groups_timeout(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {**os.environ, CONTROL_DIR_ENV: str(control), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    groups = ControlDir(control).groups()
    assert sorted(groups) == [0, 1]
    for rank, report in groups.items():
        by_desc = {g["desc"]: g for g in report["groups"]}
        assert by_desc["default_pg"]["timeout_s"] == 900.0 and by_desc["default_pg"]["ranks"] == [0, 1]
        assert by_desc["tp"]["timeout_s"] == 120.0 and by_desc["tp"]["ranks"] == [0, 1]
        assert report["rank"] == rank
    deadline = from_client(groups)
    assert deadline is not None and deadline.timeout_s == 900.0
    assert "default_pg 15 min, tp 2 min" in deadline.detail
