"""The judgement of a confirmed stall is pure (policy.plan.judge): the same finding, evidence, level record and
budget verdict always give the same plan, and nothing is charged until act commits the verdict."""

from __future__ import annotations

import time

from gpu_watchdog.config.schema import FallbackConfig, RecoveryConfig
from gpu_watchdog.model import Finding, LevelRecord
from gpu_watchdog.policy.budget import RestartBudget
from gpu_watchdog.policy.plan import GIVE_UP, HOLD, RESTART, STAND_DOWN, StallFacts, judge

NOW = time.time()
CFG = FallbackConfig()


def _finding(signature: str = "idle_held", kind: str = "stall") -> Finding:
    return Finding(kind, signature, "job-1", (0, 1), (1,), NOW - 5, NOW, (), "detail", "stacks")


def _allowed() -> RestartBudget:
    return RestartBudget(RecoveryConfig(max_restarts=3))


def test_no_proof_is_a_hold_whatever_the_budget() -> None:
    plan = judge(CFG, _finding(), StallFacts(culprit_state="sleep"), LevelRecord(), _allowed().verdict(NOW, None))
    assert plan.action == HOLD and not plan.charges_budget and plan.decision is None


def test_another_node_on_the_other_side_of_a_poll_is_a_hold_even_with_communication_evidence() -> None:
    facts = StallFacts("stacks: ranks 0,1 wait in all_reduce", "sleep", alive_elsewhere="rank 2: sleep at poll")
    assert judge(CFG, _finding(), facts, LevelRecord(), _allowed().verdict(NOW, None)).action == HOLD


def test_a_communication_hang_restarts_one_level_up_and_charges_the_budget() -> None:
    facts = StallFacts("stacks: ranks 0,1 wait in all_reduce", "collective", "all_reduce", on_gpus=True)
    plan = judge(CFG, _finding(), facts, LevelRecord(0), _allowed().verdict(NOW, None))
    assert plan.action == RESTART and plan.decision is not None and plan.decision.level == 1
    assert plan.charges_budget and plan.proof.startswith("stacks")


def test_a_stopped_rank_is_proof_by_itself() -> None:
    plan = judge(CFG, _finding(), StallFacts(culprit_state="stopped", stopped=(2,)), LevelRecord(),
                 _allowed().verdict(NOW, None))
    assert plan.action == RESTART and plan.proof == "process: rank(s) 2 stopped (state T)"
    assert plan.decision is not None and plan.decision.level == 0  # no NCCL setting helps a stopped rank


def test_the_same_desync_after_a_plain_restart_gives_up_without_charging_the_budget() -> None:
    facts = StallFacts("stacks: desync", "collective", "all_gather (x.py:3)", desync=True)
    first = judge(CFG, _finding(), facts, LevelRecord(0), _allowed().verdict(NOW, None))
    assert first.action == RESTART and first.decision is not None
    again = judge(CFG, _finding(), facts, LevelRecord(0, hang_place=first.decision.hang_place),
                  _allowed().verdict(NOW, None))
    assert again.action == GIVE_UP and not again.charges_budget and "code bug" in again.why_not


def test_a_spent_budget_gives_up_and_its_verdict_is_accounted_for() -> None:
    budget = RestartBudget(RecoveryConfig(max_restarts=1))
    budget.commit(budget.verdict(NOW - 10, None))
    verdict = budget.verdict(NOW, None)
    plan = judge(CFG, _finding(), StallFacts("stacks", "collective"), LevelRecord(1), verdict)
    assert plan.action == GIVE_UP and plan.charges_budget and plan.why_not.startswith("restart budget spent")
    assert plan.current_level == 1


def test_a_decision_another_agent_wrote_is_a_stand_down_before_any_evidence() -> None:
    record = LevelRecord.from_json({"level": 2, "decided_by": "node1"})
    plan = judge(CFG, _finding(), StallFacts(), LevelRecord(), _allowed().verdict(NOW, None), record)
    assert plan.action == STAND_DOWN and plan.decided_elsewhere == record


def test_a_verdict_changes_nothing_until_it_is_committed() -> None:
    budget = RestartBudget(RecoveryConfig(max_restarts=2, max_no_progress_restarts=5))
    before = budget.state()
    verdict = budget.verdict(NOW, 7)
    assert verdict.allowed and budget.state() == before
    budget.commit(verdict)
    assert budget.restarts == [NOW] and budget.last_hang_step == 7


def test_the_job_wide_history_counts_instead_of_this_nodes_own() -> None:
    budget = RestartBudget(RecoveryConfig(max_restarts=2))
    verdict = budget.verdict(NOW, None, job_wide=[NOW - 2, NOW - 1])
    assert not verdict.allowed and "2 restarts" in verdict.why_not


RAY_TRAIN = "Ray Train run r: FailureConfig(max_failures=2), 0 used"


def test_a_plain_restart_goes_through_the_jobs_engine_when_it_offers_one() -> None:
    """A culprit in its own code (no NCCL change): Ray Train's FailureConfig restarts the hung worker group."""
    facts = StallFacts("stacks: rank 0 waits in ddp_all_reduce", "unknown", "Event.wait (x.py:3)",
                       engine_restart=RAY_TRAIN)
    plan = judge(CFG, _finding(), facts, LevelRecord(0), _allowed().verdict(NOW, None))
    assert plan.action == RESTART and plan.by_engine == RAY_TRAIN and plan.charges_budget
    assert plan.decision is not None and plan.decision.level == 0


def test_a_restart_that_climbs_the_ladder_never_goes_through_the_engine() -> None:
    """New NCCL settings reach only a new driver's workers: the engine's restart keeps the raylet's environment."""
    facts = StallFacts("stacks: ranks 0,1 wait in all_reduce", "collective", "all_reduce", on_gpus=True,
                       engine_restart=RAY_TRAIN)
    plan = judge(CFG, _finding(), facts, LevelRecord(0), _allowed().verdict(NOW, None))
    assert plan.action == RESTART and plan.decision is not None and plan.decision.level == 1
    assert plan.by_engine == ""


def test_no_engine_offer_is_a_restart_of_the_job() -> None:
    facts = StallFacts("stacks: rank 0 waits in ddp_all_reduce", "unknown", "Event.wait (x.py:3)")
    plan = judge(CFG, _finding(), facts, LevelRecord(0), _allowed().verdict(NOW, None))
    assert plan.action == RESTART and plan.by_engine == ""


def test_a_level_record_reads_both_files_and_defaults_what_they_lack() -> None:
    """A node's own record (jobs/<job>.json) and a job-wide one (run-<N>.json) read alike; a missing or null key
    is its default, never a KeyError in the middle of a recovery."""
    node = LevelRecord.from_json({"job_id": "j", "level": 1, "name": "p2p_off", "env": {"NCCL_P2P_DISABLE": "1"},
                                  "advice": None, "reason": "stacks", "hang_place": "all_reduce", "updated_at": 1.0})
    assert (node.level, dict(node.env), node.name, node.advice, node.hang_place) == (
        1, {"NCCL_P2P_DISABLE": "1"}, "p2p_off", "", "all_reduce")
    run = LevelRecord.from_json({"level": 2, "run": "3", "decided_by": "gwn1", "incident": "inc-1",
                                 "give_up": "restart budget spent"})
    assert (run.run, run.decided_by, run.incident, run.give_up) == (3, "gwn1", "inc-1", "restart budget spent")
    assert LevelRecord.from_json({}) == LevelRecord() and LevelRecord().decided_by == "?"
