"""The deadline watch (an ``evidence.source.JobWatch``): for every wait of a job — some ranks waiting on others —
that lasts ``detect.waiting_stack_interval_s`` (or half of ``waiting_timeout_s``), it learns the job's own deadline
once, off the tick (``sources``: a Flight Recorder dump asked for through the dump
FIFO where the ranks serve one, the in-job client's group timeouts, the backend's default), hands it to the
detector (``known``: the next ticks' ``step`` gets it, and a wait it governs is given until the deadline), and
warns once when the wait passes ``detect.deadline_warn_ratio`` of it: a ``deadline`` finding that says who waits in
what since when, on whom, what that rank does, the deadline and its source, the time left and the remedies.
Observe only: ``policy.respond`` records it; the job may still finish its wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

from gpu_watchdog.config.schema import Config
from gpu_watchdog.evidence.deadline import activity, sources
from gpu_watchdog.evidence.flight_recorder import dumps as fr
from gpu_watchdog.evidence.stacks.diagnosis import collective_waited_in
from gpu_watchdog.job.protocol import CONTROL_DIR_ENV, ControlDir
from gpu_watchdog.model import Deadline, Finding, JobState, JobStatus, NodeSample, rank_label

log = logging.getLogger("gpu_watchdog.deadline")

FR_WAIT_S = 10.0  # how long to wait for the dumps a wait asked for (the first dump of a process imports modules)


@dataclass
class _Wait:
    since: float  # the wait's start (JobStatus.waiting_since)
    learning: Future[Deadline] | None = None
    deadline: Deadline | None = None
    io_at_start: dict[int, activity.IoSnapshot | None] = field(default_factory=dict)  # waited-on rank → counters
    warned: bool = False


class DeadlineWatch:
    def __init__(self, cfg: Callable[[], Config], environ: Callable[[Mapping[int, int]], dict[str, str]] | None = None
                 ) -> None:
        self._cfg = cfg  # read each tick: a reload replaces the config
        self._environ = environ or fr.rank_environ
        self._waits: dict[str, _Wait] = {}
        self._pool: ThreadPoolExecutor | None = None  # its own worker: a dump it waits for never delays a hang's

    def known(self) -> dict[str, Deadline]:
        """The deadlines learnt for the jobs' current waits (the detector's ``deadlines``)."""
        out = {}
        for job_id, w in self._waits.items():
            self._collect(w)
            if w.deadline is not None:
                out[job_id] = w.deadline
        return out

    def watch(self, jobs: Mapping[str, JobStatus], sample: NodeSample) -> list[Finding]:
        out = []
        for js in jobs.values():
            if js.state != JobState.WAITING or js.waiting_since is None or not js.rank_pids:
                self._waits.pop(js.job_id, None)  # the wait ended (or became a stall): the next one learns anew
                continue
            w = self._waits.get(js.job_id)
            if (w is None or w.since != js.waiting_since) and sample.t - js.waiting_since < self._learn_after_s():
                continue  # a short wait (a rank a step behind) ends by itself: no dump asked, nothing read
            if w is None or w.since != js.waiting_since:
                w = self._waits[js.job_id] = _Wait(js.waiting_since)
                w.learning = self._worker().submit(self._learn, dict(js.rank_pids), js.waiting_since,
                                                   sources.backend_of(js.job_id, sample))
            for r in js.waiting_on:
                if r not in w.io_at_start and r in js.rank_pids:
                    w.io_at_start[r] = activity.snapshot(js.rank_pids[r], sample.t)
            self._collect(w)
            finding = self._warning(js, w, sample)
            if finding is not None:
                out.append(finding)
        return out

    def _learn_after_s(self) -> float:
        """How long a wait lasts before its deadline is learnt: long enough that the waits of a healthy job (a rank
        a step behind) ask nothing, and well before ``waiting_timeout_s``, the earliest the deadline matters."""
        d = self._cfg().detect
        return min(d.waiting_stack_interval_s, d.waiting_timeout_s / 2)

    def forget(self, job_id: str) -> None:
        self._waits.pop(job_id, None)

    def jobs(self) -> set[str]:
        return set(self._waits)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deadline")
        return self._pool

    @staticmethod
    def _collect(w: _Wait) -> None:
        fut = w.learning
        if fut is None or not fut.done():
            return
        w.learning = None
        try:
            w.deadline = fut.result()
        except Exception as e:  # a failed read is an unknown deadline, never a crash
            log.warning("cannot learn the job's deadline: %s", e)
            w.deadline = sources.unknown([f"reading failed: {e}"])

    def _learn(self, rank_pids: Mapping[int, int], since: float, backend: str | None) -> Deadline:
        """The job's deadline for the wait that began at ``since``, from the first source that tells it."""
        env = self._environ(rank_pids)
        tried = []
        from_fr = self._from_flight_recorder(env, rank_pids, since)
        tried.append("no Flight Recorder dump of this wait with a pending collective")
        control = env.get(CONTROL_DIR_ENV)
        from_client = sources.from_client(ControlDir(control).groups()) if control else None
        tried.append("no in-job client reported its groups" if control else "no in-job client")
        default = sources.backend_default(backend)
        tried.append(f"backend {backend or 'not known'}")
        return sources.first_known(from_fr, from_client, default, tried=tried)

    def _from_flight_recorder(self, env: Mapping[str, str], rank_pids: Mapping[int, int],
                              since: float) -> Deadline | None:
        settings = fr.fr_settings(env)
        if settings is None:
            return None
        asked_at = time.time()
        if self._cfg().flight_recorder.dump_on_suspect and fr.trigger_dumps(settings, sorted(rank_pids)):
            end = time.monotonic() + FR_WAIT_S
            while time.monotonic() < end and not fr.dumped_since(settings, rank_pids, asked_at):
                time.sleep(0.2)
        traces = fr.load_traces((settings.dump_path(r) for r in rank_pids), since)  # not an earlier wait's
        return sources.from_flight_recorder(traces, since)

    def _warning(self, js: JobStatus, w: _Wait, sample: NodeSample) -> Finding | None:
        """The ``deadline`` finding once the governed wait passed the warning share of its deadline."""
        d = js.deadline  # the detector's: the deadline governs this wait (it is in communication)
        if w.warned or d is None or d.timeout_s is None or js.waiting_since is None:
            return None
        start = d.started_at if d.started_at is not None else js.waiting_since
        if sample.t - start < self._cfg().detect.deadline_warn_ratio * d.timeout_s:
            return None
        w.warned = True
        return deadline_finding(js, d, sample, {r: activity.describe(w.io_at_start.get(r), activity.snapshot(
            js.rank_pids[r], sample.t)) for r in js.waiting_on if r in js.rank_pids})


