"""Parameters of a node drain (pure): which hook drains, and the values substituted into its argv.

The drain hook is ``faults.drain_hook`` (a ``[hooks.NAME]`` of the config) when set, else the argv
``faults.drain_command`` (default: Slurm ``scontrol update nodename={node} state=drain reason=…``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpu_watchdog.config.schema import FaultsConfig, HookSpec
from gpu_watchdog.errors import UsageError, WatchdogError
from gpu_watchdog.policy.hook_values import placeholder_values

_GPU_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,95}$")
_REASON_BAD = re.compile(r"[^A-Za-z0-9 ._:,=/+-]")


def drain_reason(signature: str, xid: int | None, gpu: str) -> str:
    """A short reason for the scheduler (Slurm shows it in ``sinfo -R``): printable, no shell metacharacters."""
    what = f"Xid {xid}" if xid is not None else signature.replace("_", " ")
    return _REASON_BAD.sub("_", f"{what} on {gpu or 'a GPU'}")[:200]


def drain_values(job_id: str, node: str, level: int, incident: str, reason: str, gpu: str,
                 xid: int | None) -> dict[str, str]:
    """Placeholder values for the drain argv; UsageError when one is not safe to substitute."""
    values = placeholder_values(job_id, node, level, incident)
    if gpu and not _GPU_RE.match(gpu):
        raise UsageError(f"invalid GPU id {gpu!r}")
    values.update(reason=_REASON_BAD.sub("_", reason)[:200], gpu=gpu, xid="" if xid is None else str(int(xid)))
    return values


def drain_spec(cfg: FaultsConfig, hooks: Mapping[str, HookSpec]) -> HookSpec | None:
    """The hook that drains the node: ``faults.drain_hook`` when set, else ``faults.drain_command``; None when
    neither is configured."""
    if cfg.drain_hook:
        spec = hooks.get(cfg.drain_hook)
        if spec is None:
            raise WatchdogError(f"faults.drain_hook: no [hooks.{cfg.drain_hook}] in the config")
        return spec
    if not cfg.drain_command:
        return None
    return HookSpec("drain_command", "command", tuple(cfg.drain_command), cfg.drain_timeout_s)
