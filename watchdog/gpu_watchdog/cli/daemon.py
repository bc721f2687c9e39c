"""``gpu-watchdog run`` (the node daemon) and ``gpu-watchdog hook …`` (its control-socket client)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gpu_watchdog.cli.args import add_common_options, checked_overrides, pid_arg, positive_float
from gpu_watchdog.errors import EXIT_FAILURE, ServiceUnavailable, UsageError


def _run_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"not a run number (an integer >= 0): {text!r}")
    return value


def cmd_run(args: argparse.Namespace) -> int:
    from gpu_watchdog.daemon.service import main_run

    overrides = checked_overrides(args)
    if args.socket:
        overrides["daemon.control_socket"] = args.socket
    return main_run(args.config, overrides)


def _socket_path(args: argparse.Namespace) -> str:
    if args.socket:
        return str(args.socket)
    env = os.environ.get("GPU_WATCHDOG_SOCKET")
    if env:
        return env
    from gpu_watchdog.config.load import load_config

    socket_path = load_config(args.config).daemon.control_socket
    if not socket_path:
        raise UsageError("daemon.control_socket is empty in the config: the daemon has no control API")
    return socket_path


def cmd_hook(args: argparse.Namespace) -> int:
    from gpu_watchdog.daemon.control import request

    req: dict[str, Any] = {"op": args.hook_op}
    if args.hook_op in ("job-start", "job-end", "preempt", "restart"):
        if not args.job_id:
            raise UsageError(f"hook {args.hook_op} needs --job-id")
        req["job_id"] = args.job_id
    if args.hook_op == "job-start":
        if not args.pid and not args.cgroup:
            raise UsageError("hook job-start needs --pid (repeatable) or --cgroup")
        req["pids"] = list(args.pid or [])
        if args.cgroup:
            req["cgroup"] = args.cgroup
        if args.restart_hook:
            req["restart_hook"] = args.restart_hook
        req["checkpoint_opt_in"] = bool(args.checkpoint)
        if args.run is not None:
            req["run"] = args.run
    if args.hook_op == "preempt" and args.timeout:
        req["timeout_s"] = args.timeout
    if args.hook_op == "incidents":
        req["limit"] = args.limit
    timeout = (args.timeout or 60.0) + 10.0
    try:
        reply = request(_socket_path(args), req, timeout_s=timeout)
    except ServiceUnavailable as e:
        exports = _unregistered_exports(args, str(e))
        if exports is None:
            raise
        sys.stdout.write(exports)
        return 0
    if args.export and args.hook_op == "job-start" and reply.get("ok"):
        sys.stdout.write(_task_prolog_exports(reply))
    elif args.json:
        json.dump(reply, sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif reply.get("ok") and args.hook_op in ("status", "incidents"):
        sys.stdout.write(_readable(args.hook_op, reply))
    elif reply.get("ok"):
        print(f"gpu-watchdog: {args.hook_op} ok" + (f" (job {reply['job_id']})" if "job_id" in reply else ""))
    if not reply.get("ok"):
        print(f"gpu-watchdog: {args.hook_op} refused: {reply.get('error', 'unknown error')}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def _unregistered_exports(args: argparse.Namespace, why: str) -> str | None:
    """``hook job-start --export`` with this node's daemon down: a multi-node job's other nodes run its run at the
    job-wide level (``fallback.shared_dir`` in ``--config``), so this node's ranks must get the same NCCL settings
    even unwatched. The TaskProlog lines of the run's record, with a note; None when there is none to read."""
    if not (args.export and args.hook_op == "job-start" and args.run is not None and args.config):
        return None
    from gpu_watchdog.config.load import load_config
    from gpu_watchdog.store.job_runs import JobRuns

    runs = JobRuns.from_config(load_config(args.config))
    record = runs.current(args.job_id, args.run) if runs is not None else None
    if record is None:
        return None
    return (f"print gpu-watchdog: job {args.job_id} not registered ({why}); run {args.run} gets the job-wide "
            f"settings of level {int(record.get('level') or 0)} from {runs.root if runs else ''}\n"
            + _task_prolog_exports({"env": record.get("env") or {}, "level": record.get("level")}))


