"""The Flight Recorder at an incident (an ``evidence.source``): every rank is asked for a dump (NCCL's dump
pipe, or the in-job helper serving the same FIFO for gloo), the fresh dumps and the job's dump-on-timeout files are
copied into the incident's ``flight-recorder/`` and analyzed across every process group. Dumps the engine asked
for when the job turned suspect (``SuspectDumps``) count as fresh: only ranks without one are asked."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from gpu_watchdog.evidence.analyze import fr_dir
from gpu_watchdog.evidence.culprit import from_flight_recorder
from gpu_watchdog.evidence.flight_recorder import dumps as fr
from gpu_watchdog.evidence.flight_recorder.analysis import FrAnalysis, analyze_traces, rank_trace
from gpu_watchdog.evidence.source import Begin, Found, IncidentJob
from gpu_watchdog.evidence.waiting_groups import from_flight_recorder as groups_from_flight_recorder

FR_WAIT_S = 10.0  # how long to wait for the triggered ranks' dumps (the first one may import torch._dynamo)
NO_TRIGGER = "not available: no dump trigger (TORCH_NCCL_DEBUG_INFO_PIPE_FILE unset; gloo ranks have no dump pipe)"


class FlightRecorderAtIncident:
    action = "flight_recorder"

    def __init__(self, suspect_dumps: fr.SuspectDumps | None = None) -> None:
        self.suspect_dumps = suspect_dumps

    def gather(self, job: IncidentJob, begin: Begin) -> Found | None:
        """Nothing (no action) for a job that records no Flight Recorder or whose ranks serve no trigger."""
        env, started = _rank_env(job.rank_pids)
        settings = fr.fr_settings(env)
        if settings is None or fr.unserved(settings, job.rank_pids, started):
            return None
        begin("")
        try:
            files, triggered, when = self._collect(settings, job, started)
            traces = [rank_trace(fr.load_dump(f), rank, f.stat().st_mtime)
                      for f in files if (rank := fr.dump_rank(f)) is not None]
        except Exception as e:  # diagnostics must never block recovery; a bad dump is "no evidence"
            return Found(False, f"flight recorder: {e}")
        if not traces:
            if not triggered and not settings.pipe_prefix and not settings.dump_on_timeout:
                # FR records but nothing can ask it to dump (gloo has no dump pipe): not available, not a failure
                return Found(False, NO_TRIGGER, outcome="not_available")
            return Found(False, f"no dump collected, {len(triggered)} triggered")
        analysis = analyze_traces(traces, min_wait_s=0.0)  # the stall is confirmed: every wait counts
        # Who waits in which group, exact where the dumps tell it: it replaces what the ranks' frames told.
        waiting = [w.as_json() for w in groups_from_flight_recorder(analysis)]
        section = {"flight_recorder": _section(analysis), **({"waiting_groups": waiting} if waiting else {})}
        return Found(True, f"{len(files)} dump(s) collected, {len(triggered)} triggered{when}; {analysis.reason}",
                     verdict=from_flight_recorder(analysis), communication=_communication(analysis), section=section)

    def _collect(self, settings: fr.FrSettings, job: IncidentJob, started: float | None
                 ) -> tuple[list[Path], list[str], str]:
        """The dump files of this job's ranks written since they started (another job may share the default dump
        prefix), after asking the ranks without a suspect-time dump and waiting up to FR_WAIT_S for them."""
        suspect = self.suspect_dumps.asked_at(job.job_id) if self.suspect_dumps is not None and job.job_id else None
        asked_at = suspect[0] if suspect else time.time()
        ask = [r for r in sorted(job.rank_pids) if suspect is None or not fr.dumped_since(settings, {r: 0}, asked_at)]
        triggered = list(dict.fromkeys([*(suspect[1] if suspect else ()), *fr.trigger_dumps(settings, ask)]))
        when = f" (at suspect, {time.time() - suspect[0]:.0f}s earlier)" if suspect else ""
        deadline = time.monotonic() + (FR_WAIT_S if triggered else 0.0)
        while time.monotonic() < deadline and not fr.dumped_since(settings, job.rank_pids, asked_at):
            time.sleep(0.2)
        files = fr.collect_dumps(settings, fr_dir(job.incident_dir), ranks=sorted(job.rank_pids), newer_than=started)
        return files, triggered, when


def _communication(analysis: FrAnalysis) -> str:
    pending = [g for g in analysis.groups if g.kind != "in_progress"]
    if not pending:
        return ""
    return f"flight recorder: {len(pending)} process group(s) with pending collectives ({analysis.reason})"


def _section(analysis: FrAnalysis) -> dict[str, object]:
    return {"culprit_ranks": list(analysis.culprit_ranks), "reason": analysis.reason,
            "process_groups": [g.as_json() for g in analysis.groups], "ranks": list(analysis.ranks),
            "no_dump": list(analysis.no_dump), "versions": list(analysis.versions)}


def _rank_env(rank_pids: Mapping[int, int]) -> tuple[dict[str, str], float | None]:
    """The environment of one of the job's ranks (FR settings are job-wide) and the earliest rank start time (older
    dump files belong to an earlier run)."""
    env: dict[str, str] = {}
    started: list[float] = []
    for pid in rank_pids.values():
        try:
            p = psutil.Process(pid)
            started.append(p.create_time())
            env = env or p.environ()
        except Exception:
            continue
    return env, min(started) if started else None

