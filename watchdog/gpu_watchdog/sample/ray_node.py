"""What Ray itself says about the processes of a Ray node, read from /proc and Ray's own node-local files: no Ray
import, no dashboard, no connection to the cluster (checked against Ray 2.60; see docs/ray.md).

- **Ray's service processes** (GCS, raylet, dashboard and its agent, the runtime-env agent, log monitor, autoscaler
  monitor, the job supervisor of ``ray job submit``, idle and I/O workers, ``ray start --block`` itself) are told
  by their command line or process title. They are never ranks, never members of a job's process group, never
  signalled as one.
- **A Ray worker or driver** (a *core worker*) writes ``<session>/logs/python-core-{worker,driver}-<ID>_<PID>.log``
  and keeps it open: its fds name its session and worker id; the log's head names the port of its gRPC server
  (``worker server started, listening on port N``) and the actor it hosts: its id from the moment the raylet leases
  the worker for it (``Creating actor actor_id=…``), its ``__repr__`` once the actor's ``__init__`` returned (``Actor
  creation task finished, …, actor_id: …, actor_repr_name: …``). Ray's gRPC ports are Ray's traffic, not a process
  group's. The log outlives its worker: what a worker that died was is read from it afterwards (``reread``).
- **Ray Train's fault tolerance**: with ``RAY_TRAIN_ENABLE_STATE_TRACKING=1`` and the export API on for its runs
  (``RAY_enable_export_api_write_config=EXPORT_TRAIN_RUN,EXPORT_TRAIN_RUN_ATTEMPT``; ``launch`` sets both where the
  job leaves them unset) Ray Train's state actor writes each run's settings — ``failure_config.max_failures``
  among them — and each attempt (one per worker group started) to ``<session>/logs/export_events/
  event_EXPORT_TRAIN_STATE.log``.
- **Ray Train** (v2) writes one structured log per training worker, ``<session>/logs/train/
  ray-train-sys-worker-<ID>.log``, whose records carry the worker's ``world_rank``, ``local_rank``, ``node_rank``,
  ``actor_id`` and ``process`` (pid); its first record is the process group's set-up (``[rank=R, world_size=W]``).
  Ray Train sets ``RANK`` with ``os.environ[…]`` after the worker started, so ``/proc/PID/environ`` never shows it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

# Executables and scripts of Ray's own services (argv[0] basename / a script path's tail).
_SERVICE_BINARIES = ("gcs_server", "raylet", "plasma_store")
_SERVICE_SCRIPTS = ("ray/dashboard/dashboard.py", "ray/dashboard/agent.py", "ray/_private/log_monitor.py",
                    "ray/autoscaler/_private/monitor.py", "ray/_private/runtime_env/agent/main.py",
                    "ray/util/client/server/server.py")
_SERVICE_MODULES = ("ray.util.client.server",)
# A worker before it sets its ``ray::`` title (its first seconds, many more on a loaded host): Ray's, like an idle one.
_WORKER_SCRIPTS = ("ray/_private/workers/default_worker.py", "ray/_private/workers/setup_worker.py")
# Process titles (``ray::NAME`` or ``ray::NAME.method``) of Ray's own workers: agents, the job supervisor (the
# parent of a submitted driver), and workers that hold no actor or task of a job (idle, spilling objects).
_SERVICE_TITLES = ("DashboardAgent", "RuntimeEnvAgent", "JobSupervisor", "IDLE", "IDLE_SpillWorker",
                   "IDLE_RestoreWorker", "SpillWorker", "RestoreWorker", "DeleteWorker")
TITLE_PREFIX = "ray::"
TRAIN_WORKER_CLASS = "RayTrainWorker"  # the actor hosting a Ray Train worker (it logs its rank: train_rank)
_CORE_LOG = re.compile(r"(?P<logs>/.+)/python-core-(?P<kind>worker|driver)-(?P<wid>[0-9a-f]+)_(?P<pid>\d+)\.log")
_PORT = re.compile(r"(?:worker|driver) server started, listening on port (\d+)")
_CREATING = re.compile(r"Creating actor actor_id=([0-9a-f]+)")
_ACTOR = re.compile(r"Actor creation task finished, task_id: \S+, actor_id: ([0-9a-f]+), actor_repr_name: ?(.*)$")
_DECLARED_RANK = re.compile(r"\brank\s*[=:]\s*(\d+)\b")  # an actor's __repr__ that declares its rank
# Ray ending a worker on purpose (its actor killed, its owner gone, exit_actor()): never logged by one that died.
_INTENDED = re.compile(r"Disconnect, exit_type=(INTENDED_\w+), exit_detail=(.*?)(?:, has creation_task|$)")
_TAIL_BYTES = 64 * 1024  # where a long-lived worker's last lines are
_WHY_CHARS = 160
_WORLD = re.compile(r"\[rank=(\d+), world_size=(\d+)\]")
_HEAD_BYTES = 256 * 1024  # the lines wanted come within a worker's first second; a long-lived log is not read whole
_TRAIN_HEAD_LINES = 20


def title(cmdline: Sequence[str]) -> str:
    """The ``ray::…`` process title of a Ray worker (argv rewritten, padded with spaces), or ``""``."""
    first = (cmdline[0] if cmdline else "").strip()
    return first if first.startswith(TITLE_PREFIX) else ""


def actor_class(cmdline: Sequence[str]) -> str:
    """``RayTrainWorker`` from ``ray::RayTrainWorker.run_train_fn`` (a task's title names its function)."""
    name = title(cmdline)[len(TITLE_PREFIX):]
    return name.split(".", 1)[0].split(" ", 1)[0]


def starting(cmdline: Sequence[str]) -> bool:
    """A Ray worker that has not set its ``ray::`` title yet (``python …/default_worker.py …``)."""
    return not title(cmdline) and any(a.endswith(_WORKER_SCRIPTS) for a in cmdline[:4])


def idle(cmdline: Sequence[str]) -> bool:
    """An idle Ray worker (``ray::IDLE``, or one still starting): Ray's own until the raylet hands it an actor or a
    task, and renames it."""
    return actor_class(cmdline).startswith("IDLE") or starting(cmdline)


def is_service(cmdline: Sequence[str]) -> bool:
    """A process of Ray itself (see the module docstring), never a rank of a job."""
    if not cmdline:
        return False
    if starting(cmdline):
        return True
    if title(cmdline):
        return actor_class(cmdline) in _SERVICE_TITLES
    argv = [a for a in cmdline[:4] if a]
    if argv and os.path.basename(argv[0]) in _SERVICE_BINARIES:
        return True
    for i, arg in enumerate(argv):
        if arg.endswith(_SERVICE_SCRIPTS):
            return True
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1].startswith(_SERVICE_MODULES):
            return True
        if os.path.basename(arg) == "ray" and argv[i + 1:i + 2] == ["start"]:
            return True  # ``ray start --block``: the node's processes end with it
    return False


