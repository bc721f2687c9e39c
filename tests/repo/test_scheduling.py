"""The suite's split between xdist workers keeps every real-Slurm file in one unit."""

from scheduling import SLURM_FILES, files_starting_slurm, scheduling_unit


def test_every_file_that_starts_a_slurm_cluster_is_in_the_slurm_unit():
    found = files_starting_slurm()
    assert "tests/e2e/test_slurm_multinode.py" in found  # the scan sees the helpers' imports
    assert found == SLURM_FILES, f"add to or remove from scheduling.SLURM_FILES: {sorted(found ^ SLURM_FILES)}"


def test_slurm_files_share_one_unit_and_other_files_keep_their_own():
    units = {scheduling_unit(f"{path}::test_x[a::b]") for path in SLURM_FILES}
    assert units == {"slurm"}
    assert scheduling_unit("tests/zoo/test_zoo.py::test_row[ddp_plain-healthy]") == "tests/zoo/test_zoo.py"
    assert scheduling_unit("tests/unit/store/test_store.py::test_a") != scheduling_unit("tests/unit/store/x.py::t")
