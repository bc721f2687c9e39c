"""The guardian's view of the job (launch/guardian.py JobTree): every process the job started, also after its
parent died, and never a process that merely reuses a pid."""

from __future__ import annotations

from gpu_watchdog.launch.guardian import JobTree
from gpu_watchdog.sample.proc_stat import ProcStat


def procs(*rows: tuple[int, int, int, float]) -> dict[int, ProcStat]:
    return {pid: ProcStat(pid, "S", ppid, sid, start, None) for pid, ppid, sid, start in rows}


def test_ranks_in_their_own_sessions_stay_in_the_job_after_torchrun_dies() -> None:
    tree = JobTree(100, 10.0)  # torchrun, a session leader
    tree.grow(procs((100, 50, 100, 10.0), (101, 100, 101, 11.0), (102, 100, 102, 11.0),  # ranks: own sessions
                    (103, 101, 101, 12.0),  # a rank's worker
                    (7, 1, 7, 1.0), (200, 7, 7, 20.0)))  # unrelated
    assert set(tree.members) == {100, 101, 102, 103}
    # torchrun SIGKILLed: the ranks are re-parented to init; a worker spawned since is still found by session
    tree.grow(procs((101, 1, 101, 11.0), (102, 1, 102, 11.0), (103, 101, 101, 12.0), (104, 1, 101, 30.0),
                    (7, 1, 7, 1.0), (200, 7, 7, 20.0)))
    assert set(tree.members) >= {101, 102, 103, 104} and 200 not in tree.members and 7 not in tree.members


def test_a_reused_pid_is_never_taken_for_a_member_nor_vouches_for_its_children() -> None:
    tree = JobTree(100, 10.0)
    tree.grow(procs((100, 50, 100, 10.0), (101, 100, 101, 11.0)))
    # 101 exited and its pid was reused by an unrelated process (another start) that has a child of its own
    tree.grow(procs((100, 50, 100, 10.0), (101, 9, 101, 40.0), (300, 101, 101, 41.0)))
    assert set(tree.members) == {100}


def test_a_process_older_than_its_claimed_owner_is_not_the_jobs() -> None:
    tree = JobTree(100, 10.0)
    tree.grow(procs((100, 50, 100, 10.0), (400, 100, 400, 5.0)))  # started before the member it names
    assert set(tree.members) == {100}


def test_a_rank_orphaned_between_two_scans_is_found_by_the_runs_marker() -> None:
    """torchrun spawned rank 102 in a session of its own and was SIGKILLed before the next scan: no parent or
    session leads to it, but its environment names the run."""
    marker = {"GPU_WATCHDOG_CONTROL_DIR": "/s/run/j", "GPU_WATCHDOG_RESTART_COUNT": "0"}
    envs = {102: {**marker, "PATH": "/bin"},
            103: {**marker, "GPU_WATCHDOG_RESTART_COUNT": "1"},  # another run of the job
            104: {"PATH": "/bin"},  # unrelated
            105: dict(marker)}  # carries the marker but started before the job: a stale copy, not this run
    tree = JobTree(100, 10.0, marker)
    tree.grow(procs((100, 50, 100, 10.0)))
    now = procs((102, 1, 102, 11.0), (103, 1, 103, 12.0), (104, 1, 104, 12.0), (105, 1, 105, 5.0))
    tree.grow(now)
    assert set(tree.members) == {100}
    tree.adopt_marked(now, read_env=lambda pid: envs.get(pid, {}))
    assert set(tree.members) == {100, 102}
    unmarked = JobTree(100, 10.0)
    unmarked.adopt_marked(now, read_env=lambda pid: envs.get(pid, {}))
    assert set(unmarked.members) == {100}  # no marker: nothing is matched by environment
