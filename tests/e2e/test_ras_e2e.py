"""NCCL RAS in a real incident: ``gpu-watchdog launch`` on a real 4-rank torchrun job whose rank 2 hangs, with
``ras.enabled = on`` pointed at the stand-in RAS server (a gloo job has no RAS socket of its own). The stand-in
reports the job's world communicator with rank 2 one AllReduce behind; the incident names rank 2 from RAS,
keeps both raw reports in ``ras.json``, and — with watching off (``ras.watch_interval_s = 0``) — the stand-in was
asked nothing while the job ran healthy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_harness import base_env, read_events, start_launch, train_argv, write_config
from ras_standin import Comm, Rank, RasStandIn, report_json


@pytest.mark.slow
def test_a_hung_jobs_incident_names_the_rank_ras_shows_behind(tmp_path: Path) -> None:
    ranks = [Rank(r, pid=100 + r, cuda_dev=r, counts={"AllReduce": 12 if r != 2 else 11}) for r in range(4)]
    with RasStandIn([report_json([Comm(0xBEEF, 4, ranks)])]) as ras:
        config = write_config(tmp_path / "watchdog.toml", {
            "recovery": {"max_restarts": 0, "stop_grace_s": 5.0},
            # Not watched (watch_interval_s = 0): the stand-in serves one fixed report, which a watching agent would
            # read as frozen from the start; tests/e2e/test_nccl_standin.py watches counts that follow the job.
            "ras": {"enabled": "on", "addr": ras.addr, "timeout_s": 3.0, "confirm_gap_s": 0.5,
                    "watch_interval_s": 0.0}})
        job = train_argv(tmp_path / "events.jsonl", tmp_path, nproc=4, scenario="hang", rank_at=2, step_at=6,
                         step_s=0.2, steps=40)
        run = start_launch(["--backend", "proc", "--config", str(config)], job, env=base_env(), tmp_path=tmp_path,
                           job_id="t-ras")
        try:
            run.wait_for("the hang onset", lambda: any(e["event"] == "hang_onset"
                                                       for e in read_events(tmp_path / "events.jsonl")), 120)
            assert ras.connections == 0  # healthy until the hang: RAS never asked
            rc = run.wait(180)
            out = run.output()
            assert rc == 75, out[-5000:]  # max_restarts = 0: record, stop, give up
            (inc,) = run.incidents()
        finally:
            run.kill()
        assert ras.connections >= 2
    assert inc["ras_culprit_ranks"] == [2] and inc["ras_hung_communicators"] == 1, inc
    # the stacks tell rank 2 apart (blocked in a receive) and decide; RAS agrees: no disagreement (evidence.culprit)
    assert inc["culprit_ranks"] == [2] and inc["culprit_evidence"] == "stacks" and inc["evidence_disagreements"] == []
    action = next(a for a in inc["actions"] if a["action"] == "nccl_ras")
    assert action["ok"] and "culprit ranks 2" in action["detail"]
    evidence = json.loads((Path(inc["stacks_dir"]).parent / "ras.json").read_text())
    assert evidence["culprit_ranks"] == [2] and len(evidence["polls"]) == 2
    assert "NCCL RAS at" in out
