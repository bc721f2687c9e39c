"""An incident whose culprit only the Flight Recorder can name: ``gpu-watchdog launch`` on a real 4-rank gloo job
with a 2x2 TP x DP layout (tests/jobs/groups.py --functional) hung in a TP sub-group by an op mismatch. Rank 1
runs all_gather where its TP peer runs all_reduce, then goes on; afterwards every rank sits in ``wait_tensor`` at
the same line, so the stacks cannot tell the ranks apart. The agent asks every rank for its FR dump (the in-job
FIFO helper, as NCCL's dump pipe), stores the dumps in the incident and names rank 1 from them.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from fr_jobs import GROUPS, fr_env
from gpu_watchdog.evidence.analyze import main_analyze
from launch_harness import REPO, base_env, read_events, start_launch, torchrun, write_config


@pytest.mark.slow
def test_sub_group_hang_with_identical_stacks_is_named_from_the_flight_recorder(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    fr.mkdir()
    events = tmp_path / "events.jsonl"
    job = ["timeout", "-s", "KILL", "240", torchrun(), "--standalone", "--nproc-per-node", "4", str(GROUPS),
           "--scenario", "mismatch", "--rank-at", "1", "--step-at", "2", "--steps", "50", "--events", str(events),
           "--functional"]
    cfg = write_config(tmp_path / "watchdog.toml", {"recovery": {"max_restarts": 0}})
    env = {**base_env(), **fr_env(fr), "PYTHONPATH": str(REPO / "watchdog")}  # the agent runs this tree's code
    run = start_launch(["--backend", "proc", "--config", str(cfg)], job, env=env,
                       tmp_path=tmp_path, job_id="t-fr-subgroup")
    try:
        rc = run.wait(200)
        out = run.output()
        (inc,) = run.incidents()
    finally:
        run.kill()
    assert rc == 75, out[-5000:]
    assert [e["rank"] for e in read_events(events) if e["event"] == "hang_onset"] == [1]
    assert inc["culprit_ranks"] == [1] and inc["culprit_evidence"] == "flight_recorder", (inc, out[-3000:])
    assert inc["groups"][0][1] == [0, 1, 2, 3] and len(inc["groups"]) == 1  # every stack alike
    assert inc["reason"].startswith("flight recorder: culprit rank 1") and "op mismatch" in inc["reason"]
    # an op mismatch is a desync: advice, no NCCL change; the collective is the one the FR saw stuck
    assert inc["desync"] is True and inc["collective"] == "all_reduce"
    assert inc["advice"].startswith("desync:"), inc["advice"]
    groups = inc["flight_recorder"]["process_groups"]
    assert any(g["kind"] == "mismatch" and g["members"] == [0, 1] and g["culprit_ranks"] == [1] for g in groups)
    fr_action = next(a for a in inc["actions"] if a["action"] == "flight_recorder")
    assert fr_action["ok"] and fr_action["detail"].startswith("4 dump(s) collected, 4 triggered")
    incident_dir = Path(inc["stacks_dir"]).parent
    dumps = sorted(p.name for p in (incident_dir / "flight-recorder").iterdir())
    assert dumps == ["fr-rank-0.pkl", "fr-rank-1.pkl", "fr-rank-2.pkl", "fr-rank-3.pkl"]
    text = io.StringIO()  # the stored incident reads back the same (every wait counts: the stall was confirmed)
    assert main_analyze([str(incident_dir)], as_json=False, out=text) == 0
    assert text.getvalue().startswith("culprit: rank 1\n") and "evidence: flight recorder" in text.getvalue()
