"""``gpu-watchdog demo``: a real hang on a CPU (gloo) job, found, proven with stacks and recovered.

Runs ``demo_job`` under torchrun (3 ranks) inside ``launch`` with the shipped default detection settings.
The first run hangs at a known step in a P2P receive; the watchdog confirms the stall, names the culprit
from the ranks' stacks, asks the job to checkpoint (the in-job client aborts the hung collective and saves),
stops it, restarts it with fallback level 1 (NCCL_P2P_DISABLE=1, NCCL_NVLS_ENABLE=0), and the job resumes
from its checkpoint and finishes. The job's output goes to ``job.log`` in the demo's directory; the console
tells the watchdog's story with the job's ``[job]`` lines and ends with a timeline and a verdict. No GPU, no
daemon.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO, cast

from gpu_watchdog.config.schema import Config
from gpu_watchdog.demo import train as demo_job
from gpu_watchdog.demo.console import StoryConsole
from gpu_watchdog.errors import MissingExtra
from gpu_watchdog.evidence.report import action_status
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
    """The job's hang (its ``hang_onset`` event) → restarted job past the hung step, from the job's own events."""
    onset = next((e["t"] for e in events if e["event"] == "hang_onset"), None)
    past = next((e["t"] for e in events if e["event"] == "step" and e["step"] == hang_at
                 and onset is not None and e["t"] > onset), None)
    return {"onset": onset, "recovered": past, "recovery_s": (past - onset) if onset and past else None}


def timeline(events: list[dict[str, Any]], incident: dict[str, Any] | None,
             suspect_after_s: float) -> list[tuple[float, str, str]]:
    """The story as (unix time, step, what), in time order: the job's own events (onset, resumed, finished) and the
    incident's (suspect, confirmed, stacks, culprit, checkpoint, stop, restart level)."""
    rows: list[tuple[float, str, str]] = []
    hang = next((e for e in events if e["event"] == "hang_onset"), None)
    if hang is not None:  # the job's own word; "onset" is the watchdog's (one onset per stall on the console)
        rows.append((hang["t"], "hang", f"rank {hang['rank']} waits in a P2P receive nobody sends (step "
                                        f"{hang['step']})"))
    if incident is not None:
        rows.append((incident["onset"], "onset", "the watchdog's onset: the last progress it saw"))
        rows.append((incident["onset"] + suspect_after_s, "suspect",
                     f"no rank progressing for {suspect_after_s:g}s"))
        rows.append((incident["detected_at"], "confirmed",
                     f"{incident['kind']} ({incident['signature']}): {incident.get('finding') or ''}".rstrip(": ")))
        culprit = ",".join(map(str, incident.get("culprit_ranks") or [])) or "?"
        for a in incident.get("actions") or []:
            done = a.get("done_at") or a["at"]
            if a["action"] == "dump_stacks":
                rows.append((done, "stacks", a["detail"]))
                rows.append((done, "culprit", str(incident.get("reason") or f"rank {culprit}")))
            elif a["action"] in ("checkpoint", "stop"):
                rows.append((done, a["action"], f"{action_status(a)}: {a['detail']}"))
            elif a["action"] == "restart":
                rows.append((a["at"], "restart", a["detail"]))
    resumed = next((e for e in events if e["event"] == "start" and e.get("restart") not in (None, "0")
                    and e.get("rank") == 0), None)
    if resumed is not None:
        rows.append((resumed["t"], "resumed", f"after step {resumed['step']}, NCCL_P2P_DISABLE="
                                              f"{resumed.get('nccl_p2p_disable') or '(unset)'}"))
    done = next((e for e in events if e["event"] == "done" and e.get("rank") == 0), None)
    if done is not None:
        rows.append((done["t"], "finished", f"all {done['step']} steps"))
    return sorted(rows, key=lambda r: r[0])


def verdict(rc: int, incidents: list[dict[str, Any]], tm: dict[str, float | None], hang_at: int) -> str:
    if rc != 0 or not incidents or tm["recovery_s"] is None:
        return f"verdict: NOT recovered (job exit code {rc}, {len(incidents)} incident(s))"
    inc = incidents[0]
    level = (inc.get("fallback") or {}).get("level")
    return (f"verdict: recovered. Stall confirmed {inc['detected_at'] - inc['onset']:.1f}s after its onset "
            f"({inc.get('reason')}), restarted at fallback level {level}, past step {hang_at} "
            f"{tm['recovery_s']:.0f}s after the hang, finished (exit 0)")


def run_demo(cfg: Config, out: Any = None, keep: str | None = None) -> int:
    """The story goes to ``out`` (default: stdout, so ``demo > out.txt`` keeps it); MissingExtra (exit 69, one line)
    without torch."""
    import importlib.util

    try:
        torch_missing = importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):
        torch_missing = True
    if torch_missing:
        raise MissingExtra("the demo runs a torch job: pip install 'gpu-watchdog[job]' (or torch) first")
    out = sys.stdout if out is None else out
    base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="gpu-watchdog-demo-"))
    workdir, state = base / "job", base / "state"
    workdir.mkdir(parents=True, exist_ok=True)
    hang_at = 12
    events_path = workdir / "events.jsonl"
    print(f"gpu-watchdog demo: a 3-rank gloo job (CPU) that hangs at step {hang_at} in a P2P receive while "
          "NCCL_P2P_DISABLE is unset (a stand-in for an NCCL P2P bug)", file=out, flush=True)
    t0 = time.monotonic()

    def progress() -> str:
        steps = [e for e in read_events(events_path) if e["event"] == "step"]
        last = steps[-1] if steps else None
        quiet = time.time() - last["t"] if last else 0.0
        return (f"  … {time.monotonic() - t0:4.0f}s, job at step {last['step'] if last else 0}"
                + (f", no step for {quiet:.0f}s" if quiet >= 2 else ""))

    with StoryConsole(out, progress) as console:
        launcher = Launcher(cfg, demo_command(workdir, hang_at=hang_at, extra=("--print-every", "10")),
                            state_dir=state, job_id="demo", out=cast(TextIO, console), job_output="story",
                            job_log=base / "job.log")
        rc = launcher.run()
    events = read_events(events_path)
    tm = timings(events, hang_at)
    incidents = IncidentStore(state).list()
    rows = timeline(events, incidents[0] if incidents else None, cfg.detect.suspect_after_s)
    zero = tm["onset"] or (rows[0][0] if rows else 0.0)
    print(f"timeline (seconds from the job's hang; total {time.monotonic() - t0:.0f}s):", file=out)
    for t, step, what in rows:
        print(f"  {t - zero:+6.1f}  {step:<10} {what}"[:160], file=out)
    print(verdict(rc, incidents, tm, hang_at), file=out)
    print(f"  incidents: gpu-watchdog incidents --state-dir {state}; job output: {base / 'job.log'}", file=out,
          flush=True)
    return rc
