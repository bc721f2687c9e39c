"""The package's imports: no cycles (deferred imports inside functions included), and dependencies point one way,
down the pipeline. Imports under ``if TYPE_CHECKING:`` are for annotations only and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import REPO

PKG = REPO / "watchdog" / "gpu_watchdog"

# Lowest first: a module may import its own stage and the stages before it, never one after it.
LAYERS = ("errors", "model", "atomic", "config", "job", "sample", "evidence", "detect", "policy", "store", "act",
          "export", "engine", "agent", "launch", "daemon", "demo", "cli")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, at any depth of the file."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "gpu_watchdog":
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    return {m: imports_of(p, modules) - {m} for m, p in files.items()}


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    return cycles


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles() -> None:
    assert find_cycles(graph()) == []


def test_every_module_belongs_to_a_known_stage() -> None:
    unknown = sorted({stage(m) for m in graph()} - set(LAYERS) - {"", "__main__", "__init__"})
    assert unknown == [], f"add these to LAYERS in their pipeline position: {unknown}"


def test_dependencies_point_down_the_pipeline() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{m} -> {n}" for m, deps in graph().items() for n in deps
                    if stage(m) in rank and stage(n) in rank and rank[stage(n)] > rank[stage(m)])
    assert upward == []
