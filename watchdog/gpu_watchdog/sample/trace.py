"""Versioned JSONL traces of samples (docs/trace-format.md): ``record`` writes them, ``replay`` reads them.

Line 1 is a header ``{"type": "header", "format": "gpu-watchdog-trace", "version": 2, ...}``; then one
JSON object per line: ``sample`` (a NodeSample), ``stacks`` (a StackEvidence) or ``event`` (a free-form
annotation such as a test's true hang onset; replay ignores it). Every field is checked on read and a bad
line is one TraceError naming the line and the field. A field a trace leaves out takes its model default, so
version 1 (no ``mem_util_percent``, no ``pcie_link_bytes_per_s``) reads with both None.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from gpu_watchdog.errors import EXIT_NOINPUT, NoInputError, TraceError
from gpu_watchdog.model import NodeSample, StackEvidence

FORMAT = "gpu-watchdog-trace"
DIR_TRACE = "trace.jsonl"  # the trace inside an incident directory: ``replay DIR`` reads it
# 2: devices gained mem_util_percent and pcie_link_bytes_per_s (docs/trace-format.md, "Versions"); later, additively,
# the clocks event reasons, the SM clock's maximum, the current and maximum PCIe link and the replay counter.
VERSION = 2
SUPPORTED_VERSIONS = (1, 2)


def header(backend: str, hostname: str, interval_s: float, created: float) -> dict[str, Any]:
    return {"type": "header", "format": FORMAT, "version": VERSION, "backend": backend, "hostname": hostname,
            "interval_s": interval_s, "created": created}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # per model class: an incident writes 120 s of samples at once


def _plain(obj: Any) -> Any:
    names = _FIELD_NAMES.get(type(obj))
    if names is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    if names is not None:
        return {n: _plain(getattr(obj, n)) for n in names}
    if isinstance(obj, (str, int, float)) or obj is None:
        return obj
    if isinstance(obj, (tuple, list)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def sample_record(sample: NodeSample) -> dict[str, Any]:
    return {"type": "sample", **_plain(sample)}


def stacks_record(ev: StackEvidence) -> dict[str, Any]:
    return {"type": "stacks", **_plain(ev)}


class TraceWriter:
    """Writes a trace line by line, flushing each so a killed recorder leaves a valid prefix."""

    def __init__(self, f: IO[str], backend: str, hostname: str, interval_s: float, created: float) -> None:
        self._f = f
        self._write(header(backend, hostname, interval_s, created))

    def _write(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._f.flush()

    def sample(self, s: NodeSample) -> None:
        self._write(sample_record(s))

    def stacks(self, ev: StackEvidence) -> None:
        self._write(stacks_record(ev))

    def event(self, t: float, name: str, **fields: Any) -> None:
        self._write({"type": "event", "t": t, "name": name, **fields})


class TraceNotFound(TraceError, NoInputError):
    """The trace file does not exist or cannot be read, e.g. a directory (exit 66, "missing input")."""

    exit_code = EXIT_NOINPUT


# -- decoding -----------------------------------------------------------------------------------------
class _FieldError(Exception):
    pass


def _decode(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _FieldError(f"{path} must not be null")
        non_none = [a for a in args if a is not type(None)]
        return _decode(non_none[0], value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise _FieldError(f"{path} must be a list")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_decode(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _FieldError(f"{path} must be a number")
        if not math.isfinite(value):  # Python's json reads NaN/Infinity
            raise _FieldError(f"{path} must be a finite number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _FieldError(f"{path} must be an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _FieldError(f"{path} must be a string")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _FieldError(f"{path} must be true or false")
        return value
    raise _FieldError(f"{path}: unsupported type {tp}")  # pragma: no cover - a model change missed here


_HINTS: dict[type, dict[str, Any]] = {}


def _decode_dataclass(cls: Any, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise _FieldError(f"{path or 'record'} must be an object")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = f"{path}.{f.name}" if path else f.name
        if f.name in value:
            kwargs[f.name] = _decode(hints[f.name], value[f.name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _FieldError(f"{sub} is missing")
    return cls(**kwargs)


Record = NodeSample | StackEvidence | dict


def stacks_from_record(rec: Any) -> StackEvidence | None:
    """A ``stacks`` record (``stacks_record``) back into StackEvidence; None when it is not one."""
    try:
        ev = _decode_dataclass(StackEvidence, rec, "")
    except _FieldError:
        return None
    return ev if isinstance(ev, StackEvidence) else None


def _lines(f: IO[bytes], p: Path) -> Iterator[str]:
    """The file's lines after the header, decoded one by one so a line that is not UTF-8 is named."""
    for lineno, raw in enumerate(f, start=2):
        try:
            yield raw.decode()
        except UnicodeDecodeError:
            raise TraceError(f"{p}:{lineno}: not UTF-8 text") from None


def read_trace(path: str | Path) -> tuple[dict[str, Any], Iterator[Record]]:
    """Open a trace: returns its header and an iterator over its records (events as plain dicts). A directory
    (an incident's) stands for the ``trace.jsonl`` in it."""
    p = Path(path)
    if p.is_dir():
        if not (p / DIR_TRACE).is_file():
            raise TraceNotFound(f"no trace in {p}: a directory must hold {DIR_TRACE} (an incident's does)")
        p = p / DIR_TRACE
    try:
        f = p.open("rb")  # decoded line by line: a bad byte is reported with its line
    except FileNotFoundError:
        raise TraceNotFound(f"trace not found: {p}") from None
    except OSError as e:  # a directory, no permission: the input cannot be read (sysexits' EX_NOINPUT)
        raise TraceNotFound(f"cannot read trace {p}: {e.strerror}") from None
    try:
        head = json.loads(f.readline().decode())
    except (json.JSONDecodeError, UnicodeDecodeError):  # e.g. a gzipped trace: read_trace takes plain JSONL
        f.close()
        raise TraceError(f"{p}:1: not a gpu-watchdog trace (the first line is not JSON)") from None
    except OSError as e:
        f.close()
        raise TraceError(f"cannot read trace {p}: {e.strerror}") from None
    if not isinstance(head, dict) or head.get("type") != "header" or head.get("format") != FORMAT:
        f.close()
        raise TraceError(f"{p}:1: not a gpu-watchdog trace (no {FORMAT!r} header)")
    if head.get("version") not in SUPPORTED_VERSIONS:
        f.close()
        raise TraceError(f"{p}:1: unsupported trace version {head.get('version')!r} "
                         f"(this gpu-watchdog reads {', '.join(map(str, SUPPORTED_VERSIONS))})")

    def records() -> Iterator[Record]:
        with f:
            for lineno, line in enumerate(_lines(f, p), start=2):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{p}:{lineno}: malformed JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise TraceError(f"{p}:{lineno}: a record must be a JSON object")
                kind = rec.pop("type", None)
                try:
                    if kind == "sample":
                        yield _decode_dataclass(NodeSample, rec, "")
                    elif kind == "stacks":
                        yield _decode_dataclass(StackEvidence, rec, "")
                    elif kind == "event":
                        if not isinstance(rec.get("t"), (int, float)) or not isinstance(rec.get("name"), str):
                            raise _FieldError("an event needs a numeric t and a string name")
                        yield rec
                    else:
                        raise _FieldError(f"unknown record type {kind!r}")
                except _FieldError as e:
                    raise TraceError(f"{p}:{lineno}: {e}") from None
                except TypeError as e:
                    raise TraceError(f"{p}:{lineno}: {e}") from None

    return head, records()
