"""How the suite's tests are split between pytest-xdist workers (tests/conftest.py's scheduler).

A file's tests stay on one worker, so module fixtures (a Slurm cluster, the zoo's rows) stay whole. The files that
start a real Slurm cluster form one unit and run one after another: every test cluster numbers its jobs from 1,
and test_slurm.py's daemon watches the whole host, so it sees the 2-node cluster's namespaced ranks (a child PID
namespace is visible from its parent) under the same SLURM_JOB_ID as its own jobs. Run side by side, its preempted
job drew a config_mismatch incident from the other cluster's NCCL_PROTO=Simple ranks, and its hanging jobs a
"rank 3 exited" they never had. One cluster per host at a time is what a real node has.
"""

from repo_paths import TESTS

# Every test file that starts a real Slurm cluster (tests/repo checks the list against the imports).
SLURM_FILES = frozenset({
    "tests/e2e/test_slurm.py",
    "tests/e2e/test_slurm_multinode.py",
    "tests/e2e/test_slurm_nodes_smoke.py",
})
SLURM_HELPERS = ("slurm_cluster", "slurm_nodes")


def scheduling_unit(nodeid: str) -> str:
    """The unit xdist hands to one worker: the test's file, or "slurm" for every real-Slurm file."""
    path = nodeid.partition("::")[0]
    return "slurm" if path in SLURM_FILES else path


def files_starting_slurm() -> set[str]:
    """The test files that import a Slurm cluster helper, as nodeid paths."""
    found = set()
    for path in TESTS.rglob("test_*.py"):
        text = path.read_text()
        if any(f"import {name}" in text or f"from {name} import" in text for name in SLURM_HELPERS):
            found.add(path.relative_to(TESTS.parent).as_posix())
    return found
