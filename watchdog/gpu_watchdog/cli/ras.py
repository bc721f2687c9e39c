"""``gpu-watchdog ras``: ask NCCL's RAS socket about the job on this node and name the ranks holding it up."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gpu_watchdog.cli.args import add_common_options, positive_float


def _addr_arg(text: str) -> str:
    from gpu_watchdog.errors import UsageError
    from gpu_watchdog.evidence.nccl_ras.client import parse_addr

    try:
        parse_addr(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_ras(args: argparse.Namespace) -> int:
    from gpu_watchdog.config.load import load_config
    from gpu_watchdog.evidence.nccl_ras.client import (
        ADDR_ENV,
        DEFAULT_ADDR,
        analyze_report,
        format_analysis,
        parse_addr,
        query,
        read_reply,
    )

    cfg = load_config(args.config).ras
    addr = args.addr or cfg.addr or os.environ.get(ADDR_ENV) or DEFAULT_ADDR
    parse_addr(addr)  # $NCCL_RAS_ADDR is not checked by argparse: a bad one is a usage error too
    reply = query(addr, args.timeout or cfg.timeout_s, verbose=args.verbose_status)
    analysis = analyze_report(read_reply(reply))
    if args.json:
        out: dict[str, Any] = {"addr": addr, "server_protocol": reply.server_protocol, "note": reply.note,
                               **analysis.to_json()}
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        if reply.note:
            print(f"note: {reply.note}")
        sys.stdout.write(format_analysis(analysis, addr))
    return 0


def register(sub: Any) -> None:
    r = sub.add_parser("ras", help="ask NCCL's RAS socket for every communicator; name lagging and missing ranks")
    add_common_options(r)
    r.add_argument("--addr", type=_addr_arg, metavar="HOST:PORT",
                   help="RAS socket (default: ras.addr, then $NCCL_RAS_ADDR, then localhost:28028)")
    r.add_argument("--timeout", type=positive_float, metavar="S", help="whole query (default: ras.timeout_s)")
    r.add_argument("--verbose-status", action="store_true", help="send VERBOSE STATUS instead of STATUS")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_ras)
