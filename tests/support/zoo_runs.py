"""Run one zoo program × variant under ``gpu-watchdog launch`` and reduce what happened to one table row.

Shared by tests/zoo/test_zoo.py (which asserts each row) and benchmarks/zoo.py (which prints the table). The data
service the slow-reader variants read from runs as a process of its own, outside the job's tree, as a real one
would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpu_watchdog.store.incidents import IncidentStore
from launch_harness import REPO, base_env, read_events, start_launch, torchrun, write_config
from waiting import wait_for

ZOO = REPO / "tests" / "zoo"
HEALTHY, COMM_HANG, WAITING = "healthy", "hang", "waiting"  # what a case expects
# A wait in a collective on a rank that keeps working: the agent never acts before the job's own collective timeout,
# which ends the job; the crash incident names the rank its peers waited on (docs/deadline.md).
OWN_TIMEOUT = "own_timeout"


@dataclass(frozen=True)
class Case:
    """One zoo row: the program, its variant and what the judgement must be."""

    program: str
    variant: str
    expect: str  # HEALTHY: runs to the end, nothing acts; COMM_HANG: confirmed fast, acted on; WAITING: not before
    culprit: tuple[int, ...] = ()  # COMM_HANG / WAITING: the ranks to name (empty: don't check)
    args: tuple[str, ...] = ()
    waiting_timeout_s: float | None = None  # shortened where the case must reach it
    still_max_s: float | None = None  # detect.deadline_still_max_s, shortened with waiting_timeout_s where needed
    pg_timeout_s: float | None = None  # OWN_TIMEOUT: the job's own group timeout (init_process_group(timeout=))
    data_service: bool = False
    collective: str | None = None  # the waiting majority's collective, when the case pins it
    finishes: bool = True  # the restarted run completes
    desync: bool = False  # the incident must name a desync
    nproc: int = 3
    spawns: bool = False  # the program starts its ranks itself (mp.spawn): run with python, not torchrun
    # COMM_HANG: entries the first incident's ``waiting_groups`` must hold, each (waiting ranks, the group's ranks, its
    # description, the ranks waited for) — () and "" where the group is not known (a p2p partner alone)
    waiting_in: tuple[tuple[tuple[int, ...], tuple[int, ...], str, tuple[int, ...]], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.program}-{self.variant}"


_PAUSE = ("--pause-s", "16")
# The table the tests assert and benchmarks/zoo.py prints. Hang variants fire in the first run only (zoo_common
# --hang-runs), so a restarted run can finish.
CASES: tuple[Case, ...] = (
    Case("ddp_plain", "poll", HEALTHY, args=_PAUSE),
    Case("ddp_plain", "slow_reader", HEALTHY, data_service=True),
    Case("rl_generation", "slow_generation", HEALTHY, args=_PAUSE),
    Case("lightning_ddp", "poll", HEALTHY, args=("--pause-s", "10")),
    Case("compiled", "compile_warmup", HEALTHY),
    Case("ddp_plain", "event_wait", COMM_HANG, (2,), collective="ddp_all_reduce"),
    Case("ddp_no_sync", "lock", COMM_HANG, (2,), collective="ddp_all_reduce"),
    Case("ddp_unused", "recv", COMM_HANG, (2,), data_service=True),
    Case("fsdp2", "event_wait", COMM_HANG, (2,)),
    Case("dtensor_tp", "sigstop", COMM_HANG, (2,)),
    Case("pipeline", "subprocess_wait", COMM_HANG, (2,)),
    Case("dataloader_workers", "dead_worker", COMM_HANG, (2,)),  # peers in DDP's forward or backward: timing
    Case("rl_generation", "dead_worker", COMM_HANG, (2,)),
    Case("hf_trainer", "desync", COMM_HANG, desync=True),
    Case("lightning_ddp", "event_wait", COMM_HANG, (2,)),
    Case("manual_allreduce", "event_wait", COMM_HANG, (2,), collective="all_reduce"),
    Case("tp_dp_groups", "event_wait", COMM_HANG, (2,), nproc=4),
    # A 2-D DeviceMesh (dp x tp) whose ranks run the in-job client: rank 0 runs a TP all_gather its TP peer skips.
    # Each waiting rank's group is read from its frames (the client's report names the group's address): the desync
    # sits inside TP group {0,1}; the DP ranks wait in their DP groups on the TP pair.
    Case("mesh_2d", "desync", COMM_HANG, (0,), args=("--rank", "0"), desync=True, nproc=4,
         waiting_in=(((0,), (0, 1), "mesh_tp", (1,)), ((1,), (0, 1), "mesh_tp", (0,)),
                     ((2,), (0, 2), "mesh_dp", (0,)), ((3,), (1, 3), "mesh_dp", (1,)))),
    # The middle stage of a pipeline hangs: the next stage's receive names it as the partner it waits for (the first
    # stage waits on its forward sends in bulk, whose partner its frames do not hold: not named).
    Case("pipeline", "lock", COMM_HANG, (1,), args=("--rank", "1"), waiting_in=(((2,), (), "", (1,)),)),
    # Their healthy twins: a stage computing 12 s in its forward while its partners wait in p2p; a hot expert computing
    # 12 s while its peers wait in an all_to_all of uneven split sizes.
    Case("pipeline", "slow_stage", HEALTHY, args=("--rank", "1", "--pause-s", "12")),
    Case("moe_uneven", "slow_expert", HEALTHY, args=("--rank", "1", "--pause-s", "12")),
    # Endless compute in a rank while its peers wait in DDP's all-reduce: it visibly progresses (CPU), so only the
    # job's own timeout (25 s here) ends the wait; the agent does not act before it.
    Case("ddp_plain", "busy", OWN_TIMEOUT, (2,), waiting_timeout_s=20.0, pg_timeout_s=25.0, finishes=False),
    Case("ddp_plain", "poll", WAITING, args=("--pause-s", "600", "--hang-runs", "9"), waiting_timeout_s=20.0,
         finishes=False),
)
# Programs that hand each rank its rank in code (no RANK anywhere): the tutorial's mp.spawn, Lightning ddp_spawn.
SPAWNED: tuple[Case, ...] = (
    Case("spawn_ddp", "lock", COMM_HANG, (2,), collective="ddp_all_reduce", spawns=True),
    Case("spawn_ddp", "poll", HEALTHY, args=("--pause-s", "12"), spawns=True),
    Case("lightning_ddp_spawn", "lock", COMM_HANG, (2,), spawns=True),
    Case("lightning_ddp_spawn", "poll", HEALTHY, args=("--pause-s", "12"), spawns=True),
)
# Ray programs (a local ray.init() cluster under the driver): Ray Train's TorchTrainer, and an actor group that forms
# its own process group (the RLHF frameworks' shape). Their ranks come from Ray's own records (docs/ray.md).
RAY: tuple[Case, ...] = (
    # The hang after steady training (step 12): one in a job's first second can be confirmed a waiting interval
    # later (docs/detection-latency.md).
    Case("ray_train_ddp", "event_wait", COMM_HANG, (1,), collective="ddp_all_reduce", nproc=2, spawns=True,
         args=("--rank", "1", "--steps", "16", "--hang-step", "12")),
    Case("ray_train_ddp", "slow_save", HEALTHY, nproc=2, spawns=True, args=("--pause-s", "12")),
    # 2 ranks in different collectives (broadcast vs all_gather): the desync is named, neither side is the odd one.
    Case("ray_actor_group", "desync", COMM_HANG, nproc=2, spawns=True, desync=True, args=("--rank", "1")),
    Case("ray_actor_group", "poll", HEALTHY, nproc=2, spawns=True, args=("--pause-s", "12")),
    # A long generate-like phase on actor 0 (12 s of compute) while actor 1 waits in the barrier after it.
    Case("ray_actor_group", "eval", HEALTHY, nproc=2, spawns=True, args=("--pause-s", "12")),
    # OpenRLHF's actors: the rank only in os.environ (read from the process's live environment).
    Case("ray_actor_group", "lock", COMM_HANG, (1,), nproc=2, spawns=True, collective="all_reduce",
         args=("--rank", "1", "--style", "environ")),
)
ACTIONS = ("checkpoint", "stop", "restart", "give_up")  # actions that interrupt the job


@dataclass(frozen=True)
class Row:
    program: str
    variant: str
    rc: int
    finished: bool  # every rank reported "done"
    detected_after_s: float | None  # first incident's confirmation − the variant's onset
    culprit: tuple[int, ...]
    collective: str | None
    desync: bool
    verdict: str  # "acted" | "observed" | "none"
    actions: tuple[str, ...]  # every action of every incident, in order
    nccl_change: bool  # some incident's next run got NCCL_* settings
    fallback_reason: str
    incidents: int
    reason: str = ""  # the first incident's
    # the first incident's waiting_groups, each (waiting, group ranks, desc, waits_on) as Case.waiting_in
    waiting_groups: tuple[tuple[tuple[int, ...], tuple[int, ...], str, tuple[int, ...]], ...] = ()

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def data_service(every_s: float = 2.0, chunks: int = 10) -> Iterator[str]:
    """zoo/data_service.py on a free port; yields HOST:PORT."""
    proc = subprocess.Popen([sys.executable, str(ZOO / "data_service.py"), "--every", str(every_s),
                             "--chunks", str(chunks), "--lifetime-s", "600"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def run_cases(base: Path, cases: Iterable[Case], parallel: int = 2, timeout_s: float = 240.0
              ) -> dict[str, Row | BaseException]:
    """Each case under ``launch``, ``parallel`` at a time (a case mostly waits on detection windows), each given
    ``timeout_s`` to end: its name → its row, or the exception that ended it (``row_of`` raises it in the test of
    that row)."""
    with ThreadPoolExecutor(parallel) as pool:
        futures = {c.name: pool.submit(run_case, base / c.name, c, timeout_s) for c in cases}
        return {name: fut.exception() or fut.result() for name, fut in futures.items()}


def row_of(rows: Mapping[str, Row | BaseException], case: Case) -> Row:
    row = rows[case.name]
    if isinstance(row, BaseException):
        raise row
    return row


def run_case(tmp: Path, case: Case, timeout_s: float = 240.0) -> Row:
    detect = {k: v for k, v in (("waiting_timeout_s", case.waiting_timeout_s),
                                ("deadline_still_max_s", case.still_max_s)) if v is not None}
    config = {"detect": detect} if detect else None
    args = ("--steps", "8", *case.args, *(("--pg-timeout-s", str(case.pg_timeout_s)) if case.pg_timeout_s else ()))
    if case.data_service:
        with data_service(2.0, 8) as addr:
            return run_variant(tmp, case.program, case.variant, nproc=case.nproc, args=args, config=config,
                               data_addr=addr, timeout_s=timeout_s, spawns=case.spawns)
    return run_variant(tmp, case.program, case.variant, nproc=case.nproc, args=args, config=config,
                       timeout_s=timeout_s, spawns=case.spawns)


def run_variant(tmp: Path, program: str, variant: str, *, nproc: int = 3, args: tuple[str, ...] = (),
                config: Mapping[str, Mapping[str, Any]] | None = None, timeout_s: float = 240.0,
                data_addr: str = "", spawns: bool = False) -> Row:
    """``launch`` the program's variant to its end (or ``timeout_s``) and summarise its incidents."""
    tmp.mkdir(parents=True, exist_ok=True)
    events, work = tmp / "events.jsonl", tmp / "work"
    work.mkdir(exist_ok=True)
    sections: dict[str, dict[str, Any]] = {"agent": {"backend": "proc"}, "recovery": {"stop_grace_s": 5.0,
                                                                                     "checkpoint_grace_s": 5.0}}
    for section, keys in (config or {}).items():
        sections.setdefault(section, {}).update(keys)
    cfg = write_config(tmp / "config.toml", sections)
    starter = [sys.executable] if spawns else [torchrun(), "--standalone", "--nproc-per-node", str(nproc)]
    job = [*starter, str(ZOO / f"{program}.py"), *(["--nproc", str(nproc)] if spawns else []),
           "--variant", variant, "--workdir", str(work), "--events", str(events), *args,
           *(["--data-addr", data_addr] if data_addr else [])]
    run = start_launch(["--config", str(cfg)], job, env=base_env(), tmp_path=tmp, job_id=f"zoo-{program}-{variant}",
                       max_lifetime_s=int(timeout_s) + 60)
    try:
        rc = run.wait(timeout_s)
        incidents = run.incidents()
    finally:
        run.kill()
    evs = read_events(events) if events.exists() else []
    done = {e["rank"] for e in evs if e["event"] == "done"}
    onsets = [e["t"] for e in evs if e["event"] == "hang_onset"]
    first = min(incidents, key=lambda i: i.get("detected_at") or 0, default=None)
    actions = tuple(a["action"] for i in incidents for a in i.get("actions", []))
    acted = any(x["action"] in ACTIONS and not _skipped(i, x["action"]) for i in incidents
                for x in i.get("actions", []))
    fallback = [i.get("fallback") or {} for i in incidents]
    return Row(program, variant, rc, done == set(range(nproc)),
               round(first["detected_at"] - min(onsets), 1) if first and onsets and first.get("detected_at") else None,
               tuple(first.get("culprit_ranks") or ()) if first else (), first.get("collective") if first else None,
               bool(first.get("desync")) if first else False,
               "acted" if acted else "observed" if incidents else "none", actions,
               any(any(k.startswith("NCCL_") for k in (f.get("env") or {})) for f in fallback),
               "; ".join(str(f.get("reason")) for f in fallback if f.get("reason")), len(incidents),
               str(first.get("reason") or "") if first else "", _waiting_groups(first))


