"""Shared helpers live in tests/support (a directory of plain modules, imported by name).

The fault-injection suite is the set of tests docs/reliability.md names: they get the ``faults`` marker here, so
``pytest -m faults`` runs exactly what that page promises.

The suite runs on pytest-xdist workers (pyproject addopts); support/scheduling.py says how tests are split.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from reliability_refs import fault_tests  # noqa: E402
from repo_paths import REPO  # noqa: E402  (after the path is set)
from scheduling import scheduling_unit  # noqa: E402


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return FileScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    refs = fault_tests(REPO / "docs" / "reliability.md")
    for item in items:
        path, _, name = item.nodeid.partition("::")
        if (path, None) in refs or (path, name) in refs or (path, name.split("[")[0]) in refs:
            item.add_marker(pytest.mark.faults)
