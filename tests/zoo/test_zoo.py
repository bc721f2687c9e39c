"""The zoo: ordinary training programs, written the way their users write them, judged under ``launch`` with the
shipped detection defaults (only the waiting timeout is shortened where a variant must reach it).

Each row of benchmarks/zoo.py's table is asserted here: healthy slow phases run to the end untouched (no incident
that acts); hangs with communication evidence are confirmed within 10 s, the culprit named, no NCCL change for a
hang in the culprit's own code; hangs without it wait for ``waiting_timeout_s`` and get a plain restart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from zoo_runs import data_service, run_variant

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("variant", ["poll", "slow_reader"])
def test_ddp_slow_waits_run_to_the_end_untouched(tmp_path: Path, variant: str) -> None:
    """Every rank polls for its shard every 2 s / reads 1 KiB every 2 s for ~16 s: shipped defaults, no action."""
    if variant == "slow_reader":
        with data_service(2.0, 8) as addr:
            row = run_variant(tmp_path, "ddp_plain", variant, args=("--steps", "8"), data_addr=addr)
    else:
        row = run_variant(tmp_path, "ddp_plain", variant, args=("--steps", "8", "--pause-s", "16"))
    assert row.rc == 0 and row.finished, row
    assert row.verdict == "none" and row.incidents == 0, row


def test_ddp_prefetch_thread_dies_rank_named_in_backward_no_ladder(tmp_path: Path) -> None:
    """Rank 2 blocks for good in Event.wait(); ranks 0,1 wait in DDP's backward all-reduce: confirmed fast, rank 2
    named, the collective is DDP's, a plain restart (no NCCL change) and the job finishes."""
    row = run_variant(tmp_path, "ddp_plain", "event_wait", args=("--steps", "8"))
    assert row.detected_after_s is not None and row.detected_after_s <= 10.0, row
    assert row.culprit == (2,) and row.collective == "ddp_all_reduce" and not row.desync, row
    assert row.verdict == "acted" and "restart" in row.actions and not row.nccl_change, row
    assert "its own code" in row.fallback_reason, row
    assert row.rc == 0 and row.finished, row


def test_ddp_desync_is_named_never_the_rank_in_backward_and_gives_up_when_it_comes_back(tmp_path: Path) -> None:
    """Rank 2 calls all_gather where the others broadcast, with DDP's backward around it, in every run: a desync,
    no NCCL change, the rank waiting in backward never a culprit; the same desync after the plain restart gives
    up at once (exit 75), not after the whole budget."""
    row = run_variant(tmp_path, "ddp_plain", "desync", args=("--steps", "8", "--hang-runs", "9"))
    assert row.desync and row.detected_after_s is not None and row.detected_after_s <= 10.0, row
    assert 1 not in row.culprit, row  # rank 1 passed the broadcast and waits in DDP's all-reduce
    assert not row.nccl_change and row.rc == 75 and row.actions[-1] == "give_up", row
    assert row.incidents == 2, row


def test_ddp_busy_rank_waits_for_the_timeout_then_a_plain_restart(tmp_path: Path) -> None:
    """Rank 2 spins in ``while True: pass``: it computes, its peers wait on it; nothing before the waiting timeout
    (20 s here), then a plain restart with advice, and the job finishes."""
    row = run_variant(tmp_path, "ddp_plain", "busy", args=("--steps", "8"),
                      config={"detect": {"waiting_timeout_s": 20.0}})
    assert row.detected_after_s is not None and 19.0 <= row.detected_after_s <= 30.0, row
    assert row.culprit == (2,) and not row.nccl_change and "waited" in row.fallback_reason, row
    assert row.rc == 0 and row.finished, row
