"""Which rank failed, from the exits ExitWatch saw (launch.exits.first_to_exit)."""

from __future__ import annotations

import signal

import pytest
from gpu_watchdog.launch.exits import Exits, TorchrunReport, finished_work, first_to_exit, with_report

KILLED = signal.SIGKILL  # a waitpid status: killed by SIGKILL
TERMINATED = signal.SIGTERM
EXIT_1 = 1 << 8


def test_torchruns_teardown_signals_leave_the_rank_that_failed() -> None:
    exits = {2: (100.0, EXIT_1), 0: (100.2, TERMINATED), 1: (100.2, TERMINATED)}
    assert first_to_exit(exits) == (2,)


def test_a_rank_whose_status_was_reaped_by_its_parent_is_named_when_it_was_alone_first() -> None:
    assert first_to_exit({1: (100.0, None)}) == (1,)


def test_ranks_that_exit_after_the_launched_command_were_torn_down_by_its_end() -> None:
    """Ray: actor 1 raised, the driver's ray.get raised and the driver exited, then actor 0 exited on its own code
    as Ray shut its workers down: actor 1 failed, not actor 0."""
    exits = {1: (100.0, EXIT_1), 0: (100.6, EXIT_1)}
    assert first_to_exit(exits) == (0, 1)  # without the command's exit time: both codes of their own
    assert first_to_exit(exits, command_exited_at=100.4) == (1,)


def test_a_rank_killed_alone_first_is_the_failure_whatever_its_peers_exit_codes() -> None:
    """Ray, on a saturated host: actor 1 SIGKILLed (as the OOM killer does) and its status caught before the raylet
    reaped it; its peer's collective failed on it and actor 0 exited with code 1 as the driver shut Ray down, before
    the driver itself exited. A teardown never comes first: actor 1 failed (CI named actor 0 before)."""
    assert first_to_exit({1: (100.0, KILLED), 0: (100.55, EXIT_1)}, command_exited_at=102.0) == (1,)
    assert first_to_exit({1: (100.0, KILLED), 0: (100.6, EXIT_1)}) == (1,)
    assert first_to_exit({1: (100.0, KILLED), 0: (100.01, EXIT_1)}) == (0,)  # seen in one wakeup: the code tells


def test_a_signal_to_every_rank_at_once_names_the_first_seen_as_before() -> None:
    """Every rank SIGTERMed in one wakeup (a kill of the whole job from outside): the earliest seen."""
    exits = {0: (100.0, TERMINATED), 1: (100.005, TERMINATED), 2: (100.3, TERMINATED)}
    assert first_to_exit(exits) == (0, 1)


def test_a_first_exit_whose_status_was_reaped_away_is_the_failure_when_it_was_alone() -> None:
    """Ray: actor 1 SIGKILLed and reaped by the raylet at once (no status), the driver's shutdown then ended actor 0
    with an exit code of its own before the driver itself exited (CI saw actor 0 named)."""
    exits = {1: (100.0, None), 0: (100.5, EXIT_1)}
    assert first_to_exit(exits, command_exited_at=100.7) == (1,)
    assert first_to_exit({1: (100.0, None), 0: (100.01, EXIT_1)}) == (0,)  # seen in one wakeup: the code tells


def test_when_every_rank_exits_after_the_command_they_are_judged_as_before() -> None:
    exits = {1: (101.0, KILLED), 0: (101.0, EXIT_1)}
    assert first_to_exit(exits, command_exited_at=100.0) == (0,)


ABORTED = signal.SIGABRT  # PyTorch's teardown abort ("terminate called without an active exception")
EXIT_0 = 0


def test_a_rank_that_ran_to_exit_code_0_never_failed() -> None:
    """Ranks 0 and 1 finished and exited 0, rank 2 aborted 0.3 s later: rank 2 failed, not all three."""
    exits = {0: (100.0, EXIT_0), 1: (100.05, EXIT_0), 2: (100.3, ABORTED)}
    assert first_to_exit(exits) == (2,)


