"""pytest fixtures for the NVML stand-in.  Import both names into a conftest.py (or a test module)::

    from nvml_standin.fixtures import nvml_standin, nvml_standin_lib  # noqa: F401

(The fixtures carry explicit names, so importing them under aliases also works; that avoids ruff's
F811 in a module whose tests take ``nvml_standin`` as a parameter.)

``nvml_standin_lib`` (session) compiles the library once; ``nvml_standin`` (per test) gives a fresh,
empty state file (no GPUs: add them with ``nvml_standin.state.add_gpu()``) and the environment for
subprocesses.  Set ``NVML_STANDIN_REAL=1`` on a machine with a real driver to run the same tests
against the real libnvidia-ml: nothing is compiled, ``.real`` is True and ``.state`` is None.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import NvmlStandin, StandinBuildError, StandinState, build_standin, standin_env

# One build per process even if the fixture is imported into several modules (each import makes a
# separate session-scoped fixture definition with its own cache).
_BUILT: dict[str, Path] = {}


def real_nvml_requested() -> bool:
    return os.environ.get("NVML_STANDIN_REAL", "") == "1"


@pytest.fixture(scope="session", name="nvml_standin_lib")
def nvml_standin_lib(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """Path of the compiled ``libnvidia-ml.so.1`` stand-in (None in real-NVML mode)."""
    if real_nvml_requested():
        return None
    if "lib" not in _BUILT:
        try:
            _BUILT["lib"] = build_standin(tmp_path_factory.mktemp("nvml-standin"))
        except StandinBuildError as exc:  # fail, never skip: a silent skip would hide NVML coverage
            pytest.fail(f"cannot build the NVML stand-in: {exc}", pytrace=False)
    return _BUILT["lib"]


@pytest.fixture(name="nvml_standin")
def nvml_standin(nvml_standin_lib: Path | None, tmp_path: Path) -> Iterator[NvmlStandin]:
    if nvml_standin_lib is None:
        handle = NvmlStandin(lib_dir=None, lib_path=None, state=None, env=dict(os.environ), real=True)
    else:
        state = StandinState(tmp_path / "nvml-state.json")
        handle = NvmlStandin(
            lib_dir=nvml_standin_lib.parent,
            lib_path=nvml_standin_lib,
            state=state,
            env=standin_env(nvml_standin_lib.parent, state.path),
        )
    try:
        yield handle
    finally:
        handle.close()
