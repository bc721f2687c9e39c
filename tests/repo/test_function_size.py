"""The deciding layers stay readable: no function in detect/, policy/, act/ or evidence/ over 50 lines or with over
25 branches (each if/elif/else, loop, try handler, with, comprehension, conditional expression and extra boolean
operand counts one). A function that grows past either is split into named steps, not waved through."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import REPO

PKG = REPO / "watchdog" / "gpu_watchdog"
CHECKED = ("detect", "policy", "act", "evidence")
MAX_LINES = 50
MAX_BRANCHES = 25
_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith, ast.ExceptHandler,
             ast.IfExp, ast.comprehension, ast.Match)


def branches(fn: ast.AST) -> int:
    n = 0
    for node in ast.walk(fn):
        if isinstance(node, _BRANCHES):
            n += 1
        if isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        if isinstance(node, ast.If) and node.orelse and not (len(node.orelse) == 1 and isinstance(node.orelse[0],
                                                                                               ast.If)):
            n += 1  # an else
    return n


def oversized(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                b = branches(node)
                if lines > MAX_LINES or b > MAX_BRANCHES:
                    out.append(f"{path.relative_to(PKG)}:{node.name} ({lines} lines, {b} branches)")
    return out


def test_the_counter_counts_what_it_says() -> None:
    fn = ast.parse("def f(x):\n    if x and y:\n        pass\n    elif z:\n        pass\n    else:\n        pass\n"
                   "    return [i for i in x if i]\n")
    assert branches(fn) == 5  # if, its extra operand, elif, else, the comprehension


def test_no_function_in_the_deciding_layers_is_too_long_or_too_branchy() -> None:
    found = [f for layer in CHECKED for f in oversized(PKG / layer)]
    assert found == [], "split these into named steps:\n" + "\n".join(found)