def test_peers_that_exited_0_before_a_rank_died_by_a_signal_show_the_work_was_done() -> None:
    exits = {0: (100.0, EXIT_0), 1: (100.05, EXIT_0), 2: (100.3, ABORTED)}
    why = finished_work((2,), (0, 1, 2), exits, {}, command_exited_at=100.5)
    assert why is not None and "rank 0, rank 1 exited 0" in why and "rank 2 died by a signal" in why


def test_a_crash_mid_training_is_not_a_finished_job() -> None:
    """An abort mid-training: torchrun tears the peers down (SIGTERM), none exited 0."""
    exits = {2: (100.0, ABORTED), 0: (100.1, TERMINATED), 1: (100.1, TERMINATED)}
    assert finished_work((2,), (0, 1, 2), exits, {}) is None


def test_an_exception_after_peers_exited_0_is_not_called_a_teardown_death() -> None:
    """Rank 1 left early with exit code 0 (a job that swallows its own error) and rank 0 then raised: the exit code
    of an exception is no teardown abort, and the work is not shown done."""
    exits = {1: (100.0, EXIT_0), 0: (101.0, EXIT_1)}
    assert finished_work((0,), (0, 1), exits, {}) is None


def test_peers_that_exit_0_only_after_the_launched_command_ended_prove_nothing() -> None:
    """Ray: the driver failed and its workers were shut down, exiting 0 after it."""
    exits = {1: (100.0, ABORTED), 0: (100.8, EXIT_0)}
    assert finished_work((1,), (0, 1), exits, {}, command_exited_at=100.4) is None


def test_the_in_job_clients_end_of_training_shows_the_work_done_whatever_the_peers_did() -> None:
    """The aborting rank died before its peers exited (torchrun then ended them with SIGTERM); its client had seen
    its training loop end."""
    exits = {2: (100.0, ABORTED), 0: (100.1, TERMINATED), 1: (100.1, TERMINATED)}
    why = finished_work((2,), (0, 1, 2), exits, {0: 12, 1: 12, 2: 12})
    assert why is not None and "rank 2 had ended its training loop (last step 12)" in why
    assert finished_work((2,), (0, 1, 2), exits, {0: 12, 1: 12}) is None  # not the rank that died
    assert finished_work((), (0, 1, 2), exits, {0: 12, 1: 12, 2: 12}) is None  # which rank failed is not known


# torchrun's report (launch.exits.TorchrunReport): the same facts when torchrun reaped the ranks before the agent read
# them. What it lists of a teardown abort after the peers exited 0: rank 2 only, nothing torn down.
TEARDOWN_REPORT = TorchrunReport({2: (-6, 12)})
MID_TRAINING_REPORT = TorchrunReport({2: (-6, 12), 0: (-15, 10), 1: (-15, 11)}, frozenset({10, 11}))


def test_peers_reaped_before_the_agent_read_them_are_shown_exited_0_by_torchruns_report() -> None:
    """The issue: on a busy host the agent woke after torchrun reaped ranks 0 and 1 (no status) and only caught rank
    2's SIGABRT; without torchrun's report that restarted a finished job."""
    exits = {0: (100.0, None), 1: (100.01, None), 2: (102.0, ABORTED)}
    assert finished_work((2,), (0, 1, 2), exits, {}, command_exited_at=102.2) is None  # what it was
    why = finished_work((2,), (0, 1, 2), exits, {}, command_exited_at=102.2, report=TEARDOWN_REPORT)
    assert why is not None and "rank 0, rank 1 exited 0" in why and "torchrun's report" in why
    merged = with_report(exits, TEARDOWN_REPORT, (0, 1, 2), 102.2)
    assert first_to_exit(merged, 102.2) == (2,)  # and the rank that failed is rank 2, not the earliest peers


def test_a_failed_rank_reaped_before_the_agent_read_it_is_shown_killed_by_torchruns_report() -> None:
    """Reproduced on this box with two CPU burners: the peers' 0 read, rank 2's status reaped away."""
    exits = {0: (100.0, EXIT_0), 1: (100.01, EXIT_0), 2: (102.0, None)}
    assert first_to_exit(exits, 102.2) == (2,)
    assert finished_work((2,), (0, 1, 2), exits, {}, command_exited_at=102.2) is None
    assert finished_work((2,), (0, 1, 2), exits, {}, command_exited_at=102.2, report=TEARDOWN_REPORT) is not None


