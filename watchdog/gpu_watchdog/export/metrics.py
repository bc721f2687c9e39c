"""Prometheus metrics for the agent: a snapshot collector, counters and histograms on one registry.

Served by export/http.py (``/metrics`` via prometheus_client's WSGI app, default ``0.0.0.0:9408``, next to
dcgm-exporter's 9400); ``/healthz`` there answers from export/health.py's LoopHealth, not from here.
``gpu_watchdog_up`` is 0 while sampling fails (``set_up(False)``) until the next ``update()``.

A scrape never calls NVML or psutil: the sampling loop hands each tick's result to ``update()``, which
only stores references; the collector turns the latest snapshot into series when Prometheus asks
(``describe()`` is implemented, so registering queries nothing either).

Label conventions:
- GPU series carry dcgm-exporter's labels ``gpu`` (index), ``UUID`` and ``Hostname`` (dcgm spells it with a
  capital H), so ``on(UUID)`` joins with ``DCGM_FI_*`` series work. The model name is in
  ``gpu_watchdog_gpu_info{..., model_name}`` only: dcgm's ``modelName`` fails ``promtool check metrics``
  (camelCase) and would repeat on every series.
- Job series carry ``job_id`` (the ``job_id`` of incidents and JobStatus), never ``job``: Prometheus owns
  ``job`` (the scrape job) and would rename ours to ``exported_job``.
- Nothing has a pid label. Jobs exported per scrape are capped (``max_jobs``, stalled/suspect/waiting first),
  ranks per job too (``max_ranks``); what the caps drop is counted in ``gpu_watchdog_jobs_dropped`` /
  ``gpu_watchdog_ranks_dropped``. Free-form counter labels (kind, action, error class, ...) are capped too:
  values past the cap are counted under ``"other"``.

Series (alert rules: prometheus/alerts.yml; dashboard: grafana/dashboards/gpu-watchdog.json):
  per GPU {gpu, UUID, Hostname}: gpu_watchdog_gpu_utilization_ratio (0..1),
    _gpu_memory_controller_utilization_ratio (0..1), _gpu_memory_used_bytes, _gpu_memory_total_bytes,
    _gpu_power_watts, _gpu_pcie_link_bytes_per_second (each omitted when unknown), _gpu_stalled (0/1),
    _gpu_info{+model_name} (1)
  per job {job_id}: gpu_watchdog_job_state{state} (one-hot: running/suspect/stalled/waiting), _job_stalled,
    _job_ranks (ranks on this node), _job_fallback_level, _job_waiting_seconds, _rank_waited_on{rank},
    _job_config_info{digest}, _job_deadline_seconds{source} and _job_deadline_left_seconds (while the job's own
    collective timeout governs a wait), and from the straggler watch (jobs with >= 2 ranks sampled here)
    _rank_wait_share{rank}, _rank_straggler_score{rank}, _rank_straggler{rank} (wait share alone where the node has
    one rank of the job: the alert rules compare nodes)
  agent: gpu_watchdog_up, _last_sample_timestamp_seconds, _start_time_seconds, _build_info{version},
    _backend_info{backend}, _jobs_dropped, _ranks_dropped, process_* (own registry only)
  counters: gpu_watchdog_incidents_total{kind}, _actions_total{action,result}, _restarts_total{job_id},
    _pyspy_dumps_total{outcome}, _nvml_errors_total{error_class},
    _process_errors_total{error_class}, _gpu_faults_total{UUID,kind},
    _state_write_errors_total, _internal_errors_total{stage}, _gpu_seconds_saved_total (GPU-seconds between
    each recovery's stop and the job's own deadline: rank-seconds for a CPU job)
  histograms: gpu_watchdog_sample_duration_seconds, gpu_watchdog_detection_latency_seconds
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.process_collector import ProcessCollector

from gpu_watchdog import __version__
from gpu_watchdog.act.events import (
    ActEvent,
    ActionDone,
    GpuFaulted,
    IncidentOpened,
    JobRestarted,
    StacksDumped,
    StallConfirmed,
    TimeSaved,
)
from gpu_watchdog.atomic import write_errors
from gpu_watchdog.detect.states import JOB_STATES, STALLED, SUSPECT, WAITING
from gpu_watchdog.evidence.stacks.dump import OUTCOMES
from gpu_watchdog.model import JobStatus, NodeSample, SampleError

log = logging.getLogger(__name__)

# Label sets that read 0 from the first scrape, so increase() sees the first event.
INCIDENT_KINDS = ("stall", "gpu_fault", "config_mismatch", "rank_exited", "straggler", "deadline")
PYSPY_OUTCOMES = OUTCOMES  # py-spy dump outcomes; anything else counts as "other"
OVERFLOW = "other"  # label value for values past a cap
INTERNAL_ERROR_STAGES = ("tick", "act")  # the engine's tick after sampling; acting on a finding

SAMPLE_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DETECTION_LATENCY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0,
                             450.0, 600.0)

_STATE_ORDER = {STALLED: 0, SUSPECT: 1, WAITING: 2}  # exported first when over the job cap
_MAX_LABEL_LEN = 128


class _LabelCap:
    """Remembers up to ``limit`` distinct label values; later new values map to ``OVERFLOW``."""

    def __init__(self, limit: int, preset: Iterable[str] = ()) -> None:
        self._limit = limit
        self._seen: set[str] = set(preset)
        self._lock = threading.Lock()

    def __call__(self, value: object) -> str:
        v = str(value)[:_MAX_LABEL_LEN] or "unknown"
        with self._lock:
            if v in self._seen:
                return v
            if len(self._seen) < self._limit:
                self._seen.add(v)
                return v
        return OVERFLOW


@dataclass(frozen=True)
class _Snapshot:
    sample: NodeSample
    jobs: Mapping[str, JobStatus]
    fallback_levels: Mapping[str, int]


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


_GPU_LABELS = ("gpu", "UUID", "Hostname")
_GPU_GAUGES = (
    ("gpu_watchdog_gpu_utilization_ratio", "GPU utilization, 0..1 (proc backend: the rank's CPU share)"),
    # Next to it: the pair tells an NCCL spin (utilization 1, memory controller 0 on an H200) from work.
    ("gpu_watchdog_gpu_memory_controller_utilization_ratio", "share of time the GPU's memory was read or written, "
     "0..1 (NVML utilization.memory)"),
    ("gpu_watchdog_gpu_memory_used_bytes", "GPU memory used (proc backend: the rank's RSS)"),
    ("gpu_watchdog_gpu_memory_total_bytes", "GPU memory total"),
    ("gpu_watchdog_gpu_power_watts", "GPU power draw"),
    # Static like memory_total: what PCIe traffic (dcgm-exporter's DCGM_FI_PROF_PCIE_TX/RX_BYTES, bytes/s) is out of.
    ("gpu_watchdog_gpu_pcie_link_bytes_per_second", "what the GPU's PCIe link carries per direction (its maximum "
     "generation x width)"),
    ("gpu_watchdog_gpu_stalled", "1 while a job using this GPU is in state stalled"),
)
_GPU_INFO = ("gpu_watchdog_gpu_info", "one series per GPU (proc backend: per rank) with its model name, value 1")
_JOB_GAUGES = (
    ("gpu_watchdog_job_state", "1 for the job's current detector state (running/suspect/stalled/waiting)",
     ("job_id", "state")),
    ("gpu_watchdog_job_stalled", "1 while the job is in state stalled", ("job_id",)),
    ("gpu_watchdog_job_ranks", "ranks of the job seen on this node", ("job_id",)),
    ("gpu_watchdog_job_fallback_level", "NCCL fallback level the job runs with (0: none)", ("job_id",)),
    ("gpu_watchdog_job_waiting_seconds", "how long the job's ranks have been waiting on a few ranks (0: not "
     "waiting)", ("job_id",)),
    ("gpu_watchdog_rank_waited_on", "1 for each rank on this node the job's other ranks wait on",
     ("job_id", "rank")),
    ("gpu_watchdog_job_deadline_seconds", "the job's own timeout for the collective its ranks wait in (only while "
     "it governs a wait), by where it came from (flight_recorder/client/default)", ("job_id", "source")),
    ("gpu_watchdog_job_deadline_left_seconds", "seconds until the job's own collective timeout ends its current wait "
     "(only while one governs a wait; negative: past it)", ("job_id",)),
    ("gpu_watchdog_job_config_info", "digest of the job's launch config on this node (differs across nodes: "
     "mismatched config)", ("job_id", "digest")),
    ("gpu_watchdog_rank_wait_share", "share (0..1) of the rank's stack samples over the straggler window spent "
     "waiting on its peers (a collective or a device sync)", ("job_id", "rank")),
    ("gpu_watchdog_rank_straggler_score", "the median wait share of the rank's peers on this node minus its own, "
     "at least 0: how much of their time it costs them", ("job_id", "rank")),
    ("gpu_watchdog_rank_straggler", "1 while the agent names the rank its job's straggler (slow in every slice of "
     "the window), else 0", ("job_id", "rank")),
)
_AGENT_GAUGES = (
    ("gpu_watchdog_up", "1 while the agent runs and its sampling backend works, 0 when the last sample failed",
     ()),
    ("gpu_watchdog_last_sample_timestamp_seconds", "unix time of the last sample", ()),
    ("gpu_watchdog_start_time_seconds", "unix time the agent's metrics started", ()),
    ("gpu_watchdog_build_info", "gpu-watchdog version (value 1)", ("version",)),
    ("gpu_watchdog_backend_info", "sampling backend of the last sample (value 1)", ("backend",)),
    ("gpu_watchdog_jobs_dropped", "jobs left out of the last scrape by the max_jobs cap", ()),
    ("gpu_watchdog_ranks_dropped", "rank series left out of the last scrape by the max_ranks cap", ()),
)


def _add_deadline(fams: Mapping[str, GaugeMetricFamily], js: JobStatus, t: float) -> None:
    """The job's own deadline and the time left before it, while it governs the job's wait."""
    d = js.deadline
    due = d.due_at(js.waiting_since) if d is not None and js.waiting_since is not None else None
    if js.state != WAITING or d is None or d.timeout_s is None or due is None:
        return
    fams["gpu_watchdog_job_deadline_seconds"].add_metric([js.job_id, d.source], d.timeout_s)
    fams["gpu_watchdog_job_deadline_left_seconds"].add_metric([js.job_id], due - t)


class _SnapshotCollector:
    """Series from the latest snapshot. Registered on the registry; reads nothing but AgentMetrics' fields."""

    def __init__(self, owner: AgentMetrics) -> None:
        self._m = owner

    def describe(self) -> Iterator[Metric]:
        for name, doc in _GPU_GAUGES:
            yield _gauge(name, doc, _GPU_LABELS)
        yield _gauge(*_GPU_INFO, (*_GPU_LABELS, "model_name"))
        for name, doc, labels in (*_JOB_GAUGES, *_AGENT_GAUGES):
            yield _gauge(name, doc, labels)
        yield _state_write_errors()

    def collect(self) -> Iterator[Metric]:
        m = self._m
        snap = m._snapshot
        fams = {name: _gauge(name, doc, _GPU_LABELS) for name, doc in _GPU_GAUGES}
        info = fams[_GPU_INFO[0]] = _gauge(*_GPU_INFO, (*_GPU_LABELS, "model_name"))
        fams.update({name: _gauge(name, doc, labels) for name, doc, labels in (*_JOB_GAUGES, *_AGENT_GAUGES)})
        fams["gpu_watchdog_up"].add_metric([], 1.0 if m._up else 0.0)
        fams["gpu_watchdog_start_time_seconds"].add_metric([], m._started_at)
        fams["gpu_watchdog_build_info"].add_metric([m.version], 1.0)
        for job_id, digest in m.job_configs().items():
            fams["gpu_watchdog_job_config_info"].add_metric([job_id, digest], 1.0)
        jobs_dropped = ranks_dropped = 0
        if snap is not None:
            s = snap.sample
            fams["gpu_watchdog_last_sample_timestamp_seconds"].add_metric([], s.t)
            fams["gpu_watchdog_backend_info"].add_metric([s.backend], 1.0)
            stalled_uuids = {u for js in snap.jobs.values() if js.state == STALLED for u in js.devices}
            for d in s.devices:
                lv = [str(d.index), d.uuid, s.hostname]
                info.add_metric([*lv, "virtual" if d.virtual else d.name], 1.0)  # proc names hold a pid
                for name, value in (
                    ("gpu_watchdog_gpu_utilization_ratio",
                     None if d.util_percent is None else d.util_percent / 100.0),
                    ("gpu_watchdog_gpu_memory_controller_utilization_ratio",
                     None if d.mem_util_percent is None else d.mem_util_percent / 100.0),
                    ("gpu_watchdog_gpu_memory_used_bytes", d.mem_used_bytes),
                    ("gpu_watchdog_gpu_memory_total_bytes", d.mem_total_bytes),
                    ("gpu_watchdog_gpu_power_watts", d.power_w),
                    ("gpu_watchdog_gpu_pcie_link_bytes_per_second", d.pcie_link_bytes_per_s),
                    ("gpu_watchdog_gpu_stalled", 1.0 if d.uuid in stalled_uuids else 0.0),
                ):
                    if value is not None:
                        fams[name].add_metric(lv, float(value))
            ordered = sorted(snap.jobs.values(), key=lambda js: (_STATE_ORDER.get(js.state, 3), js.job_id))
            jobs_dropped = max(0, len(ordered) - m.max_jobs)
            for js in ordered[:m.max_jobs]:
                j = js.job_id
                for st in JOB_STATES:
                    fams["gpu_watchdog_job_state"].add_metric([j, st], 1.0 if js.state == st else 0.0)
                fams["gpu_watchdog_job_stalled"].add_metric([j], 1.0 if js.state == STALLED else 0.0)
                fams["gpu_watchdog_job_ranks"].add_metric([j], float(len(js.ranks)))
                fams["gpu_watchdog_job_fallback_level"].add_metric([j], float(snap.fallback_levels.get(j, 0)))
                waiting = js.state == WAITING and js.waiting_since is not None
                fams["gpu_watchdog_job_waiting_seconds"].add_metric(
                    [j], max(0.0, s.t - js.waiting_since) if waiting else 0.0)  # type: ignore[operator]
                _add_deadline(fams, js, s.t)
                if waiting:
                    on = sorted(js.waiting_on)
                    ranks_dropped += max(0, len(on) - m.max_ranks)
                    for r in on[:m.max_ranks]:
                        fams["gpu_watchdog_rank_waited_on"].add_metric([j, str(r)], 1.0)
        for job_id, ranks in m.rank_scores().items():
            ranks_dropped += max(0, len(ranks) - m.max_ranks)
            for rank, (wait, score, flagged) in sorted(ranks.items())[:m.max_ranks]:
                lv = [job_id, str(rank)]
                fams["gpu_watchdog_rank_wait_share"].add_metric(lv, wait)
                fams["gpu_watchdog_rank_straggler_score"].add_metric(lv, score)
                fams["gpu_watchdog_rank_straggler"].add_metric(lv, 1.0 if flagged else 0.0)
        fams["gpu_watchdog_jobs_dropped"].add_metric([], float(jobs_dropped))
        fams["gpu_watchdog_ranks_dropped"].add_metric([], float(ranks_dropped))
        yield from fams.values()
        errors = _state_write_errors()
        errors.add_metric([], float(write_errors()))
        yield errors


