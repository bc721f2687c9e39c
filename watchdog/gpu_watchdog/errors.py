"""Errors a user can cause, each tied to a documented exit code (see README "Exit codes")."""

from __future__ import annotations

# sysexits(3)-style codes, documented in README.md.
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 64  # bad command-line arguments
EXIT_DATAERR = 65  # bad input data (trace file)
EXIT_NOINPUT = 66  # an input file does not exist
EXIT_UNAVAILABLE = 69  # a required service (NVML, py-spy) is unavailable
EXIT_CONFIG = 78  # bad configuration
EXIT_SOFTWARE = 70  # launch: an internal error the agent cannot go on from; the job was stopped first
EXIT_GPU_FAULT = 74  # launch: a GPU of the job faulted (lost, reset required, critical Xid); run it elsewhere
EXIT_BUDGET_SPENT = 75  # launch: the job kept hanging and the restart budget is spent (do not requeue blindly)
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE: the reader of our output went away (``… | head``); we stop quietly

# The one list of the codes the program itself chooses, shown by ``gpu-watchdog --help``; README's "Exit codes"
# table says the same in more words (tests/unit/cli/test_exit_codes.py holds the two and the program together).
# 85/86 are the in-job client's (gpu_watchdog.job.protocol.CLIENT_EXIT_CODES), not the CLI's; --help lists them too.
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_FAILURE: "a check or a dump failed",
    EXIT_USAGE: "bad command-line arguments",
    EXIT_DATAERR: "bad input data (trace, stacks file, NCCL RAS report)",
    EXIT_NOINPUT: "an input does not exist or cannot be read (config file, trace, incident, stacks or state dir)",
    EXIT_UNAVAILABLE: "a required service is unavailable (NVML, py-spy, the metrics port, NCCL RAS, the daemon)",
    EXIT_SOFTWARE: "launch: internal error; the job was stopped first",
    EXIT_GPU_FAULT: "launch: a GPU of the job faulted; the node was drained",
    EXIT_BUDGET_SPENT: "launch: the restart budget is spent",
    EXIT_CONFIG: "bad configuration file content (one line names the key)",
    EXIT_PIPE_CLOSED: "the output pipe was closed by its reader",
}


class WatchdogError(Exception):
    """An error with a one-line message meant for the user and an exit code."""

    exit_code = EXIT_FAILURE


class ConfigError(WatchdogError):
    exit_code = EXIT_CONFIG


class UsageError(WatchdogError):
    exit_code = EXIT_USAGE


class NoInputError(WatchdogError):
    """An input named on the command line does not exist or cannot be read."""

    exit_code = EXIT_NOINPUT


class TraceError(WatchdogError):
    exit_code = EXIT_DATAERR


class StateUnreadable(WatchdogError):
    """A state file exists (or may) but cannot be read: never taken for "no state" (``env`` would hand a job
    level 0 silently)."""

    exit_code = EXIT_NOINPUT


class BackendUnavailable(WatchdogError):
    """The requested sampling backend cannot start (e.g. NVML driver not loaded)."""

    exit_code = EXIT_UNAVAILABLE


class ServiceUnavailable(WatchdogError):
    """A service the command needs, or must not compete with, is there or not as required: no daemon answers
    ``hook``'s request, or another daemon already serves ``run``'s control socket."""

    exit_code = EXIT_UNAVAILABLE


class MissingExtra(WatchdogError):
    """An optional extra the command needs is not installed, e.g. matplotlib for ``--plot`` (the ``[plot]`` extra)."""

    exit_code = EXIT_UNAVAILABLE