def _waiting_groups(inc: Mapping[str, Any] | None) -> tuple[tuple[tuple[int, ...], tuple[int, ...], str,
                                                                 tuple[int, ...]], ...]:
    return tuple((tuple(g.get("waiting") or ()), tuple(g.get("ranks") or ()), str(g.get("desc") or ""),
                  tuple(g.get("waits_on") or ())) for g in (inc or {}).get("waiting_groups") or ())


def assert_row(case: Case, row: Row) -> None:
    """What the zoo promises for ``case``, asserted on the row it produced."""
    if case.expect == HEALTHY:
        assert row.rc == 0 and row.finished, row
        assert row.verdict != "acted" and not row.nccl_change, row  # an observed incident for a long wait is fine
        return
    assert row.detected_after_s is not None, row
    assert not row.nccl_change, row  # every hang here is the culprit's own code (or a desync, or a waiting job)
    if case.culprit:
        assert row.culprit == case.culprit, row
    if case.collective:
        assert row.collective == case.collective, row
    assert row.desync == case.desync, row
    assert set(case.waiting_in) <= set(row.waiting_groups), row
    if case.expect == COMM_HANG:
        assert row.detected_after_s <= 10.0, row
        assert row.verdict == "acted", row
        assert ("restart" in row.actions) or ("rank_exited" in row.fallback_reason), row
    elif case.expect == OWN_TIMEOUT:
        assert case.pg_timeout_s is not None and row.verdict != "acted", row  # never before the job's own deadline
        # the job's timeout fired (counted from when its peers entered the collective, a slow step before the onset
        # event at worst) and torchrun tore the job down: the crash incident, a second or so later
        assert case.pg_timeout_s - 2.5 <= row.detected_after_s <= case.pg_timeout_s + 15.0, row
        assert row.rc != 0 and row.incidents == 1, row  # the job's own timeout ended it: nothing to finish
        return
    else:
        timeout = case.waiting_timeout_s or 600.0
        # The wait is counted from when the job went quiet: the peers may have waited in the collective before
        # the culprit's onset event (one slow step of a loaded machine; measured 18.7 s for a 20 s timeout once).
        assert timeout - 2.5 <= row.detected_after_s <= timeout + 10.0, row
        assert "waited" in row.fallback_reason, row
    if case.finishes:
        assert row.rc == 0 and row.finished, row
    else:
        assert row.rc == 75 and row.actions[-1] == "give_up" and row.incidents == 2, row