def _readable(op: str, reply: dict[str, Any]) -> str:
    """``hook status`` / ``hook incidents`` for people (``--json``: the daemon's reply as it is)."""
    if op == "incidents":
        rows = [f"{i.get('id')}  {i.get('kind'):<9} job={i.get('job_id')} {i.get('outcome') or 'in progress'}"
                for i in reply.get("incidents") or []]
        return "\n".join(rows or ["no incidents"]) + "\n"
    lines = [str(reply.get("status", "")),
             f"registered: {', '.join(reply.get('registered') or []) or 'none'}",
             f"hooks: {', '.join(reply.get('hooks') or []) or 'none'}"]
    if reply.get("store_problem"):
        lines.append(f"state store: {reply['store_problem']}")
    for job, st in sorted((reply.get("jobs") or {}).items()):
        lines.append(f"job {job}: {st.get('state')}, ranks {','.join(map(str, st.get('ranks') or [])) or '-'}"
                     + (f" ({st['signature']})" if st.get("signature") else ""))
    return "\n".join(lines) + "\n"


def _task_prolog_exports(reply: dict[str, Any]) -> str:
    """The job-start reply as Slurm TaskProlog lines: the fallback overlay, the level, the run's control dir and the
    Flight Recorder settings the job's own environment (this process's: the TaskProlog runs with it) leaves unset."""
    from gpu_watchdog.evidence.flight_recorder.dumps import recording_env
    from gpu_watchdog.job.protocol import CONTROL_DIR_ENV, FALLBACK_LEVEL_ENV
    from gpu_watchdog.policy.ladder import task_prolog_lines

    env = {k: str(v) for k, v in dict(reply.get("env") or {}).items()}
    frc = reply.get("flight_recorder")
    if isinstance(frc, dict) and isinstance(frc.get("buffer_size"), int) and isinstance(frc.get("dir"), str):
        env.update(recording_env({**os.environ, **env}, frc["buffer_size"], frc["dir"]))
    env[FALLBACK_LEVEL_ENV] = str(int(reply.get("level") or 0))
    if reply.get("control_dir"):
        env[CONTROL_DIR_ENV] = str(reply["control_dir"])
    gone = reply.get("gone") or []
    note = f"print gpu-watchdog: pids {gone} had exited before registration\n" if gone else ""
    # Not registered here: a control dir srun copied from the batch host names that node's directory.
    unset = "" if reply.get("control_dir") else f"unset {CONTROL_DIR_ENV}\n"
    return note + unset + task_prolog_lines(env)


def register(sub: Any) -> None:
    r = sub.add_parser("run", help="the node daemon (systemd service)")
    add_common_options(r, backend=True, state_dir=True, metrics=True)
    r.add_argument("--socket", metavar="PATH", help="control socket (default: daemon.control_socket)")
    r.set_defaults(func=cmd_run)

    h = sub.add_parser("hook", help="talk to the running daemon: scheduler prolog/epilog, preStop, status")
    h.add_argument("hook_op", choices=("job-start", "job-end", "preempt", "restart", "status", "incidents"))
    h.add_argument("--config", metavar="F", help="read daemon.control_socket from this config")
    h.add_argument("--socket", metavar="PATH", help="control socket (default: $GPU_WATCHDOG_SOCKET, then config)")
    h.add_argument("--job-id", metavar="ID")
    h.add_argument("--pid", type=pid_arg, action="append", metavar="PID", help="a process of the job (repeatable)")
    h.add_argument("--cgroup", metavar="PATH", help="the job's cgroup (relative to /sys/fs/cgroup)")
    h.add_argument("--restart-hook", metavar="NAME", help="a hook name from the daemon's config")
    h.add_argument("--checkpoint", action="store_true", help="the job opts in to checkpoint requests")
    h.add_argument("--run", type=_run_arg, metavar="N",
                   help="job-start: the job's run (Slurm: SLURM_RESTART_COUNT); one control dir per run")
    h.add_argument("--export", action="store_true",
                   help="job-start: print the job's fallback env and control dir as Slurm TaskProlog lines")
    h.add_argument("--timeout", type=positive_float, metavar="S", help="preempt: longest wait for the ack")
    h.add_argument("--limit", type=int, default=20, help="incidents: how many")
    h.add_argument("--json", action="store_true", help="print the daemon's JSON reply (default: readable text)")
    h.set_defaults(func=cmd_hook)
