"""Real Flight Recorder dumps of the 2x2 TP x DP gloo job (tests/jobs/groups.py), taken through the real FR API.

    dumps = take_group_dumps("missing", rank_at=1, tmp_path=tmp_path)   # {rank: path}, the raw <prefix><rank> files

The job serves FR dumps on FIFOs (train.py's ``--fr-pipe`` helper, the stand-in for NCCL's dump pipe); this asks
every rank for a dump once the scenario's ranks have been blocked for ``blocked_s``, waits until all four dumps are
written, then kills the job.
"""

from __future__ import annotations

import time
from pathlib import Path

from gloo_jobs import start_job
from gpu_watchdog.evidence.flight_recorder.dumps import FrSettings, fr_settings, trigger_dumps
from repo_paths import REPO

GROUPS = REPO / "tests" / "jobs" / "groups.py"
HUNG = ("missing", "chain", "mismatch", "p2p")


def fr_env(d: Path) -> dict[str, str]:
    return {"TORCH_FR_BUFFER_SIZE": "200", "TORCH_FR_DUMP_TEMP_FILE": str(d / "trace_"),
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(d / "pipe_")}


def wait_dumps(settings: FrSettings, ranks: range, asked_at: float, timeout: float) -> dict[int, Path]:
    """Trigger the FIFO of every rank that has not yet written a dump newer than ``asked_at`` (a rank that has is
    left alone: its dump stays the one taken at the moment asked for); return {rank: dump path}."""
    deadline = time.monotonic() + timeout
    done: dict[int, Path] = {}
    while True:
        trigger_dumps(settings, [r for r in ranks if r not in done])
        time.sleep(0.5)
        done = {r: settings.dump_path(r) for r in ranks
                if settings.dump_path(r).is_file() and settings.dump_path(r).stat().st_mtime >= asked_at}
        if len(done) == len(ranks):
            return done
        if time.monotonic() > deadline:
            raise TimeoutError(f"only ranks {sorted(done)} dumped within {timeout} s")


def take_group_dumps(scenario: str, *, rank_at: int = 1, tmp_path: Path, blocked_s: float = 12.0,
                     extra_args: tuple[str, ...] = ()) -> dict[int, Path]:
    """Run groups.py ``scenario`` with the fault on ``rank_at``; dump all 4 ranks ``blocked_s`` after the fault (a
    hung scenario), 2 s into the pause (``slow``) or after the last step (``healthy``)."""
    d = Path(tmp_path) / f"fr-{scenario}"
    d.mkdir(parents=True, exist_ok=True)
    env = fr_env(d)
    job = start_job(scenario, nproc=4, script=GROUPS, tmp_path=d, env=env, step_at=2,
                    extra_args=("--rank-at", str(rank_at), *extra_args))
    try:
        job.wait_ranks(timeout=120)
        if scenario == "healthy":
            job.wait_event("done", timeout=60, count=4)
            time.sleep(1.0)
        else:
            job.wait_event("hang_onset", timeout=60)
            time.sleep(2.0 if scenario == "slow" else blocked_s)
        settings = fr_settings(env)
        assert settings is not None
        return wait_dumps(settings, range(4), time.time() - 0.5, timeout=60)
    finally:
        job.stop()