def run_under_daemon(program: str, variant: str, *args: str, spawns: bool = False, nproc: int = 3,
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int | None]:
    """Run ``program``'s ``variant`` as a job registered with a `gpu-watchdog run` daemon by its main pid (shipped
    detection defaults, the test hook as its restart hook); the job's incidents (as `incidents` returns them, with
    actions), the restart hook's records and the job's exit (None: stopped by the daemon)."""
    from daemon_helpers import DaemonProc, records, short_dir
    from daemon_helpers import write_config as daemon_config

    base = short_dir()
    d = DaemonProc(base, daemon_config(base))
    events = base / "events.jsonl"
    job = None
    try:
        d.wait_socket()
        starter = [sys.executable] if spawns else [torchrun(), "--standalone", "--nproc-per-node", str(nproc)]
        job = subprocess.Popen([*starter, str(ZOO / f"{program}.py"), *(["--nproc", str(nproc)] if spawns else []),
                                "--variant", variant, "--workdir", str(base), "--events", str(events), "--steps", "8",
                                *args], env=base_env(), cwd=base, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: len([e for e in read_events(events) if e["event"] == "start"]) == nproc, 90, "ranks up")
        reg = d.cli("hook", "job-start", "--socket", d.socket, "--job-id", f"zoo-{program}-{variant}", "--pid",
                    str(job.pid), "--restart-hook", "requeue")
        assert reg.returncode == 0, reg.stdout + reg.stderr
        try:
            rc: int | None = job.wait(timeout=90)
        except subprocess.TimeoutExpired:
            rc = None
        store = IncidentStore(base / "state")

        def own() -> list[dict[str, Any]]:  # the daemon watches the whole host: other tests' jobs too
            return [i for i in store.list() if i.get("job_id") == f"zoo-{program}-{variant}"]

        wait_for(lambda: all(i.get("outcome") for i in own()), 60, "incidents finished")
        return own(), records(base), rc
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        d.kill()


def _skipped(inc: Mapping[str, Any], action: str) -> bool:
    return all(a.get("outcome") == "skipped" for a in inc.get("actions", []) if a["action"] == action)

