"""Job-wide run records on a shared directory (store.job_runs) and the recovery that uses them: one decision per
(job, run), made by the first agent, read by every other node — exactly one restart per run."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpu_watchdog.act.gather import stacks_source
from gpu_watchdog.act.recovery import GAVE_UP, GIVEN_UP_ELSEWHERE, RESTARTED, STOOD_DOWN, Recovery
from gpu_watchdog.act.target import ActContext
from gpu_watchdog.config.schema import Config, FallbackConfig, RecoveryConfig, StacksConfig
from gpu_watchdog.evidence.stacks.diagnosis import diagnose
from gpu_watchdog.job.protocol import ControlDir
from gpu_watchdog.model import Finding, JobStatus, NodeSample, RankStack, StackEvidence
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.store.fallback_levels import FallbackStore
from gpu_watchdog.store.incidents import Incident, IncidentStore
from gpu_watchdog.store.job_runs import JobRuns


def _claim(root: str, host: str, out: Any) -> None:
    won, rec = JobRuns(root, host).claim("job-7", 1, {"level": 1 if host == "a" else 2})
    out.put((host, won, rec["decided_by"], rec["level"]))


def test_racing_agents_one_wins_and_everyone_reads_its_record(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), h, out)) for h in "abcdef"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    results = [out.get(timeout=5) for _ in procs]
    winners = [h for h, won, _, _ in results if won]
    assert len(winners) == 1
    assert {(by, level) for _, _, by, level in results} == {(winners[0], 1 if winners[0] == "a" else 2)}
    assert not list(tmp_path.glob("job-7/.*.tmp"))  # no temporary left behind


def test_the_record_of_a_run_is_the_newest_at_or_before_it(tmp_path: Path) -> None:
    runs = JobRuns(tmp_path, "n1")
    assert runs.current("j", 0) is None
    runs.claim("j", 1, {"level": 1})
    runs.claim("j", 3, {"level": 2})
    assert runs.current("j", 0) is None and runs.current("j", 1)["level"] == 1  # type: ignore[index]
    assert runs.current("j", 2)["level"] == 1 and runs.current("j", 5)["level"] == 2  # type: ignore[index]
    assert runs.current("j")["run"] == 3  # type: ignore[index]


class _Target:
    """A registered job on one node: its restart is a scheduler hook (counted)."""

    may_signal_checkpoint = False

    def __init__(self, tmp: Path, run: int) -> None:
        self.job_id, self.run, self.control = "job-7", run, ControlDir(tmp / "control")
        self.control.create()
        self.restarts: list[int] = []

    def processes(self) -> list[Any]:
        return []

    def poll(self) -> int | None:
        return 0

    def restart(self, inc: Incident, level: int, shown: str) -> bool:
        self.restarts.append(level)
        inc.record_action("restart", True, shown)
        return True


def _agent(tmp: Path, host: str, shared: Path, actor_grace_s: float = 0.0,
           max_restarts: int = 3) -> tuple[Recovery, _Target]:
    cfg = replace(Config(), fallback=FallbackConfig(shared_dir=str(shared), actor_grace_s=actor_grace_s),
                  stacks=StacksConfig(enabled=False),
                  recovery=RecoveryConfig(max_restarts=max_restarts, restart_backoff_s=0.0))
    ctx = ActContext(cfg, host, IncidentStore(tmp / host), FallbackStore(tmp / host), runs=JobRuns(shared, host))
    return Recovery(ctx, RestartBudget(cfg.recovery)), _Target(tmp / host, run=0)


def _finding() -> Finding:
    now = time.time()
    return Finding("stall", "rank_exited", "job-7", (0, 1, 2, 3), (3,), now - 5, now, (), "rank 3 exited", "process")


def test_two_nodes_confirm_the_same_hang_exactly_one_restarts(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    sample = NodeSample(t=time.time(), hostname="x", backend="proc", devices=(), processes=(), errors=())
    first, t1 = _agent(tmp_path, "node1", shared)
    second, t2 = _agent(tmp_path, "node2", shared)
    r1 = first.handle(_finding(), t1, sample, None)
    r2 = second.handle(_finding(), t2, sample, None)
    assert (t1.restarts, t2.restarts) == ([0], [])  # one restart hook for the run, on the node that decided it
    assert r1.outcome == RESTARTED and (r2.outcome, r2.by) == (STOOD_DOWN, "node1")
    restart = [a for a in r2.incident.summary["actions"] if a["action"] == "restart"]
    assert restart and restart[0]["outcome"] == "skipped" and "restarted by node1" in restart[0]["detail"]
    assert r2.incident.summary["restarted_by"]["incident"] == r1.incident.id
    assert r1.incident.summary["run"] == r2.incident.summary["run"] == 0  # both tell of one hang of run 0
    # every node exports the same settings for run 1, with job-wide diagnostics paths
    rec = JobRuns(shared, "any").current("job-7", 1)
    assert rec is not None and rec["decided_by"] == "node1"
    assert rec["env"]["NCCL_DEBUG_FILE"].startswith(str(shared / "job-7" / "run-1"))
    # a late agent still watching run 0 can never restart run 1 either
    late, t3 = _agent(tmp_path, "node3", shared)
    late_result = late.handle(_finding(), t3, sample, None)
    assert (late_result.outcome, late_result.by) == (STOOD_DOWN, "node1") and t3.restarts == []


def _stack(rank: int, state: str, op: str | None = None, active: bool = False) -> RankStack:
    return RankStack(rank, 1000 + rank, state, f"{state}-{rank}", active, op, f"{op or state} (train.py:{rank})")


def test_stack_dumps_published_by_one_node_are_read_by_the_others(tmp_path: Path) -> None:
    now = time.time()
    JobRuns(tmp_path, "node2").publish_stacks(StackEvidence("job-7", now, (_stack(2, "compute", active=True),)))
    JobRuns(tmp_path, "node3").publish_stacks(StackEvidence("job-7", now - 600, (_stack(4, "unknown"),)))
    node1 = JobRuns(tmp_path, "node1")
    node1.publish_stacks(StackEvidence("job-7", now, (_stack(0, "collective", "all_reduce"),)))
    peers = node1.peer_stacks("job-7", since=now - 60)
    assert list(peers) == ["node2"] and peers["node2"].ranks[0].state == "compute"  # not its own, not stale


def test_a_busy_culprit_on_another_node_is_named_from_this_one(tmp_path: Path) -> None:
    """Node 1 sees ranks 0,1 wait in all_reduce (culprit unknown, "possibly on another node"); node 2's agent only
    waits on its rank 2 computing forever, and published that dump. Node 1 names rank 2 from it."""
    shared, now = tmp_path / "shared", time.time()
    JobRuns(shared, "node2").publish_stacks(StackEvidence("job-7", now - 3, (
        _stack(2, "compute", active=True), _stack(3, "collective", "all_reduce"))))
    cfg = replace(Config(), fallback=FallbackConfig(shared_dir=str(shared)))
    ctx = ActContext(cfg, "node1", IncidentStore(tmp_path / "n1"), FallbackStore(tmp_path / "n1"),
                     runs=JobRuns(shared, "node1"))
    finding = Finding("stall", "idle_held", "job-7", (0, 1), (), now - 5, now, (), "", "stacks")
    inc = ctx.open_incident(finding)
    local = [_stack(0, "collective", "all_reduce"), _stack(1, "collective", "all_reduce")]
    alone = diagnose(local)
    assert alone.culprit_ranks == () and "another node" in alone.reason
    remote = stacks_source(ctx).remote_stacks(ctx.transcript(inc), finding, alone, local, "job-7")
    merged = diagnose([*local, *remote])
    assert merged.culprit_ranks == (2,) and merged.collective == "all_reduce"
    assert inc.summary["remote_stacks"] == {"node2": [2, 3]}


def test_a_remote_culprit_alive_on_its_node_is_waited_on_a_blocked_one_is_acted_on(tmp_path: Path) -> None:
    """Two nodes, two agents: node 1's ranks wait in all_reduce for rank 2 on node 2. If node 2's agent saw rank 2
    polling for data (a wait that ends by itself) the job waits, as it would on one node: no action. If it saw rank
    2 blocked for good, node 1 acts on it."""
    from gpu_watchdog.act.gather import Gathered
    from gpu_watchdog.act.recovery import stall_facts
    from gpu_watchdog.evidence.stacks.incident import alive
    from gpu_watchdog.policy.plan import action_proof

    local = [_stack(0, "collective", "all_reduce"), _stack(1, "collective", "all_reduce")]
    now = time.time()
    finding = Finding("stall", "idle_held", "job-7", (0, 1), (), now - 5, now, (), "", "stacks")
    polling = replace(_stack(2, "sleep"), timed=True)
    stuck = _stack(2, "unknown")
    for remote, acts in (([polling], False), ([stuck], True)):
        diag = diagnose([*local, *remote])
        assert diag.culprit_ranks == (2,)
        gathered = Gathered(tuple(local), diag, remote[0], "stacks: ranks 0,1 wait in all_reduce", alive(diag, remote))
        assert bool(action_proof(finding, stall_facts(gathered, None))) is acts, gathered


def _status(*ranks: int) -> JobStatus:
    return JobStatus("job-7", ranks=ranks)


def test_rank_0s_node_decides_and_another_node_waits_for_it(tmp_path: Path) -> None:
    """Node 2 confirms first but runs no rank 0: it waits (fallback.actor_grace_s) and takes node 1's decision."""
    shared = tmp_path / "shared"
    sample = NodeSample(t=time.time(), hostname="x", backend="proc", devices=(), processes=(), errors=())
    node1, t1 = _agent(tmp_path, "node1", shared, actor_grace_s=10.0)
    node2, t2 = _agent(tmp_path, "node2", shared, actor_grace_s=10.0)
    later = threading.Timer(1.0, lambda: node1.handle(_finding(), t1, sample, _status(0, 1)))
    t0 = time.monotonic()
    later.start()
    r2 = node2.handle(_finding(), t2, sample, _status(2, 3))
    waited = time.monotonic() - t0
    later.join()
    assert 0.9 <= waited < 5.0, waited  # it waited for node 1, not the whole grace
    assert (t1.restarts, t2.restarts) == ([0], []) and (r2.outcome, r2.by) == (STOOD_DOWN, "node1")
    claim = [a for a in r2.incident.summary["actions"] if a["action"] == "claim_run"]
    assert "decided by node1 (rank 0's node" in claim[0]["detail"]


