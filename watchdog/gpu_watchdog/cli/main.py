"""The ``gpu-watchdog`` command line. Parsing and dispatch only; each command's work lives in its module.

Exit codes: ``errors.EXIT_CODES`` (shown by ``--help``; README "Exit codes" says the same in more words).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gpu_watchdog import __version__
from gpu_watchdog.cli.args import add_common_options, checked_overrides, pid_arg, positive_float
from gpu_watchdog.errors import EXIT_CODES, EXIT_PIPE_CLOSED, EXIT_USAGE, UsageError, WatchdogError
from gpu_watchdog.model import rank_tag

DESCRIPTION = ("Find hung distributed PyTorch jobs (stalled NCCL/gloo collectives), name the culprit rank from "
               "its stack, checkpoint, stop and restart the job with fallback NCCL settings. "
               "Try it: gpu-watchdog demo")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 64 (argparse's default is 2)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _load_cfg(args: argparse.Namespace) -> Any:
    """The one read of the config file for a command: the file plus the command line's overrides."""
    from gpu_watchdog.config.load import load_config

    return load_config(args.config, checked_overrides(args))


# -- commands ---------------------------------------------------------------------------------------
def cmd_config_show(args: argparse.Namespace) -> int:
    from gpu_watchdog.config.render import render_toml

    sys.stdout.write(render_toml(_load_cfg(args)))
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from gpu_watchdog.sample.backends import choose_backend
    from gpu_watchdog.sample.record import record

    cfg = _load_cfg(args)
    backend, why = choose_backend(cfg.agent.backend, hostname=cfg.agent.hostname,
                                  min_window_s=cfg.detect.progress_min_window_s)
    print(f"gpu-watchdog: recording with the {why} to {args.output}", file=sys.stderr)
    try:
        n = record(backend, args.output, args.duration, args.interval or cfg.agent.interval_s, job_id=args.job)
    finally:
        backend.close()
    print(f"gpu-watchdog: wrote {n} samples to {args.output}", file=sys.stderr)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from gpu_watchdog.detect.replay import replay_trace

    cfg = _load_cfg(args)
    findings = replay_trace(args.trace, cfg.detect)
    if args.json:
        json.dump([f.to_json() for f in findings], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for f in findings:
            culprit = f" culprit {','.join(map(str, f.culprit_ranks))}" if f.culprit_ranks else ""
            print(f"{f.kind} {f.signature} job={f.job_id} ranks={','.join(map(str, f.ranks))}{culprit} "
                  f"onset={f.onset:.3f} confirmed_at={f.confirmed_at:.3f} "
                  f"(+{f.confirmed_at - f.onset:.1f}s): {f.detail}")
        if not findings:
            print("no findings")
    return 0


def cmd_dump_stacks(args: argparse.Namespace) -> int:
    from gpu_watchdog.evidence.stacks.dump import main_dump_stacks

    return main_dump_stacks(args.pids, native=args.native, as_json=args.json, timeout_s=args.timeout)


def cmd_analyze(args: argparse.Namespace) -> int:
    from gpu_watchdog.evidence.analyze import main_analyze

    return main_analyze(args.dirs, as_json=args.json, out=sys.stdout)


def cmd_launch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gpu_watchdog.export.health import LoopHealth
    from gpu_watchdog.export.http import start_metrics
    from gpu_watchdog.launch.launcher import Launcher, resolve_command

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("launch needs a command: gpu-watchdog launch [options] -- CMD ARGS...")
    cmd = resolve_command(cmd)  # a command that cannot run: one line, before any banner, port, state dir or log
    cfg = _load_cfg(args)  # read once: faults.drain_hook names one of cfg.hooks (the loader checked that)
    health = LoopHealth.for_interval(cfg.agent.interval_s)  # one health for /healthz and the loop
    metrics, server = start_metrics(cfg, health, config_path=args.config, overrides=checked_overrides(args))
    try:
        # The job's stdout is the user's own output and stays on the console as it is; its stderr is kept whole
        # in the job log and reaches the console without the noise of a deliberate stop (-v: untouched).
        return Launcher(cfg, cmd, state_dir=Path(args.state_dir) if args.state_dir else None, job_id=args.job_id,
                        metrics=metrics, health=health, hooks=cfg.hooks,
                        job_output="console" if args.verbose else "filtered").run()
    finally:
        if server is not None:
            server.stop()


def cmd_incidents(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gpu_watchdog.config.schema import resolve_state_dir
    from gpu_watchdog.store import require_state_dir
    from gpu_watchdog.store.incidents import IncidentStore

    cfg = _load_cfg(args)
    state_dir = Path(args.state_dir) if args.state_dir else resolve_state_dir(cfg)
    require_state_dir(state_dir, "incidents")  # a mistyped --state-dir is not "no incidents": exit 66
    store = IncidentStore(state_dir)
    if args.plot and args.action != "show":
        raise UsageError("--plot draws one incident: gpu-watchdog incidents show ID --plot FILE.png")
    if args.action == "show":
        if not args.id:
            raise UsageError("incidents show needs an incident id")
        inc = store.get(args.id)
        picture = None
        if args.plot:
            from gpu_watchdog.export.plot import plot_incident

            picture = plot_incident(inc.summary, inc.dir, args.plot, cfg.detect)
        if args.json:
            json.dump(inc.summary, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            report = inc.dir / "report.txt"
            try:
                text = report.read_text()
            except OSError:  # an incident the daemon only observed, or one whose report could not be written
                from gpu_watchdog.evidence.report import render_report

                text = render_report(inc.summary, [])
            sys.stdout.write(text)
        if picture is not None:
            print(f"picture: {picture}", file=sys.stderr if args.json else sys.stdout)
        return 0
    items = store.list()
    if args.json:
        json.dump(items, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    for s in items:
        culprit = ",".join(rank_tag(r) for r in s.get("culprit_ranks") or []) or "?"
        print(f"{s['id']}  {s['kind']:<9} {s.get('signature') or '':<14} job={s.get('job_id')} culprit={culprit} "
              f"collective={s.get('collective') or '-'}")
    if not items:
        print("no incidents")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from gpu_watchdog.config.schema import resolve_state_dir
    from gpu_watchdog.model import validate_job_id
    from gpu_watchdog.policy.ladder import export_lines
    from gpu_watchdog.store.fallback_levels import FallbackStore

    store = FallbackStore(args.state_dir or resolve_state_dir(_load_cfg(args)))
    data = store.read(validate_job_id(args.job))  # unreadable state: StateUnreadable, exit 66, one line
    sys.stdout.write(f"# gpu-watchdog fallback for job {args.job}: level {data.get('level', 0)}"
                     f" ({data.get('name', 'none')})\n")
    sys.stdout.write(export_lines(dict(data.get("env") or {})))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gpu_watchdog.cli.doctor import run_doctor
    from gpu_watchdog.config.schema import resolve_state_dir

    cfg = _load_cfg(args)
    state_dir = Path(args.state_dir) if args.state_dir else resolve_state_dir(cfg)
    return run_doctor(state_dir, cfg.stacks.py_spy or None, args.p2p, args.json, backend=cfg.agent.backend)


def cmd_demo(args: argparse.Namespace) -> int:
    from gpu_watchdog.demo.runner import run_demo

    return run_demo(_load_cfg(args), keep=args.keep)


# -- parser -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from gpu_watchdog.job.protocol import CLIENT_EXIT_CODES

    every = {**EXIT_CODES, **CLIENT_EXIT_CODES}
    codes = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in sorted(every.items()))
    import textwrap

    p = _Parser(prog="gpu-watchdog", description=textwrap.fill(DESCRIPTION, 80),
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=f"exit codes (launch: otherwise the job's own exit code; 128+N: stopped by signal N):\n{codes}")
    p.add_argument("--version", action="version", version=f"gpu-watchdog {__version__}")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging; launch: the job's stderr reaches the console untouched")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("config", help="show the effective configuration")
    csub = c.add_subparsers(dest="config_command", metavar="show", parser_class=_Parser)
    csub.required = True
    show = csub.add_parser("show", help="print the effective config as TOML")
    add_common_options(show)
    show.set_defaults(func=cmd_config_show)

    r = sub.add_parser("record", help="sample the node and write a trace")
    add_common_options(r, backend=True)
    r.add_argument("--duration", type=positive_float, required=True, metavar="S")
    r.add_argument("--output", required=True, metavar="F")
    r.add_argument("--interval", type=positive_float, metavar="S", help="default: agent.interval_s")
    r.add_argument("--job", metavar="JOB_ID", help="keep only this job's processes and devices (default: all)")
    r.set_defaults(func=cmd_record)

    rp = sub.add_parser("replay", help="run the detector over a trace")
    add_common_options(rp)
    rp.add_argument("trace")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_replay)

    d = sub.add_parser("dump-stacks", help="dump the Python stacks of processes with py-spy, in parallel")
    d.add_argument("pids", nargs="+", type=pid_arg, metavar="PID")
    d.add_argument("--native", action="store_true", help="include native frames")
    d.add_argument("--json", action="store_true")
    d.add_argument("--timeout", type=positive_float, default=5.0, metavar="S", help="per-pid timeout")
    d.set_defaults(func=cmd_dump_stacks)

    a = sub.add_parser("analyze", help="merge incident directories from several nodes; name the culprit")
    a.add_argument("dirs", nargs="+", metavar="DIR")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_analyze)

    la = sub.add_parser("launch", help="run a job under the watchdog; restart it on stalls")
    add_common_options(la, backend=True, state_dir=True, metrics=True)
    la.add_argument("--job-id", help="stable job id (fallback level is kept per job id)")
    la.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    la.set_defaults(func=cmd_launch)

    inc = sub.add_parser("incidents", help="list incidents, or show one")
    add_common_options(inc, state_dir=True)
    inc.add_argument("action", nargs="?", choices=("list", "show"), default="list")
    inc.add_argument("id", nargs="?")
    inc.add_argument("--json", action="store_true", help="list: a JSON array, oldest first; show: the summary")
    inc.add_argument("--plot", metavar="FILE", help="show: draw the incident's trace to FILE (.png or .svg; "
                     "needs the [plot] extra)")
    inc.set_defaults(func=cmd_incidents)

    e = sub.add_parser("env", help="print a job's fallback overlay as export lines (for restart scripts)")
    add_common_options(e, state_dir=True)
    e.add_argument("--job", required=True, metavar="ID")
    e.set_defaults(func=cmd_env)

    doc = sub.add_parser("doctor", help="preflight checks: NVML, py-spy/ptrace, /dev/shm, kernel, state dir")
    add_common_options(doc, state_dir=True, backend=True)
    doc.add_argument("--p2p", action="store_true", help="also test all_reduce across local GPUs (GPU boxes)")
    doc.add_argument("--json", action="store_true")
    doc.set_defaults(func=cmd_doctor)

    dm = sub.add_parser("demo", help="a real hang on a CPU job, found and recovered (no GPU needed)")
    add_common_options(dm, backend=True)
    dm.add_argument("--keep", metavar="DIR", help="work in DIR and keep it")
    dm.set_defaults(func=cmd_demo)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


# Later commands (launch, run, incidents, env, hook, doctor, demo) register themselves here.
_EXTRA_COMMANDS: list[Callable[[Any], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s gpu-watchdog %(levelname)s %(message)s", stream=sys.stderr)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _pipe_closed()
    except UsageError as e:
        print(f"gpu-watchdog: error: {e}", file=sys.stderr)
        return e.exit_code
    except WatchdogError as e:
        print(f"gpu-watchdog: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


def _pipe_closed() -> int:
    """The reader of our output went away (``gpu-watchdog … | head``): stop quietly. stdout is pointed at
    /dev/null so that the interpreter's final flush does not report the same closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_PIPE_CLOSED


def _register_daemon_commands(sub: Any) -> None:
    from gpu_watchdog.cli.daemon import register

    register(sub)


_EXTRA_COMMANDS.append(_register_daemon_commands)


def _register_ras_command(sub: Any) -> None:
    from gpu_watchdog.cli.ras import register

    register(sub)


_EXTRA_COMMANDS.append(_register_ras_command)