def _state_write_errors() -> CounterMetricFamily:
    return CounterMetricFamily("gpu_watchdog_state_write_errors", "state-dir writes that failed (full or read-only "
                               "state dir: incidents and levels kept in memory, the agent carries on)")


class AgentMetrics:
    """Everything the agent exports. Thread-safe: the loop calls the recording methods, HTTP threads scrape.

    The loop calls, per tick: ``update(sample, detector_state.jobs, fallback_levels)`` after the detector,
    ``sample_duration(s)``, ``nvml_errors(sample.errors)`` (update() does not count them), or
    ``set_up(False)`` when the backend's sample() raised. Events: ``incident(kind)``, ``action(name, ok)``,
    ``restart(job_id)``, ``pyspy_dump(outcome)``, ``gpu_fault(uuid, xid_or_kind)``,
    ``detection_latency(s)``, ``job_config(job_id, digest)`` / ``forget_job(job_id)``, and the straggler watch's
    ``straggler_scores(...)``.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, interval_s: float = 1.0,
                 max_jobs: int = 64, max_ranks: int = 64, process_metrics: bool | None = None,
                 version: str = __version__, clock: Callable[[], float] = time.time) -> None:
        """``interval_s``: the loop's tick period, kept for readers (the /healthz threshold lives in
        LoopHealth). ``process_metrics``: add prometheus_client's process_* collector (default: only when the
        registry is our own, since a shared registry may already have one)."""
        own = registry is None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.interval_s = interval_s
        self.max_jobs = max_jobs
        self.max_ranks = max_ranks
        self.version = version
        self._started_at = clock()
        self._snapshot: _Snapshot | None = None
        self._up = True
        self._lock = threading.Lock()
        self._job_config: dict[str, str] = {}
        self._rank_scores: dict[str, dict[int, tuple[float, float, bool]]] = {}
        r = self.registry
        self._incidents = Counter("gpu_watchdog_incidents", "incidents recorded, by kind", ["kind"], registry=r)
        self._actions = Counter("gpu_watchdog_actions", "recovery actions taken, by action and result (ok/failed)",
                                ["action", "result"], registry=r)
        self._restarts = Counter("gpu_watchdog_restarts", "job restarts done by the watchdog", ["job_id"],
                                 registry=r)
        self._pyspy = Counter("gpu_watchdog_pyspy_dumps", "py-spy stack dumps by outcome (failures: outcome != ok)",
                              ["outcome"], registry=r)
        self._gpu_seconds_saved = Counter("gpu_watchdog_gpu_seconds_saved", "GPU-seconds between each recovery's "
                                          "stop and the job's own collective deadline (known or PyTorch's default; "
                                          "rank-seconds for a CPU job)", registry=r)
        self._nvml_errors = Counter("gpu_watchdog_nvml_errors", "non-fatal NVML errors while sampling, by error "
                                    "class", ["error_class"], registry=r)
        self._process_errors = Counter("gpu_watchdog_process_errors", "non-fatal errors reading processes while "
                                       "sampling (psutil: AccessDenied; DuplicateRank), by error class",
                                       ["error_class"], registry=r)
        self._internal_errors = Counter("gpu_watchdog_internal_errors", "exceptions caught at a stage boundary (an "
                                        "agent bug): logged with the cause; the agent carried on", ["stage"],
                                        registry=r)
        for stage in INTERNAL_ERROR_STAGES:
            self._internal_errors.labels(stage)
        self._gpu_faults = Counter("gpu_watchdog_gpu_faults", "GPU faults seen (Xid, lost, reset required)",
                                   ["UUID", "kind"], registry=r)
        self._sample_duration = Histogram("gpu_watchdog_sample_duration_seconds", "time to take one sample",
                                          buckets=SAMPLE_DURATION_BUCKETS, registry=r)
        self._detection_latency = Histogram("gpu_watchdog_detection_latency_seconds",
                                            "from a stall's onset (last progress) to its confirmation",
                                            buckets=DETECTION_LATENCY_BUCKETS, registry=r)
        self._kind_cap = _LabelCap(16, INCIDENT_KINDS)
        self._action_cap = _LabelCap(32)
        self._job_cap = _LabelCap(max_jobs)
        self._outcome_cap = _LabelCap(len(PYSPY_OUTCOMES), PYSPY_OUTCOMES)
        self._error_cap = _LabelCap(32)
        self._fault_cap = _LabelCap(256)
        for kind in INCIDENT_KINDS:
            self._incidents.labels(kind)
        for outcome in PYSPY_OUTCOMES:
            self._pyspy.labels(outcome)
        r.register(_SnapshotCollector(self))
        if process_metrics if process_metrics is not None else own:
            ProcessCollector(registry=r)

    # -- per tick -------------------------------------------------------------------------------------
    def update(self, sample: NodeSample, jobs: Mapping[str, JobStatus],
               fallback_levels: Mapping[str, int] | None = None) -> None:
        """Store the latest tick for the collector (cheap: no series are built here)."""
        snap = _Snapshot(sample, dict(jobs), dict(fallback_levels or {}))
        for job_id in jobs:  # restarts{job_id} reads 0 from the job's first scrape on
            label = self._job_cap(job_id)
            if label != OVERFLOW:
                self._restarts.labels(label)
        self._snapshot = snap  # one reference swap: a scrape sees the old or the new snapshot, whole
        self._up = True

    def set_up(self, ok: bool) -> None:
        """``False`` when the backend failed to sample (gpu_watchdog_up 0); the next update() sets it back."""
        self._up = bool(ok)

    def sample_duration(self, seconds: float) -> None:
        self._sample_duration.observe(max(0.0, seconds))

    def nvml_errors(self, errors: Iterable[SampleError]) -> None:
        """Sampling errors, each counted where its name says: NVML's, or the process scan's."""
        for e in errors:
            counter = self._nvml_errors if e.from_nvml else self._process_errors
            counter.labels(self._error_cap(e.error_class)).inc()

    # -- events ---------------------------------------------------------------------------------------
    def count(self, event: ActEvent) -> None:
        """One of acting's events (act.events), counted by its type."""
        match event:
            case IncidentOpened(kind):
                self.incident(kind)
            case StallConfirmed(latency_s):
                self.detection_latency(latency_s)
            case ActionDone(action, ok):
                self.action(action, ok)
            case JobRestarted(job_id):
                self.restart(job_id)
            case StacksDumped(outcome):
                self.pyspy_dump(outcome)
            case GpuFaulted(gpu, cause):
                self.gpu_fault(gpu, cause)
            case TimeSaved(_, gpu_seconds):
                self.gpu_seconds_saved(gpu_seconds)

    def incident(self, kind: str) -> None:
        self._incidents.labels(self._kind_cap(kind)).inc()

    def action(self, action: str, ok: bool) -> None:
        self._actions.labels(self._action_cap(action), "ok" if ok else "failed").inc()

    def restart(self, job_id: str) -> None:
        self._restarts.labels(self._job_cap(job_id)).inc()

    def pyspy_dump(self, outcome: str) -> None:
        self._pyspy.labels(self._outcome_cap(outcome)).inc()

    def internal_error(self, stage: str) -> None:
        self._internal_errors.labels(stage if stage in INTERNAL_ERROR_STAGES else OVERFLOW).inc()

    def gpu_fault(self, uuid: str, xid_or_kind: int | str) -> None:
        """Count a fault on GPU ``uuid``: an Xid number (kind ``xid_79``) or a kind (``gpu_lost``, ...)."""
        kind = f"xid_{xid_or_kind}" if isinstance(xid_or_kind, int) else str(xid_or_kind)
        key = self._fault_cap(f"{uuid}\0{kind}")
        u, k = key.split("\0", 1) if key != OVERFLOW else (OVERFLOW, OVERFLOW)
        self._gpu_faults.labels(u, k).inc()

    def gpu_seconds_saved(self, gpu_seconds: float) -> None:
        """GPU-seconds (rank-seconds on a CPU job) between a recovery's stop and the job's own deadline."""
        self._gpu_seconds_saved.inc(max(0.0, gpu_seconds))

    def detection_latency(self, seconds: float) -> None:
        self._detection_latency.observe(max(0.0, seconds))

    def job_config(self, job_id: str, digest: str) -> None:
        """Export ``gpu_watchdog_job_config_info{job_id, digest} 1`` (replaces the job's previous digest)."""
        with self._lock:
            if job_id not in self._job_config and len(self._job_config) >= self.max_jobs:
                log.warning("metrics: more than %d jobs with a config digest; not exporting %s's",
                            self.max_jobs, job_id)
                return
            self._job_config[job_id] = str(digest)[:_MAX_LABEL_LEN]

    def forget_job(self, job_id: str) -> None:
        """The job ended for good: drop its config digest and rank scores (its counters stay, as counters do)."""
        with self._lock:
            self._job_config.pop(job_id, None)
            self._rank_scores.pop(job_id, None)

    def straggler_scores(self, scores: Mapping[str, Mapping[int, tuple[float, float, bool]]]) -> None:
        """Per job, rank → (wait share, straggler score, named the straggler): replaces every job's previous ones
        (a job no longer sampled drops out)."""
        kept = dict(list(scores.items())[:self.max_jobs])
        with self._lock:
            self._rank_scores = {j: dict(r) for j, r in kept.items()}

    def rank_scores(self) -> dict[str, dict[int, tuple[float, float, bool]]]:
        with self._lock:
            return dict(self._rank_scores)

    def job_configs(self) -> dict[str, str]:
        with self._lock:
            return dict(self._job_config)

    # -- exposition -----------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of the registry (what /metrics serves to a plain client)."""
        return generate_latest(self.registry)