def test_without_rank_0s_agent_another_node_decides_after_the_grace(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    sample = NodeSample(t=time.time(), hostname="x", backend="proc", devices=(), processes=(), errors=())
    node2, t2 = _agent(tmp_path, "node2", shared, actor_grace_s=1.0)
    t0 = time.monotonic()
    r2 = node2.handle(_finding(), t2, sample, _status(2, 3))
    assert time.monotonic() - t0 >= 1.0 and r2.outcome == RESTARTED and t2.restarts == [0]
    assert JobRuns(shared, "x").get("job-7", 1)["decided_by"] == "node2"  # type: ignore[index]


def test_the_restart_budget_is_the_jobs_not_each_nodes(tmp_path: Path) -> None:
    """max_restarts = 1: node 1 restarted the job (run 1); run 1 hangs and node 2 — which never restarted it —
    confirms first: it gives the job up (job-wide budget spent) and node 1 stands down on that decision."""
    shared = tmp_path / "shared"
    sample = NodeSample(t=time.time(), hostname="x", backend="proc", devices=(), processes=(), errors=())
    node1, t1 = _agent(tmp_path, "node1", shared, max_restarts=1)
    node2, t2 = _agent(tmp_path, "node2", shared, max_restarts=1)
    assert node1.handle(_finding(), t1, sample, None).outcome == RESTARTED
    t1.run = t2.run = 1
    r2 = node2.handle(_finding(), t2, sample, None)
    assert r2.outcome == GAVE_UP and t2.restarts == [] and "restart budget spent" in str(
        JobRuns(shared, "x").get("job-7", 2)["give_up"])  # type: ignore[index]
    r1 = node1.handle(_finding(), t1, sample, None)
    assert (r1.outcome, r1.by) == (GIVEN_UP_ELSEWHERE, "node2") and t1.restarts == [0]
    assert r1.incident.summary["given_up_by"]["incident"] == r2.incident.id
    assert JobRuns(shared, "x").restart_times("job-7") == [JobRuns(shared, "x").get("job-7", 1)["decided_at"]]  # type: ignore[index]


def test_every_node_climbs_from_the_jobs_level(tmp_path: Path) -> None:
    """Node 2 never decided a run: its next decision starts from the level node 1 recorded for the run, not from
    its own (empty) store."""
    shared = tmp_path / "shared"
    JobRuns(shared, "node1").claim("job-7", 1, {"level": 2, "env": {"NCCL_P2P_DISABLE": "1"}})
    ctx = ActContext(Config(), "node2", IncidentStore(tmp_path / "i"), FallbackStore(tmp_path / "f"),
                     runs=JobRuns(shared, "node2"))
    assert ctx.level_record("job-7", 1)["level"] == 2 and ctx.level_record("job-7", 0)["level"] == 0
    assert ActContext(Config(), "n", IncidentStore(tmp_path / "i"), FallbackStore(tmp_path / "f")).level_record(
        "job-7", 1)["level"] == 0


def test_an_agent_that_confirms_after_the_run_was_decided_stands_down_without_gathering(tmp_path: Path) -> None:
    """Node 2 confirms when node 1 already decided run 1 (its ranks are being stopped): no stack dump of dying
    ranks, no 'waiting' verdict — restarted by node 1."""
    shared = tmp_path / "shared"
    sample = NodeSample(t=time.time(), hostname="x", backend="proc", devices=(), processes=(), errors=())
    JobRuns(shared, "node1").claim("job-7", 1, {"level": 1, "incident": "inc-1"})
    node2, t2 = _agent(tmp_path, "node2", shared)
    now = time.time()
    idle = Finding("stall", "idle_held", "job-7", (2, 3), (), now - 5, now, (), "no progress", "stacks")
    r2 = node2.handle(idle, t2, sample, _status(2, 3))  # alone, no evidence: it would be held as waiting
    assert (r2.outcome, r2.by) == (STOOD_DOWN, "node1") and r2.hold is None and t2.restarts == []
    assert r2.incident.summary["restarted_by"]["incident"] == "inc-1"


def test_what_rank_0s_watcher_saw_of_nccls_counts_is_read_by_the_other_nodes(tmp_path: Path) -> None:
    """Only rank 0's node watches NCCL RAS all the time; it publishes each observation, the others read the ones
    newer than what they already have (never their own), and a malformed record is no evidence."""
    from gpu_watchdog.model import CommProgress

    watcher, other = JobRuns(tmp_path, "node0"), JobRuns(tmp_path, "node1")
    watcher.publish_comm(CommProgress("job-7", 100.0, "moving", (), "NCCL RAS at localhost:28028"))
    (seen,) = other.peer_comm("job-7", since=0.0)
    assert (seen.state, seen.t, seen.behind) == ("moving", 100.0, ()) and "via node0" in seen.source
    watcher.publish_comm(CommProgress("job-7", 102.0, "frozen_unequal", (5,), "NCCL RAS at localhost:28028"))
    assert [(p.state, p.behind) for p in other.peer_comm("job-7", since=100.0)] == [("frozen_unequal", (5,))]
    assert other.peer_comm("job-7", since=102.0) == [] and watcher.peer_comm("job-7", since=0.0) == []
    (tmp_path / "job-7" / "comm" / "node2.json").write_text('{"t": "soon", "state": "moving"}')
    assert len(other.peer_comm("job-7", since=0.0)) == 1
