"""The docs stay true: docs/config.md documents every key with its real default, and every key it documents is
printed by `config show`; docs/trace-format.md's example trace replays to the output the doc shows, and every
model field is described."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from gpu_watchdog import model
from gpu_watchdog.config.load import load_config
from gpu_watchdog.config.render import toml_value
from gpu_watchdog.config.schema import SECTIONS, HookSpec
from repo_paths import REPO

DOCS = REPO / "docs"
CLI = str(Path(sys.executable).with_name("gpu-watchdog"))


def _sections(text: str) -> dict[str, dict[str, str]]:
    """``## `[name]` `` headings → {key: default cell} from the table under each."""
    out: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"## `\[([\w.]+)\]`", line)
        if m:
            current = out.setdefault(m.group(1), {})
            continue
        m = re.match(r"\| `(\w+)` \| (.*?) \|", line)
        if m and current is not None:
            current[m.group(1)] = m.group(2)
    return out


CONFIG_DOC = _sections((DOCS / "config.md").read_text())


def _documented_default(cell: str) -> str:
    m = re.match(r"`([^`]*)`", cell)
    assert m, f"no default in {cell!r}"
    return m.group(1)


def _expected_default(value: object) -> str | None:
    if isinstance(value, tuple):
        return "[]" if not value else None
    if isinstance(value, Mapping):
        return "{}" if not value else None
    return toml_value(value)


def _all_keys() -> list[tuple[str, str, object]]:
    keys = [(name, f.name, getattr(cls(), f.name)) for name, cls in SECTIONS.items()
            for f in dataclasses.fields(cls)]
    keys += [("hooks.NAME", f.name, f.default) for f in dataclasses.fields(HookSpec) if f.name != "name"]
    return keys


@pytest.mark.parametrize(("section", "key", "default"), _all_keys(), ids=lambda v: str(v)[:40])
def test_every_config_key_is_documented_with_its_default(section: str, key: str, default: object) -> None:
    assert section in CONFIG_DOC, f"docs/config.md has no `[{section}]` section"
    assert key in CONFIG_DOC[section], f"docs/config.md does not document {section}.{key}"
    want = _expected_default(default)
    if want is not None and default is not dataclasses.MISSING:
        assert _documented_default(CONFIG_DOC[section][key]) == want, f"{section}.{key}"


def test_config_doc_documents_no_stale_keys() -> None:
    known: dict[str, set[str]] = {}
    for section, key, _ in _all_keys():
        known.setdefault(section, set()).add(key)
    for section, keys in CONFIG_DOC.items():
        stale = set(keys) - known[section]
        assert not stale, f"[{section}] documents keys that do not exist: {stale}"


def test_every_documented_key_is_in_config_show(tmp_path: Path) -> None:
    """A documented key missing from `config show` would silently fall back to its default on the round trip."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    cfg = tmp_path / "c.toml"
    cfg.write_text('[faults]\ndrain_hook = "d"\n[hooks.d]\nargv = ["/bin/d", "{node}"]\n'
                   '[hooks.r]\ntype = "slurm-requeue"\n')
    r = subprocess.run([CLI, "config", "show", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    shown = tomllib.loads(r.stdout)
    assert set(shown["hooks"]) == {"d", "r"}
    for section, keys in CONFIG_DOC.items():
        if section == "hooks.NAME":
            tables = list(shown["hooks"].values())
        else:
            assert section in shown, f"`config show` prints no [{section}]"
            tables = [shown[section]]
        for table in tables:
            missing = set(keys) - set(table)
            assert not missing, f"`config show` leaves out documented keys of [{section}]: {missing}"


def test_config_doc_example_loads(tmp_path: Path) -> None:
    text = (DOCS / "config.md").read_text()
    example = re.search(r"## Example\s+```toml\n(.*?)```", text, re.S)
    assert example
    p = tmp_path / "c.toml"
    p.write_text(example.group(1))
    cfg = load_config(p)
    assert cfg.detect.confirm_after_s == 20.0 and cfg.recovery.checkpoint_signal == "SIGUSR1"


# -- trace format -------------------------------------------------------------------------------------------
TRACE_DOC = (DOCS / "trace-format.md").read_text()


def _block(lang: str) -> str:
    m = re.search(rf"```{lang}\n(.*?)```", TRACE_DOC, re.S)
    assert m, f"no ```{lang} block in docs/trace-format.md"
    return m.group(1)


def test_the_example_trace_replays_as_documented(tmp_path: Path) -> None:
    trace = tmp_path / "example.trace"
    trace.write_text(_block("jsonl"))
    cfg = tmp_path / "example.toml"
    cfg.write_text(_block("toml"))
    r = subprocess.run([CLI, "replay", "--config", str(cfg), str(trace)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == _block("text")
    r = subprocess.run([CLI, "replay", str(trace)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "no findings\n"


@pytest.mark.parametrize("cls", [model.NodeSample, model.DeviceSample, model.GpuProcess, model.GpuFault,
                                 model.ProcessSample, model.JobIdentity, model.SampleError, model.StackEvidence,
                                 model.RankStack], ids=lambda c: c.__name__)
def test_every_model_field_is_in_the_trace_doc(cls: type) -> None:
    for f in dataclasses.fields(cls):
        assert f"`{f.name}`" in TRACE_DOC or re.search(rf"\b{f.name}\b", TRACE_DOC), f"{cls.__name__}.{f.name}"


def test_every_test_docs_reliability_names_exists() -> None:
    """The fault table (docs/reliability.md) cites tests; each must exist, or the fault suite silently shrinks."""
    import ast

    from reliability_refs import fault_tests

    refs = fault_tests(REPO / "docs" / "reliability.md")
    assert len(refs) >= 15
    missing = []
    for path, name in sorted(refs, key=lambda r: (r[0], r[1] or "")):
        f = REPO / path
        if not f.is_file():
            missing.append(path)
            continue
        if name is not None:
            defs = {n.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.FunctionDef)}
            if name.split("[")[0] not in defs:
                missing.append(f"{path}::{name}")
    assert missing == []


def test_the_json_contract_is_in_the_repository_and_names_every_summary_field(tmp_path: Path) -> None:
    """The contract other tools rely on lives in docs/json-contract.md (README links it, nothing points outside the
    repository), and names every field a new incident's summary has."""
    from gpu_watchdog.model import Finding
    from gpu_watchdog.store.incidents import IncidentStore

    readme = (REPO / "README.md").read_text()
    assert "(docs/json-contract.md)" in readme
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        assert "../shared/" not in page.read_text(), page
    contract = (DOCS / "json-contract.md").read_text()
    finding = Finding("stall", "idle_held", "j", (0, 1), (1,), 1.0, 6.0, (), "no progress", "stacks")
    summary = IncidentStore(tmp_path).create(finding, "node").summary
    missing = [key for key in summary if f"`{key}`" not in contract]
    assert not missing, f"summary fields not in docs/json-contract.md: {missing}"


def test_the_layer_order_in_one_stall_md_is_the_one_the_import_test_keeps() -> None:
    from test_imports import LAYERS

    text = (REPO / "docs" / "one-stall.md").read_text()
    drawn = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text)
    assert drawn is not None, "docs/one-stall.md lost its layers line"
    assert tuple(re.findall(r"`(\w+)`", drawn.group(1))) == LAYERS