@dataclass(frozen=True)
class TrainRank:
    """A Ray Train worker's place in its group, as Ray Train logged it."""

    world_rank: int
    local_rank: int | None
    node_rank: int | None
    world_size: int | None
    run_name: str


@dataclass(frozen=True)
class CoreWorker:
    """A Ray worker or driver process, as its own log describes it."""

    pid: int
    worker_id: str
    driver: bool
    logs_dir: str  # <session>/logs
    grpc_port: int | None = None
    actor_id: str = ""  # from the lease on
    actor_repr: str = ""
    train: TrainRank | None = None
    actor_created: bool = False  # the actor's __init__ returned (its __repr__, if it has one, is logged)
    ended_by_ray: str = ""  # read after its end (``reread``): why Ray ended it on purpose; "" when Ray did not

    @property
    def complete(self) -> bool:
        """Everything its log will ever tell is known: the port, and for a worker its actor, created."""
        return self.grpc_port is not None and (self.driver or self.actor_created)

    @property
    def log_path(self) -> str:
        return os.path.join(self.logs_dir, f"python-core-{'driver' if self.driver else 'worker'}-{self.worker_id}_"
                                           f"{self.pid}.log")

    def rank(self) -> tuple[int, str] | None:
        """The rank Ray's records give this worker, and which record: Ray Train's of its worker, else the rank its
        actor's ``__repr__`` declares (``rank=N``, as Ray's docs advise for telling actors apart); None without."""
        if self.train is not None:
            return self.train.world_rank, "Ray Train's record of its worker"
        m = _DECLARED_RANK.search(self.actor_repr)
        return (int(m.group(1)), "its actor's __repr__ in Ray's log") if m else None


