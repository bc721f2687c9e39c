"""Values substituted into hook and drain argv templates: validated first, one template element always yields
exactly one argv element (no shell), so a value can neither add arguments nor start an option."""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpu_watchdog.errors import UsageError
from gpu_watchdog.model import validate_job_id

_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_INCIDENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def placeholder_values(job_id: str, node: str, level: int, incident: str) -> dict[str, str]:
    validate_job_id(job_id)
    if not _NODE_RE.fullmatch(node):
        raise UsageError(f"invalid node name {node!r}")
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < 1000:
        raise UsageError(f"invalid fallback level {level!r}")
    if incident and not _INCIDENT_RE.fullmatch(incident):
        raise UsageError(f"invalid incident id {incident!r}")
    return {"job_id": job_id, "node": node, "level": str(level), "incident": incident}


def render_argv(template: tuple[str, ...], values: Mapping[str, str]) -> tuple[str, ...]:
    """One output element per template element; values were validated by ``placeholder_values``."""
    return tuple(element.format_map(dict(values)) for element in template)
