"""The zoo: ordinary training programs, written the way their users write them, judged under ``launch`` with the
shipped detection defaults (only the waiting timeout is shortened where a case must reach it).

Every row of ``zoo_runs.CASES`` (the table benchmarks/zoo.py prints) is asserted here:
- healthy slow phases (polling every 2 s, a 1 KiB / 2 s reader, a long rollout, compile warm-up) run to the end
  with no incident that acts;
- hangs with communication evidence (peers in DDP's backward, FSDP's, TP's, the pipeline's p2p, an all_gather)
  are confirmed within 10 s of the onset, the culprit named, never an NCCL change for a hang in the culprit's own
  code, and the restarted run finishes; where the row says so, the incident names the process group each waiting
  rank waits in and whom it waits for (a 2-D DeviceMesh's TP and DP groups, a pipeline stage's partner);
- hangs without it (a whole job polling forever) wait for ``waiting_timeout_s``: a plain restart with advice, and a
  job that comes back polling at the same place gives up at once (exit 75);
- a rank that keeps computing while its peers wait in a collective is never stopped before the job's own collective
  timeout, which ends the job; the crash incident names the busy rank, not the waiters that exited first.

The rows run two at a time (independent jobs; the machine's load is part of what the rules must survive), once
per session, and each test asserts its own row.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from zoo_runs import CASES, COMM_HANG, Case, Row, assert_row, run_case, run_under_daemon

pytestmark = pytest.mark.slow
PARALLEL = 2


@pytest.fixture(scope="module")
def rows(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Row | BaseException]:
    """Run every collected case (two at a time) once; case name → its row, or what went wrong running it (raised
    in that case's own test: one broken row never fails the others)."""
    wanted = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is request.module and "case" in params:
            wanted.add(_key(params["case"]))
    base = tmp_path_factory.mktemp("zoo")
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {_key(c): pool.submit(run_case, base / _key(c), c) for c in CASES if _key(c) in wanted}
        return {key: fut.exception() or fut.result() for key, fut in futures.items()}


def _key(case: Case) -> str:
    return f"{case.name}-{case.expect}"


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_zoo_row(rows: dict[str, Row | BaseException], case: Case) -> None:
    row = rows[_key(case)]
    if isinstance(row, BaseException):
        raise row
    assert_row(case, row)


def test_the_desync_in_ddps_backward_never_names_the_rank_in_backward(tmp_path: Path) -> None:
    """Rank 2 calls all_gather where the others broadcast, with DDP's backward around it, in every run: a desync,
    no NCCL change, the rank that passed the broadcast and waits in DDP's all-reduce never a culprit; the same
    desync after the plain restart gives up at once (exit 75), not after the whole budget."""
    row = run_case(tmp_path, Case("ddp_plain", "desync", COMM_HANG, args=("--hang-runs", "9"), desync=True))
    assert row.desync and row.detected_after_s is not None and row.detected_after_s <= 10.0, row
    assert 1 not in row.culprit, row
    assert not row.nccl_change and row.rc == 75 and row.actions[-1] == "give_up" and row.incidents == 2, row


def test_the_odd_rank_of_a_desync_is_named_when_the_others_passed_its_counterpart(tmp_path: Path) -> None:
    """Rank 1 calls all_gather where ranks 0 and 2 broadcast (first run only): rank 2 gets its bytes and goes on
    into DDP's backward, root 0 stays in broadcast. Rank 1 is named (it was not before: an "equal groups" tie),
    the restart is plain and the job finishes."""
    case = Case("ddp_plain", "desync", COMM_HANG, (1,), args=("--rank", "1"), desync=True)
    assert_row(case, run_case(tmp_path, case))


def test_under_the_daemon_a_slow_poll_runs_untouched_and_a_ddp_hang_is_named_without_the_ladder() -> None:
    """The same rules under `gpu-watchdog run`: every rank polling every 2 s for 16 s finishes with no incident
    that acts; rank 2 blocked in Event.wait() with its peers in DDP's backward is named, stopped and handed to the
    restart hook at level 0 (no NCCL change)."""
    incs, hooks, rc = run_under_daemon("ddp_plain", "poll", "--pause-s", "16")
    assert rc == 0 and hooks == [] and not [i for i in incs if i.get("verdict") != "waiting"], incs
    incs, hooks, rc = run_under_daemon("ddp_plain", "event_wait")
    assert len(incs) == 1, incs
    inc = incs[0]
    assert inc["culprit_ranks"] == [2] and inc["collective"] == "ddp_all_reduce", inc
    assert [h["argv"][2] for h in hooks if "argv" in h] == ["--level=0"], hooks
    assert not any(k.startswith("NCCL_") for k in ((inc.get("fallback") or {}).get("env") or {})), inc
