"""Which rank failed, from the exits ExitWatch saw (launch.exits.first_to_exit)."""

from __future__ import annotations

import signal

from gpu_watchdog.launch.exits import first_to_exit

KILLED = signal.SIGKILL  # a waitpid status: killed by SIGKILL
TERMINATED = signal.SIGTERM
EXIT_1 = 1 << 8


def test_torchruns_teardown_signals_leave_the_rank_that_failed() -> None:
    exits = {2: (100.0, EXIT_1), 0: (100.2, TERMINATED), 1: (100.2, TERMINATED)}
    assert first_to_exit(exits) == (2,)


def test_a_rank_whose_status_was_reaped_by_its_parent_is_named_when_it_was_alone_first() -> None:
    assert first_to_exit({1: (100.0, None)}) == (1,)


def test_ranks_that_exit_after_the_launched_command_were_torn_down_by_its_end() -> None:
    """Ray: actor 1 killed with SIGKILL (seen with its status), the driver's ray.get raised and the driver exited,
    then actor 0 exited on its own code as Ray shut its workers down: actor 1 failed, not actor 0."""
    exits = {1: (100.0, KILLED), 0: (100.6, EXIT_1)}
    assert first_to_exit(exits) == (0,)  # without the command's exit time, the exit code of its own wins
    assert first_to_exit(exits, command_exited_at=100.4) == (1,)


def test_a_first_exit_whose_status_was_reaped_away_is_the_failure_when_it_was_alone() -> None:
    """Ray: actor 1 SIGKILLed and reaped by the raylet at once (no status), the driver's shutdown then ended actor 0
    with an exit code of its own before the driver itself exited (CI saw actor 0 named)."""
    exits = {1: (100.0, None), 0: (100.5, EXIT_1)}
    assert first_to_exit(exits, command_exited_at=100.7) == (1,)
    assert first_to_exit({1: (100.0, None), 0: (100.01, EXIT_1)}) == (0,)  # seen in one wakeup: the code tells


def test_when_every_rank_exits_after_the_command_they_are_judged_as_before() -> None:
    exits = {1: (101.0, KILLED), 0: (101.0, EXIT_1)}
    assert first_to_exit(exits, command_exited_at=100.0) == (0,)
