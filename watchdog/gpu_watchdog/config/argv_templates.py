"""The one validator for argv templates: ``[hooks.NAME] argv`` and ``faults.drain_command``.

A template element may only name known placeholders, bare: ``str.format`` would otherwise let a config reach
attributes, indexes or conversions of the substituted values. ``act.hooks.render_argv`` fills one output
element per template element, so checking each element here is enough to keep values out of argv[0].
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from gpu_watchdog.errors import ConfigError


def validate_template(key: str, element: str, allowed_placeholders: Sequence[str]) -> None:
    """Only ``allowed_placeholders``, with no format spec, conversion, indexing or attribute access."""
    try:
        parsed = list(string.Formatter().parse(element))
    except ValueError as e:
        raise ConfigError(f"config: {key}: bad placeholder syntax in {element!r} ({e})") from None
    for _lit, name, spec, conv in parsed:
        if name is not None and (name not in allowed_placeholders or spec or conv):
            raise ConfigError(f"config: {key}: unknown placeholder {{{name}}} in {element!r}; allowed: "
                              + " ".join(f"{{{p}}}" for p in allowed_placeholders))


def validate_argv(key: str, value: Any, allowed_placeholders: Sequence[str], *,
                  may_be_empty: bool) -> tuple[str, ...]:
    """An argv template: an array of strings whose argv[0] is a fixed program; each element checked above."""
    if (not isinstance(value, list) or not all(isinstance(a, str) for a in value)
            or (not value and not may_be_empty)):
        what = "an array" if may_be_empty else "a non-empty array"
        raise ConfigError(f"config: {key} must be {what} of strings, got {value!r}")
    if value and (not value[0] or "{" in value[0]):
        raise ConfigError(f"config: {key}[0] must be a fixed program name or path")
    for i, element in enumerate(value):
        if "\0" in element:
            raise ConfigError(f"config: {key}[{i}] contains a NUL byte")
        validate_template(f"{key}[{i}]", element, allowed_placeholders)
    return tuple(value)
