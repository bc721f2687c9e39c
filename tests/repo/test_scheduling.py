"""The suite's split between xdist workers keeps every real-Slurm file in one unit."""

from scheduling import LONG_POLES, SLURM_FILES, files_starting_slurm, scheduling_unit, unit_order


def test_every_file_that_starts_a_slurm_cluster_is_in_the_slurm_unit():
    found = files_starting_slurm()
    assert "tests/e2e/test_slurm_multinode.py" in found  # the scan sees the helpers' imports
    assert found == SLURM_FILES, f"add to or remove from scheduling.SLURM_FILES: {sorted(found ^ SLURM_FILES)}"


def test_slurm_files_share_one_unit_and_other_files_keep_their_own():
    units = {scheduling_unit(f"{path}::test_x[a::b]") for path in SLURM_FILES}
    assert units == {"slurm"}
    assert scheduling_unit("tests/zoo/test_zoo.py::test_row[ddp_plain-healthy]") == "tests/zoo/test_zoo.py"
    assert scheduling_unit("tests/unit/store/test_store.py::test_a") != scheduling_unit("tests/unit/store/x.py::t")


def test_every_long_pole_is_a_unit_of_the_suite_and_goes_first() -> None:
    from repo_paths import TESTS

    for unit in LONG_POLES:
        assert unit == "slurm" or (TESTS.parent / unit).is_file(), f"scheduling.LONG_POLES names no file: {unit}"
    ids = ["tests/unit/a.py::t1", "tests/unit/a.py::t2", "tests/unit/b.py::t", "tests/e2e/test_slurm.py::t",
           "tests/zoo/test_zoo.py::t"]
    assert unit_order(ids) == {"tests/zoo/test_zoo.py": 0, "slurm": 1, "tests/unit/a.py": 2, "tests/unit/b.py": 3}
