"""What a confirmed stall gets (pure): the judgement ``act.recovery`` carries out.

From the finding, what the evidence says (``StallFacts``), the record of the level that configured this run, the
job-wide record of the next run when another node's agent already wrote it, and the restart budget's verdict,
``judge`` returns one ``Plan``:

- ``stand_down``: another node's agent decided the next run (a restart, or none); this node's ranks only stop;
- ``hold``: no proof that interrupting the job is right (README "How it decides"): it waits, watched on;
- ``give_up``: a deterministic hang back at the same place after a restart that changed nothing, or the budget spent;
- ``restart``: at the decision's level (``policy.ladder.decide``), which travels in the plan; by the job's own
  engine (Ray Train's ``FailureConfig``: only the hung ranks are ended) when it offers one and the level stays.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_watchdog.config.schema import FallbackConfig
from gpu_watchdog.model import Finding, LevelRecord
from gpu_watchdog.policy.budget import BudgetVerdict
from gpu_watchdog.policy.ladder import FallbackDecision, decide, hang_place

STAND_DOWN, HOLD, GIVE_UP, RESTART = "stand_down", "hold", "give_up", "restart"

# A hang that comes back at the same place after a restart that changed nothing is deterministic for these:
# restarting again does not help.
_DETERMINISTIC = ("desync", "waiting_timeout")


@dataclass(frozen=True)
class StallFacts:
    """What the evidence gathered at the incident says, reduced to what the judgement reads."""

    communication: str = ""  # the sources that put the hang in communication, "" when none does
    culprit_state: str | None = None  # the state of the stack the hang sits in (a blocked worker's if any)
    culprit_where: str = ""
    desync: bool = False
    stopped: tuple[int, ...] = ()  # ranks seen stopped (state T)
    alive_elsewhere: str = ""  # the culprits are other nodes' ranks their agents saw alive
    on_gpus: bool = False  # the ranks use real GPUs (NCCL), not the proc backend's virtual devices
    engine_restart: str = ""  # the job's own engine restarts its hung ranks (act.engine_restart), "" when none


@dataclass(frozen=True)
class Plan:
    action: str  # STAND_DOWN | HOLD | GIVE_UP | RESTART
    proof: str = ""  # why interrupting the job is allowed (GIVE_UP, RESTART)
    decision: FallbackDecision | None = None  # the next run's settings (GIVE_UP: the advice; RESTART: the level)
    why_not: str = ""  # GIVE_UP: why there is no next run
    charges_budget: bool = False  # the budget's verdict is accounted for (not for a deterministic give-up)
    current_level: int = 0  # the level of the run that hung
    decided_elsewhere: LevelRecord | None = None  # STAND_DOWN: the other agent's record of the next run
    by_engine: str = ""  # RESTART by the job's own engine (what offers it): only the hung ranks are ended


def action_proof(finding: Finding, facts: StallFacts) -> str:
    """Why an action that interrupts the job is allowed, in one line; "" when it is not (the one rule: README "How
    it decides"). Communication evidence (stacks, a blocked worker, Flight Recorder, NCCL RAS, the NCCL spin), or
    evidence from the processes themselves: a rank that exited or was stopped, a job that already waited
    ``waiting_timeout_s``, a restart someone asked for."""
    if finding.kind == "restart":
        return "requested"
    if finding.signature == "rank_exited":
        return f"process: {finding.detail}"
    if finding.signature == "waiting_timeout":
        return f"waiting timeout: {finding.detail}"
    if facts.stopped:
        return f"process: rank(s) {','.join(map(str, facts.stopped))} stopped (state T)"
    if facts.alive_elsewhere:
        return ""  # the job waits on another node's rank that is alive there
    return facts.communication


def judge(cfg: FallbackConfig, finding: Finding, facts: StallFacts, previous: LevelRecord,
          budget: BudgetVerdict, decided_elsewhere: LevelRecord | None = None) -> Plan:
    """The plan for a confirmed stall. ``previous``: the fallback record that configured the run that hung (its
    level and the place its hang sat); ``budget``: the restart budget's verdict on this hang."""
    current = previous.level
    if decided_elsewhere is not None:
        return Plan(STAND_DOWN, current_level=current, decided_elsewhere=decided_elsewhere)
    proof = action_proof(finding, facts)
    if not proof:
        return Plan(HOLD, current_level=current)
    state = "desync" if facts.desync else facts.culprit_state
    place = hang_place(state, facts.culprit_where, finding.signature)
    decision = decide(cfg, current, finding.kind, facts.culprit_state, desync=facts.desync,
                      communication=facts.communication, signature=finding.signature, place=place,
                      level_advice=finding.kind == "stall" and facts.on_gpus)
    kind = "desync" if facts.desync else finding.signature
    if not decision.changed and kind in _DETERMINISTIC and place == previous.hang_place:
        why = (f"code bug: restarting does not help (the same desync at {place} came back after a restart)"
               if facts.desync else
               f"restarting does not help: the job waited at the same place again ({place}) after a restart")
        return Plan(GIVE_UP, proof, decision, why, current_level=current)
    if not budget.allowed:
        return Plan(GIVE_UP, proof, decision, f"restart budget spent: {budget.why_not}", True, current)
    # The engine's restart keeps the environment its workers inherit: it fits only a run at the same level.
    by_engine = facts.engine_restart if decision.level == current else ""
    return Plan(RESTART, proof, decision, charges_budget=True, current_level=current, by_engine=by_engine)