def test_exits_seen_only_after_the_command_ended_are_still_proven_by_the_report() -> None:
    """The agent so late that its one wakeup handled the command's exit before the peers': their exit times follow
    the command's. torchrun reported them (before it exited), so they ended under it."""
    exits = {0: (103.0, None), 1: (103.0, None), 2: (103.0, None)}
    assert finished_work((2,), (0, 1, 2), exits, {}, command_exited_at=102.9, report=TEARDOWN_REPORT) is not None
    assert first_to_exit(with_report(exits, TEARDOWN_REPORT, (0, 1, 2), 102.9), 102.9) == (2,)


def test_ranks_the_agent_never_saw_exit_are_added_from_the_report_and_its_own_reads_are_kept() -> None:
    exits = {2: (102.0, ABORTED), 0: (100.0, EXIT_0)}
    merged = with_report(exits, TEARDOWN_REPORT, (0, 1, 2), 102.5)
    assert merged == {2: (102.0, ABORTED), 0: (100.0, EXIT_0), 1: (102.5, EXIT_0)}
    assert with_report(exits, None, (0, 1, 2), 102.5) == exits


def _exits(statuses: dict[int, int], read: bool) -> Exits:
    """What the agent saw: every status read, or every exit seen with its status reaped away."""
    return {r: (100.0 + 0.01 * r, st if read else None) for r, st in statuses.items()}


@pytest.mark.parametrize("case, statuses, report, finished", [
    ("teardown abort", {0: EXIT_0, 1: EXIT_0, 2: ABORTED}, TEARDOWN_REPORT, True),
    ("abort mid-training", {0: TERMINATED, 1: TERMINATED, 2: ABORTED}, MID_TRAINING_REPORT, False),
    ("exception after peers exited 0", {0: EXIT_0, 1: EXIT_0, 2: EXIT_1}, TorchrunReport({2: (1, 12)}), False),
    ("peers' collective failed", {0: EXIT_1, 1: EXIT_1, 2: ABORTED},
     TorchrunReport({2: (-6, 12), 0: (1, 10), 1: (1, 11)}), False),
])
def test_the_verdict_is_the_same_from_the_agents_read_torchruns_report_or_both(
        case: str, statuses: dict[int, int], report: TorchrunReport, finished: bool) -> None:
    verdicts = {finished_work((2,), (0, 1, 2), _exits(statuses, read), {}, command_exited_at=101.0,
                              report=told) is not None
                for read, told in ((True, None), (False, report), (True, report))}
    assert verdicts == {finished}, case


def test_a_rank_that_torchrun_signalled_and_then_exited_0_proves_nothing() -> None:
    """torchrun tore down pid 11 and does not list it (it exited 0 from a SIGTERM handler): rank 1 is unknown."""
    exits = {0: (100.0, None), 1: (100.01, None), 2: (100.3, ABORTED)}
    report = TorchrunReport({2: (-6, 12)}, frozenset({11}))
    assert finished_work((2,), (0, 1, 2), exits, {}, report=report) is None


def test_the_agent_and_torchrun_disagreeing_proves_nothing() -> None:
    exits = {0: (100.0, EXIT_1), 1: (100.01, EXIT_0), 2: (100.3, ABORTED)}  # the agent read rank 0 exit 1
    assert finished_work((2,), (0, 1, 2), exits, {}, report=TEARDOWN_REPORT) is None
    killed_by_term = {0: (100.0, EXIT_0), 1: (100.01, EXIT_0), 2: (100.3, TERMINATED)}
    assert finished_work((2,), (0, 1, 2), killed_by_term, {}, report=TEARDOWN_REPORT) is None


def test_a_failure_torchrun_lists_beyond_the_failed_ranks_proves_nothing() -> None:
    """Rank 3, never named by the agent, failed too (exit 1): the work is not shown done."""
    exits = {0: (100.0, EXIT_0), 1: (100.01, EXIT_0), 2: (100.3, ABORTED)}
    report = TorchrunReport({2: (-6, 12), 3: (1, 13)})
    assert finished_work((2,), (0, 1, 2), exits, {}, report=report) is None
