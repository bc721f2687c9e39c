"""``gpu-watchdog demo``: a real hang on a CPU (gloo) job, found, proven with stacks and recovered.

Runs ``demo_job`` under torchrun (3 ranks) inside ``launch`` with the shipped default detection settings.
The first run hangs at a known step in a P2P receive; the watchdog confirms the stall, names the culprit
from the ranks' stacks, asks the job to checkpoint (the in-job client aborts the hung collective and saves),
stops it, restarts it with fallback level 1 (NCCL_P2P_DISABLE=1, NCCL_NVLS_ENABLE=0), and the job resumes
from its checkpoint and finishes. Prints the timings at the end. No GPU, no daemon.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_watchdog.config.schema import Config
from gpu_watchdog.demo import train as demo_job
from gpu_watchdog.launch.launcher import Launcher
from gpu_watchdog.store.incidents import IncidentStore


def demo_command(workdir: Path, nproc: int = 3, steps: int = 30, hang_at: int = 12,
                 client: bool = True, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           demo_job.__file__, "--ckpt-dir", str(workdir), "--events", str(workdir / "events.jsonl"),
           "--steps", str(steps), "--hang-at", str(hang_at)]
    if client:
        cmd.append("--client")
    return cmd + list(extra)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a job's ranks appended so far (``--events``); a torn last line is skipped, because the
    file is read while the ranks still write to it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def timings(events: list[dict[str, Any]], hang_at: int) -> dict[str, float | None]:
    """Onset → restarted job past the hung step, from the job's own events."""
    onset = next((e["t"] for e in events if e["event"] == "hang_onset"), None)
    past = next((e["t"] for e in events if e["event"] == "step" and e["step"] == hang_at
                 and onset is not None and e["t"] > onset), None)
    return {"onset": onset, "recovered": past, "recovery_s": (past - onset) if onset and past else None}


def run_demo(cfg: Config, out: Any = sys.stderr, keep: str | None = None) -> int:
    base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="gpu-watchdog-demo-"))
    workdir, state = base / "job", base / "state"
    workdir.mkdir(parents=True, exist_ok=True)
    hang_at = 12
    print(f"gpu-watchdog demo: a 3-rank gloo training job that hangs at step {hang_at} in a P2P receive "
          f"(work dir {base})", file=out, flush=True)
    t0 = time.time()
    launcher = Launcher(cfg, demo_command(workdir, hang_at=hang_at), state_dir=state, job_id="demo", out=out)
    rc = launcher.run()
    events = read_events(workdir / "events.jsonl")
    tm = timings(events, hang_at)
    incidents = IncidentStore(state).list()
    print("", file=out)
    print("gpu-watchdog demo: summary", file=out)
    for inc in incidents:
        lat = inc["detected_at"] - inc["onset"]
        print(f"  incident {inc['id']}: {inc['kind']} ({inc['signature']}), culprit ranks {inc['culprit_ranks']}, "
              f"collective {inc['collective']}; confirmed {lat:.1f}s after the onset", file=out)
        for a in inc["actions"]:
            print(f"    {a['action']}: {'ok' if a['ok'] else 'FAILED'} — {a['detail']}", file=out)
    if tm["onset"] is not None and incidents:
        print(f"  detection latency (true onset → confirmed): {incidents[0]['detected_at'] - tm['onset']:.1f}s",
              file=out)
    if tm["recovery_s"] is not None:
        print(f"  time to recovery (onset → restarted job past step {hang_at}): {tm['recovery_s']:.1f}s", file=out)
    print(f"  job exit code {rc}; total {time.time() - t0:.1f}s; incidents: "
          f"gpu-watchdog incidents --state-dir {state}", file=out)
    return rc
