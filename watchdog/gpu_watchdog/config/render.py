"""``gpu-watchdog config show``: the effective Config as TOML that ``load_config`` reads back to an equal Config.

Every section is rendered, ``[daemon]`` and each ``[hooks.NAME]`` included, from the dataclass fields, so a key
added to the schema is printed without a change here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from gpu_watchdog.config.schema import SECTIONS, Config

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_key(key: str) -> str:
    """A bare key when TOML allows one, else a quoted key."""
    return key if _BARE_KEY.match(key) else toml_value(key)


def toml_value(v: Any) -> str:
    """One TOML value on one line (strings escaped, tables inline)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        # A JSON string is a TOML basic string once DEL is escaped too (raw non-ASCII: TOML has no surrogates).
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, Mapping):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)  # int, or a finite float (the loader refuses nan and inf)


def _is_table_array(v: Any) -> bool:
    return isinstance(v, tuple) and bool(v) and all(dataclasses.is_dataclass(x) for x in v)


def _table(name: str, obj: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """``[name]`` with obj's plain keys, then a ``[[name.field]]`` per element of a tuple of dataclasses."""
    lines = [f"[{name}]"]
    arrays = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in skip:
            continue
        if _is_table_array(value):
            arrays.append((f.name, value))
        else:
            lines.append(f"{toml_key(f.name)} = {toml_value(value)}")
    for field_name, items in arrays:
        for item in items:
            lines += ["", f"[[{name}.{toml_key(field_name)}]]"]
            lines += [f"{toml_key(f.name)} = {toml_value(getattr(item, f.name))}" for f in dataclasses.fields(item)]
    return lines + [""]


def render_toml(cfg: Config) -> str:
    """Every section of ``cfg``, ``[daemon]`` and ``[hooks.NAME]`` included, as loadable TOML."""
    lines: list[str] = []
    for name in SECTIONS:
        lines += _table(name, getattr(cfg, name))
    for name, hook in cfg.hooks.items():
        lines += _table(f"hooks.{toml_key(name)}", hook, skip=("name",))  # the name is the table's
    return "\n".join(lines)