def deadline_finding(js: JobStatus, d: Deadline, sample: NodeSample, io: Mapping[int, str]) -> Finding:
    """The warning: who waits in what since when, on whom doing what, the deadline, its source, the time left and
    the remedies that fit what the waited-on ranks do (the incident's ``deadline`` section)."""
    assert js.waiting_since is not None and d.timeout_s is not None
    start = d.started_at if d.started_at is not None else js.waiting_since
    due = start + d.timeout_s
    waiting = tuple(r for r in js.ranks if r not in js.waiting_on)
    collective = d.collective or collective_waited_in(js.waiting_on, js.evidence) or "a collective"
    doing = "; ".join(f"{rank_label(r)}: {text}" for r, text in sorted(io.items()) if text)
    on = ", ".join(rank_label(r) for r in js.waiting_on) or "other ranks"
    what = ", ".join(part for part in (js.waiting_doing, doing) if part)
    remedies = remedies_for(js.waiting_doing, bool(doing and "writing" in doing), bool(doing and "reading" in doing))
    detail = (f"ranks {_ranks(waiting)} wait in {collective} since {_clock(js.waiting_since)} "
              f"({sample.t - js.waiting_since:.0f} s) on {on}" + (f" ({what})" if what else "")
              + f"; the job's own deadline is {d.timeout_s:.0f} s ({d.source}: {d.detail}): it times out at "
              f"{_clock(due)}, in {max(0.0, due - sample.t):.0f} s. Remedies: " + "; ".join(remedies))
    facts: dict[str, object] = {
        **d.to_json(), "due_at": due, "left_s": round(max(0.0, due - sample.t), 1),
        "waiting_since": js.waiting_since, "waiting_ranks": list(waiting), "waiting_in": collective,
        "waited_on": list(js.waiting_on), "doing": js.waiting_doing,
        "activity": {str(r): text for r, text in sorted(io.items()) if text}, "remedies": remedies,
    }
    return Finding("deadline", "collective_timeout_near", js.job_id, js.ranks, js.waiting_on, js.waiting_since,
                   sample.t, js.devices, detail, "deadline", facts)


def remedies_for(doing: str, writing: bool, reading: bool) -> list[str]:
    """What fixes a wait that runs into the job's own timeout, by what the waited-on rank does."""
    raise_timeout = ("raise the group timeout: init_process_group(timeout=timedelta(...)), or Hugging Face "
                     "TrainingArguments(ddp_timeout=...)")
    if writing or "io" in doing or "write" in doing or "save" in doing:
        return ["save outside a collective: from rank 0 with the others not waiting in a collective meanwhile, or "
                "with torch.distributed.checkpoint.async_save", "faster checkpoint storage", raise_timeout]
    if reading or "data" in doing or "read" in doing:
        return ["faster input: more DataLoader workers, data on local storage", raise_timeout]
    return ["give every rank the same work between collectives (an evaluation or generation on one rank "
            "only keeps the others waiting)", raise_timeout]


def _ranks(ranks: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks) or "?"


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S")


__all__ = ["DeadlineWatch", "deadline_finding", "remedies_for"]
