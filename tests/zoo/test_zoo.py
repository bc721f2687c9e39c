"""The zoo: ordinary training programs, written the way their users write them, judged under ``launch`` with the
shipped detection defaults (only the waiting timeout is shortened where a case must reach it).

Every row of ``zoo_runs.CASES`` (the table benchmarks/zoo.py prints) is asserted here:
- healthy slow phases (polling every 2 s, a 1 KiB / 2 s reader, a long rollout, compile warm-up) run to the end
  with no incident that acts;
- hangs with communication evidence (peers in DDP's backward, FSDP's, TP's, the pipeline's p2p, an all_gather)
  are confirmed within 10 s of the onset, the culprit named, never an NCCL change for a hang in the culprit's own
  code, and the restarted run finishes;
- hangs without it (a busy rank, a whole job polling forever) wait for ``waiting_timeout_s``: a plain restart with
  advice, and a job that comes back polling at the same place gives up at once (exit 75).

The rows run two at a time (independent jobs; the machine's load is part of what the rules must survive), once
per session, and each test asserts its own row.
"""

from __future__ import annotations

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from gpu_watchdog.store.incidents import IncidentStore
from waiting import wait_for
from zoo_runs import CASES, COMM_HANG, HEALTHY, ZOO, Case, Row, run_case

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
    if case.expect == COMM_HANG:
        assert row.detected_after_s <= 10.0, row
        assert row.verdict == "acted", row
        assert ("restart" in row.actions) or ("rank_exited" in row.fallback_reason), row
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


def test_the_desync_in_ddps_backward_never_names_the_rank_in_backward(tmp_path: Path) -> None:
    """Rank 2 calls all_gather where the others broadcast, with DDP's backward around it, in every run: a desync,
    no NCCL change, the rank that passed the broadcast and waits in DDP's all-reduce never a culprit; the same
    desync after the plain restart gives up at once (exit 75), not after the whole budget."""
    row = run_case(tmp_path, Case("ddp_plain", "desync", COMM_HANG, args=("--hang-runs", "9"), desync=True))
    assert row.desync and row.detected_after_s is not None and row.detected_after_s <= 10.0, row
    assert 1 not in row.culprit, row
    assert not row.nccl_change and row.rc == 75 and row.actions[-1] == "give_up" and row.incidents == 2, row


def _under_daemon(variant: str, *args: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int | None]:
    """Run ddp_plain's ``variant`` as a job registered with a `gpu-watchdog run` daemon (shipped detection
    defaults, the test hook as its restart hook); the job's incidents (as `incidents` returns them, with actions),
    the restart hook's records and the job's exit (None: stopped by the daemon)."""
    from daemon_helpers import DaemonProc, records, short_dir, write_config
    from launch_harness import base_env, read_events, torchrun

    base = short_dir()
    d = DaemonProc(base, write_config(base))
    events = base / "events.jsonl"
    job = None
    try:
        d.wait_socket()
        job = subprocess.Popen([torchrun(), "--standalone", "--nproc-per-node", "3", str(ZOO / "ddp_plain.py"),
                                "--variant", variant, "--workdir", str(base), "--events", str(events), "--steps", "8",
                                *args], env=base_env(), cwd=base, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: len([e for e in read_events(events) if e["event"] == "start"]) == 3, 90, "ranks up")
        reg = d.cli("hook", "job-start", "--socket", d.socket, "--job-id", f"zoo-{variant}", "--pid", str(job.pid),
                    "--restart-hook", "requeue")
        assert reg.returncode == 0, reg.stdout + reg.stderr
        try:
            rc: int | None = job.wait(timeout=90)
        except subprocess.TimeoutExpired:
            rc = None
        store = IncidentStore(base / "state")

        def own() -> list[dict[str, Any]]:  # the daemon watches the whole host: other tests' jobs too
            return [i for i in store.list() if i.get("job_id") == f"zoo-{variant}"]

        wait_for(lambda: all(i.get("outcome") for i in own()), 60, "incidents finished")
        return own(), records(base), rc
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        d.kill()


def test_under_the_daemon_a_slow_poll_runs_untouched_and_a_ddp_hang_is_named_without_the_ladder() -> None:
    """The same rules under `gpu-watchdog run`: every rank polling every 2 s for 16 s finishes with no incident
    that acts; rank 2 blocked in Event.wait() with its peers in DDP's backward is named, stopped and handed to the
    restart hook at level 0 (no NCCL change)."""
    incs, hooks, rc = _under_daemon("poll", "--pause-s", "16")
    assert rc == 0 and hooks == [] and not [i for i in incs if i.get("verdict") != "waiting"], incs
    incs, hooks, rc = _under_daemon("event_wait")
    assert len(incs) == 1, incs
    inc = incs[0]
    assert inc["culprit_ranks"] == [2] and inc["collective"] == "ddp_all_reduce", inc
    assert [h["argv"][2] for h in hooks if "argv" in h] == ["--level=0"], hooks
    assert not any(k.startswith("NCCL_") for k in ((inc.get("fallback") or {}).get("env") or {})), inc
