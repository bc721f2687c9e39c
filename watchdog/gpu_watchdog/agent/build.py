"""The whole agent, made in one place for both hosts: the sampling backend, the engine on it, and the act stage's
context — complete when it is returned (the engine's RAS poller, recent samples and Flight Recorder dumps, the GPU
memory reader). What the hosts pass differs only in what they watch: ``launch`` the tree under itself, the daemon
the processes of its registered jobs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.schema import Config
from gpu_watchdog.detect.consistency import CONSISTENCY_ENV
from gpu_watchdog.engine.loop import Engine, Heartbeats
from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.model import NodeSample
from gpu_watchdog.sample.backends import Backend, choose_backend, gpu_memory_holders
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import IncidentStore
from gpu_watchdog.store.job_runs import JobRuns

log = logging.getLogger("gpu_watchdog.agent")


@dataclass(frozen=True)
class Agent:
    backend: Backend
    backend_why: str  # how the backend was chosen, one line ("auto" says what it picked and why)
    engine: Engine
    ctx: ActContext

    def close(self) -> None:
        self.backend.close()
        self.engine.close()


@dataclass(frozen=True)
class Watched:
    """What a host watches: ``launch`` the process tree under ``root_pid``, the daemon the processes ``extra_pids``
    returns (its registered jobs'), among which ``member_pool`` (the same, as of the last tick) are looked at for
    ranks set in code (mp.spawn); ``attribute`` names each process's job (the daemon's registry)."""

    root_pid: int | None = None
    extra_pids: Callable[[], tuple[int, ...]] | None = None
    member_pool: Callable[[], tuple[int, ...]] = tuple
    attribute: Callable[[NodeSample], NodeSample] | None = None


def build_agent(cfg: Config, host: str, watched: Watched, *, incidents: IncidentStore, fallback: FallbackStore,
                pool: Executor, health: LoopHealth, heartbeats: Heartbeats, say: Callable[[str], None],
                metrics: Any = None, backend: Backend | None = None, runs: JobRuns | None = None,
                on_dump_done: Callable[[], None] | None = None) -> Agent:
    """The agent on ``backend`` when one is given (tests, a recorded trace), else on the one ``agent.backend``
    chooses for this node."""
    if backend is None:
        backend, why = choose_backend(cfg.agent.backend, root_pid=watched.root_pid, hostname=host,
                                      extra_pids=watched.extra_pids, env_filter=CONSISTENCY_ENV, faults=cfg.faults,
                                      min_window_s=cfg.detect.progress_min_window_s,
                                      member_pool=watched.member_pool)
    else:
        why = f"{getattr(backend, 'name', 'given')} backend"
    extra = {"attribute": watched.attribute} if watched.attribute is not None else {}
    engine = Engine(cfg, backend, fallback, pool, health=health, metrics=metrics, heartbeats=heartbeats,
                    on_dump_done=on_dump_done, say=say, **extra)
    # An incident reuses the RAS polls made while the job was suspect, the Flight Recorder dumps asked for then,
    # and the ring of recent samples as its trace.
    ctx = ActContext(cfg, host, incidents, fallback, metrics, say, gpu_pids=gpu_memory_holders(backend),
                     ras=engine.ras, recent=engine.recent, runs=runs, fr_dumps=engine.fr_dumps)
    return Agent(backend, why, engine, ctx)