def _core_log(pid: int, fd_targets: Sequence[str]) -> re.Match[str] | None:
    for target in fd_targets:
        m = _CORE_LOG.fullmatch(target)
        if m is not None and int(m.group("pid")) == pid:
            return m
    return None


def _head_lines(path: str, max_bytes: int = _HEAD_BYTES) -> list[str]:
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes)
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()


def _tail_lines(path: str, max_bytes: int = _TAIL_BYTES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            data = f.read(max_bytes)
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()


def train_rank(logs_dir: str, worker_id: str, pid: int) -> TrainRank | None:
    """The Ray Train rank of worker ``worker_id`` (pid ``pid``) from Ray Train's structured log, or None when the
    worker is not a Ray Train worker (no such log, or no record of this pid with a ``world_rank``)."""
    path = os.path.join(logs_dir, "train", f"ray-train-sys-worker-{worker_id}.log")
    for line in _head_lines(path)[:_TRAIN_HEAD_LINES]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("process") != pid or not isinstance(rec.get("world_rank"), int):
            continue
        m = _WORLD.search(str(rec.get("message") or ""))
        return TrainRank(world_rank=rec["world_rank"], local_rank=_opt_int(rec.get("local_rank")),
                         node_rank=_opt_int(rec.get("node_rank")), world_size=int(m.group(2)) if m else None,
                         run_name=str(rec.get("run_name") or ""))
    return None


TRAIN_STATE_ENV = {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1",
                   "RAY_enable_export_api_write_config": "EXPORT_TRAIN_RUN,EXPORT_TRAIN_RUN_ATTEMPT"}


@dataclass(frozen=True)
class TrainFaultTolerance:
    """A Ray Train run's ``FailureConfig`` and how much of it is used."""

    run_name: str
    max_failures: int  # -1: unlimited
    attempts: int  # worker groups started so far (the first included)

    @property
    def restarts_left(self) -> bool:
        return self.max_failures < 0 or self.attempts - 1 < self.max_failures

    def describe(self) -> str:
        limit = "unlimited" if self.max_failures < 0 else str(self.max_failures)
        return (f"Ray Train run {self.run_name}: FailureConfig(max_failures={limit}), "
                f"{max(self.attempts - 1, 0)} used")


def train_fault_tolerance(logs_dir: str, run_name: str) -> TrainFaultTolerance | None:
    """The fault tolerance of Ray Train run ``run_name`` from its state actor's export events on this node; None
    when they are not there (state tracking or the export API off, the state actor on another node)."""
    path = os.path.join(logs_dir, "export_events", "event_EXPORT_TRAIN_STATE.log")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    run_id, max_failures, attempts = None, None, set()
    records = []
    for line in lines:
        try:
            data = json.loads(line).get("event_data")
        except (ValueError, AttributeError):
            continue
        if isinstance(data, dict):
            records.append(data)
    for data in records:
        if data.get("name") == run_name and isinstance(data.get("run_settings"), dict):
            run_id = data.get("id")
            failure = ((data["run_settings"].get("run_config") or {}).get("failure_config") or {})
            max_failures = _opt_int(failure.get("max_failures"))
    if run_id is None or max_failures is None:
        return None
    attempts = {d.get("attempt_id") for d in records if d.get("run_id") == run_id and d.get("attempt_id")}
    return TrainFaultTolerance(run_name, max_failures, len(attempts))


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def core_worker(pid: int, fd_targets: Sequence[str]) -> CoreWorker | None:
    """The Ray core worker ``pid`` is (``fd_targets``: what its fds point at), from its own log; None when it is
    not one (no core-worker log open)."""
    m = _core_log(pid, fd_targets)
    if m is None:
        return None
    return _read_log(CoreWorker(pid=pid, worker_id=m.group("wid"), driver=m.group("kind") == "driver",
                                logs_dir=m.group("logs")))


def reread(worker: CoreWorker) -> CoreWorker:
    """``worker`` as its log and Ray Train's tell now, with whether Ray ended it on purpose (its log's last lines).
    Ray keeps a worker's logs after it ended, and writes some lines late (the actor's ``__repr__`` once ``__init__``
    returned, Ray Train's rank once the group is up): a worker that died before anyone read them is named by them."""
    w = _read_log(CoreWorker(pid=worker.pid, worker_id=worker.worker_id, driver=worker.driver,
                             logs_dir=worker.logs_dir))
    intended = next((m for line in reversed(_tail_lines(w.log_path)) if (m := _INTENDED.search(line))), None)
    if intended is None:
        return w
    why = f"{intended.group(1)}: {intended.group(2)}"
    return replace(w, ended_by_ray=why if len(why) <= _WHY_CHARS else why[:_WHY_CHARS - 3] + "...")


def _read_log(w: CoreWorker) -> CoreWorker:
    port, actor_id, actor_repr, created = None, "", "", False
    for line in _head_lines(w.log_path):
        if port is None and (p := _PORT.search(line)):
            port = int(p.group(1))
        elif not actor_id and (c := _CREATING.search(line)):
            actor_id = c.group(1)
        elif not created and (a := _ACTOR.search(line)):
            actor_id, actor_repr, created = a.group(1), a.group(2).strip(), True
        if port is not None and created:
            break
    train = None if w.driver else train_rank(w.logs_dir, w.worker_id, w.pid)
    return replace(w, grpc_port=port, actor_id=actor_id, actor_repr=actor_repr, actor_created=created, train=train)


def describe(pid: int, cmdline: Sequence[str], fd_targets: Sequence[str]) -> dict[str, object] | None:
    """What names a Ray worker in an incident (its rank may be unknown to everyone else): its actor's class, id and
    ``__repr__``, its worker id and title, its Ray Train run; None when ``pid`` is no Ray worker."""
    w = core_worker(pid, fd_targets)
    return describe_worker(w, cmdline) if w is not None and not w.driver else None


def describe_worker(w: CoreWorker, cmdline: Sequence[str]) -> dict[str, object]:
    """``describe`` of a worker already read (``cmdline``: its command line as last seen, a dead one's included)."""
    out: dict[str, object] = {"pid": w.pid, "title": title(cmdline), "actor_class": actor_class(cmdline),
                              "actor_id": w.actor_id, "worker_id": w.worker_id}
    if w.actor_repr:
        out["actor_repr"] = w.actor_repr
    if w.train is not None:
        out.update(train_run=w.train.run_name, world_rank=w.train.world_rank, local_rank=w.train.local_rank,
                   node_rank=w.train.node_rank)
    return out


__all__ = ["CoreWorker", "TITLE_PREFIX", "TRAIN_STATE_ENV", "TrainFaultTolerance", "TrainRank", "actor_class",
           "core_worker", "describe", "describe_worker", "idle", "is_service", "reread", "starting", "title",
           "train_fault_tolerance", "train_rank"]
