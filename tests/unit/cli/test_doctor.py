"""``gpu-watchdog doctor``: every check on this CPU machine, with fakes only where the machine cannot be told
what to be (a Yama ptrace_scope, a capability set, a small /dev/shm, an old kernel).

Real where it can be: NVML is really absent here (and really present through the NVML stand-in), py-spy
really attaches to a child, the state dir is a real directory, the CLI is the installed console script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fake_nvml import FakeNvml
from gpu_watchdog.cli import doctor
from gpu_watchdog.cli.doctor import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    check_capabilities,
    check_kernel,
    check_nvml,
    check_p2p,
    check_ptrace,
    check_shm,
    check_state_dir,
)
from nvml_standin import NvmlStandin
from nvml_standin.fixtures import nvml_standin as _nvml_standin_fixture  # noqa: F401
from nvml_standin.fixtures import nvml_standin_lib as _nvml_standin_lib_fixture  # noqa: F401

CLI = str(Path(sys.executable).with_name("gpu-watchdog"))
PY_SPY = str(Path(sys.executable).with_name("py-spy"))
ALL_CAPS = "000001ffffffffff"
NO_PTRACE = f"{(1 << 41) - 1 & ~(1 << 19):016x}"
NO_KILL = f"{(1 << 41) - 1 & ~(1 << 5):016x}"
NAMES = ["nvml", "py-spy", "shm", "kernel", "state-dir", "capabilities"]


def no_nvml_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("LD_LIBRARY_PATH", "NVML_STANDIN_STATE"):
        env.pop(k, None)
    return env


def doctor_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "doctor", *args], capture_output=True, text=True, timeout=120,
                          env=env if env is not None else no_nvml_env())


def fake_proc(tmp_path: Path, scope: int | None = None, cap_eff: str = "0000000000000000",
              cap_bnd: str | None = ALL_CAPS) -> Path:
    """A directory shaped like /proc for the files doctor reads: yama's ptrace_scope and self/status."""
    root = tmp_path / "proc"
    (root / "self").mkdir(parents=True)
    if scope is not None:
        (root / "sys/kernel/yama").mkdir(parents=True)
        (root / "sys/kernel/yama/ptrace_scope").write_text(f"{scope}\n")
    status = ["Name:\tpython3", "State:\tR (running)", "CapInh:\t0000000000000000", "CapPrm:\t" + cap_eff,
              "CapEff:\t" + cap_eff]
    if cap_bnd is not None:
        status.append("CapBnd:\t" + cap_bnd)
    (root / "self/status").write_text("\n".join(status + ["CapAmb:\t0000000000000000", ""]))
    return root


# == nvml ====================================================================================================
def test_nvml_absent_here_is_a_clear_fail_with_the_reason() -> None:
    c = check_nvml()  # the real pynvml on a machine without an NVIDIA driver
    assert c.status == FAIL
    assert c.detail == "NVML cannot start: libnvidia-ml.so.1 not found (is the NVIDIA driver installed?)"
    assert "--backend proc" in c.fix and 'agent.backend = "proc"' in c.fix


def test_nvml_absent_with_the_proc_backend_configured_is_not_present_not_a_failure(tmp_path: Path) -> None:
    c = check_nvml(backend="proc")
    assert c.status == SKIP and c.detail.startswith("not present") and not c.fix
    cfg = tmp_path / "c.toml"
    cfg.write_text('[agent]\nbackend = "proc"\n')
    r = doctor_cli("--config", str(cfg), "--state-dir", str(tmp_path / "state"))
    assert r.stdout.startswith("SKIP  nvml          not present"), r.stdout
    assert r.returncode == (1 if "FAIL" in r.stdout else 0), r.stdout  # nothing else fails on this CPU box
    assert doctor_cli("--backend", "proc", "--state-dir", str(tmp_path / "state")).stdout.startswith("SKIP  nvml")


@pytest.mark.parametrize(("code", "words"), [
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "the NVIDIA kernel driver is not loaded"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "driver/library version mismatch"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no permission to open /dev/nvidia*"),
])
def test_nvml_init_errors_name_the_cause(code: int, words: str) -> None:
    fake = FakeNvml(n_gpus=2)
    fake.init_error = pynvml.NVMLError(code)
    c = check_nvml(fake)
    assert c.status == FAIL and words in c.detail and c.detail.startswith("NVML cannot start: ")


def test_nvml_without_gpus_fails_and_with_gpus_passes() -> None:
    c = check_nvml(FakeNvml(n_gpus=0))
    assert (c.status, c.detail) == (FAIL, "NVML works but sees no GPU") and "CUDA_VISIBLE_DEVICES" in c.fix
    c = check_nvml(FakeNvml(n_gpus=8))
    assert (c.status, c.detail) == (PASS, "NVML (driver 550.54.15) sees 8 GPU(s)")


def test_nvml_through_the_real_pynvml_on_the_standin(nvml_standin: NvmlStandin) -> None:
    state = nvml_standin.require_scripted()
    with state.batch():
        for _ in range(2):
            state.add_gpu()
    r = doctor_cli("--json", "--state-dir", str(state.path.parent / "state"), env=nvml_standin.env)
    checks = json.loads(r.stdout)
    nvml = checks[0]
    assert (nvml["name"], nvml["status"], nvml["detail"]) == ("nvml", "pass", "NVML (driver 580.65.06) sees 2 GPU(s)")
    assert r.returncode == (1 if any(c["status"] == "fail" for c in checks) else 0)
    state.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    r = doctor_cli("--json", "--state-dir", str(state.path.parent / "state"), env=nvml_standin.env)
    assert json.loads(r.stdout)[0]["detail"] == "NVML cannot start: the NVIDIA kernel driver is not loaded"
    assert r.returncode == 1


# == py-spy and ptrace =======================================================================================
def test_py_spy_present_and_attaching_for_real() -> None:
    c = check_ptrace(None)  # finds the venv's py-spy and dumps a throwaway child with it
    assert c.status in (PASS, WARN), c
    assert c.detail.startswith(PY_SPY)
    if c.status == PASS:
        assert " attaches (" in c.detail


def test_py_spy_missing_fails(tmp_path: Path) -> None:
    c = check_ptrace(str(tmp_path / "no-such" / "py-spy"))
    assert (c.status, c.detail) == (FAIL, "py-spy not found") and "pip install py-spy" in c.fix


def test_py_spy_that_cannot_dump_fails(tmp_path: Path) -> None:
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Error: Permission denied (os error 1)' >&2\nexit 1\n")
    fake.chmod(0o755)
    c = check_ptrace(str(fake), proc_root=fake_proc(tmp_path, scope=0))
    assert c.status == FAIL and c.detail.startswith("py-spy could not dump a test process")
    assert "SYS_PTRACE" in c.fix


@pytest.mark.parametrize(("scope", "cap_eff", "status", "words"), [
    (3, ALL_CAPS, FAIL, "ptrace_scope=3: ptrace is disabled until reboot"),
    (2, "0000000000000000", FAIL, "ptrace_scope=2 and no CAP_SYS_PTRACE"),
    (2, ALL_CAPS, PASS, "ptrace_scope=2, CAP_SYS_PTRACE yes"),
    (1, "0000000000000000", WARN, "ptrace_scope=1 without CAP_SYS_PTRACE"),
    (1, ALL_CAPS, PASS, "ptrace_scope=1, CAP_SYS_PTRACE yes"),
    (0, "0000000000000000", PASS, "ptrace_scope=0, CAP_SYS_PTRACE no"),
    (None, "0000000000000000", PASS, "no Yama ptrace_scope"),
])
def test_ptrace_scope_and_capability(tmp_path: Path, scope: int | None, cap_eff: str, status: str,
                                     words: str) -> None:
    c = check_ptrace(PY_SPY, proc_root=fake_proc(tmp_path, scope, cap_eff), try_dump=False)
    assert c.status == status and words in c.detail, c
    if status != PASS:
        assert c.fix


def test_ptrace_scope_1_still_dumps_for_real_then_warns(tmp_path: Path) -> None:
    # The real dump of our own child works under scope 1 too: what scope 1 forbids is the daemon's case.
    c = check_ptrace(PY_SPY, proc_root=fake_proc(tmp_path, 1, "0000000000000000"), try_dump=True)
    assert c.status == WARN and "fine for launch, not for the daemon" in c.detail


# == /dev/shm, kernel, state dir, capabilities ===============================================================
Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize(("total", "status", "words"), [
    (64 << 20, WARN, "/dev/shm is 64 MiB: NCCL_P2P_DISABLE=1"),
    (8 << 30, PASS, "/dev/shm is 8 GiB"),
])
def test_shm_size(monkeypatch: pytest.MonkeyPatch, total: int, status: str, words: str) -> None:
    seen: list[str] = []

    def usage(path: str) -> Usage:
        seen.append(path)
        return Usage(total, 0, total)

    monkeypatch.setattr(doctor.shutil, "disk_usage", usage)
    c = check_shm()
    assert seen == ["/dev/shm"] and c.status == status and words in c.detail
    if status == WARN:
        assert "--shm-size" in c.fix


def test_shm_missing_fails(tmp_path: Path) -> None:
    c = check_shm(str(tmp_path / "no-shm"))
    assert c.status == FAIL and "is missing" in c.detail


def test_shm_real_here() -> None:
    c = check_shm()
    assert c.status == (PASS if shutil.disk_usage("/dev/shm").total >= 1 << 30 else WARN)


@pytest.mark.parametrize(("release", "status"), [
    ("5.4.0-150-generic", WARN), ("4.18.0-553.el8_10.x86_64", WARN), ("5.5.0", PASS),
    ("6.8.0-45-generic", PASS), ("6.18.44-fc-v669", PASS), ("weird", WARN),
])
def test_kernel_version(release: str, status: str) -> None:
    c = check_kernel(release)
    assert c.status == status and release in c.detail
    if status == WARN and release[0].isdigit():
        assert "older than 5.5" in c.detail and "upgrade" in c.fix


def test_kernel_real_here() -> None:
    import platform

    assert platform.release() in check_kernel().detail


def test_state_dir_writable_and_not(tmp_path: Path) -> None:
    c = check_state_dir(tmp_path / "new" / "state")
    assert c.status == PASS and (tmp_path / "new" / "state").is_dir()
    assert list((tmp_path / "new" / "state").iterdir()) == []  # the probe file is gone
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    c = check_state_dir(blocker / "state")  # a path under a regular file: unwritable even for root
    assert c.status == FAIL and "is not writable" in c.detail and "--state-dir" in c.fix


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory modes")
def test_state_dir_read_only_for_a_user(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert check_state_dir(ro).status == FAIL


@pytest.mark.parametrize(("bnd", "status", "words"), [
    (ALL_CAPS, PASS, "CAP_SYS_PTRACE and CAP_KILL are available"),
    (NO_PTRACE, FAIL, "lacks CAP_SYS_PTRACE"),
    (NO_KILL, FAIL, "lacks CAP_KILL"),
    ("0000000000000000", FAIL, "lacks CAP_SYS_PTRACE, CAP_KILL"),
    (None, WARN, "cannot read the capability bounding set"),
])
def test_capabilities_from_a_status_file(tmp_path: Path, bnd: str | None, status: str, words: str) -> None:
    c = check_capabilities(fake_proc(tmp_path, cap_bnd=bnd))
    assert c.status == status and words in c.detail
    if status == FAIL:
        assert "CapabilityBoundingSet" in c.fix


def test_capabilities_real_here() -> None:
    assert check_capabilities().status in (PASS, FAIL)  # this process's real bounding set parses


# == --p2p ===================================================================================================
def test_p2p_outcomes_with_an_injected_runner() -> None:
    calls: list[tuple[list[str], dict[str, str], str]] = []

    def runner(outcome: Any) -> Any:
        def run(argv: list[str], *, env: dict[str, str], timeout: float) -> Any:
            calls.append((argv, env, Path(argv[1]).read_text()))
            assert timeout == 7.0
            if outcome == "hang":
                raise subprocess.TimeoutExpired(argv, timeout)
            return subprocess.CompletedProcess(argv, *outcome)
        return run

    checks = check_p2p(7.0, runner((0, "gpus=8\n", "")))
    assert [(c.name, c.status) for c in checks] == [("p2p", PASS), ("p2p-disabled", PASS)]
    argv, env, text = calls[0]
    assert argv[0] == sys.executable and argv[1].endswith(".py") and len(argv) == 2  # a file, never -c
    assert text == doctor._P2P_SCRIPT and "NCCL_P2P_DISABLE" not in env or env.get("NCCL_P2P_DISABLE") != "1"
    assert calls[1][1]["NCCL_P2P_DISABLE"] == "1"
    assert not Path(argv[1]).exists()  # the temp script is cleaned up
    hung = check_p2p(7.0, runner("hang"))
    assert [c.status for c in hung] == [FAIL, FAIL]
    assert "hung for 7s" in hung[0].detail and "NCCL_P2P_DISABLE=1" in hung[0].fix
    failed = check_p2p(7.0, runner((1, "gpus=2\n", "Traceback ...\nRuntimeError: NCCL error: unhandled")))
    assert failed[0].status == FAIL and failed[0].detail == "all_reduce failed: RuntimeError: NCCL error: unhandled"
    one = check_p2p(7.0, runner((0, "gpus=1\n", "")))
    assert [c.status for c in one] == [SKIP, SKIP] and "no peer" in one[0].detail


def _gloo_variant(script: str) -> str:
    """The shipped P2P script with gloo on CPU instead of NCCL on GPUs: same file, same mp.spawn."""
    for old, new in (('torch.cuda.set_device(rank)', 'pass'), ('"nccl"', '"gloo"'), ('device="cuda"', 'device="cpu"'),
                     ('torch.cuda.synchronize()', 'pass'), ('torch.cuda.device_count()', '2'),
                     ('1 << 24', '1 << 10')):
        assert old in script, old
        script = script.replace(old, new)
    return script


@pytest.mark.slow
def test_p2p_script_really_runs_from_its_file_with_gloo() -> None:
    """mp.spawn from the written file works (from ``python -c`` it cannot find ``work``)."""
    checks = check_p2p(120.0, script=_gloo_variant(doctor._P2P_SCRIPT))
    assert [(c.name, c.status) for c in checks] == [("p2p", PASS), ("p2p-disabled", PASS)], checks


def test_p2p_real_script_here_sees_no_gpu() -> None:
    checks = check_p2p(120.0)  # torch (CPU build) sees no CUDA device: nothing to test, not a failure
    assert [c.status for c in checks] == [SKIP, SKIP], checks


def test_p2p_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(60)\n")
    checks = check_p2p(1.5, script=script)
    assert [c.status for c in checks] == [FAIL, FAIL]
    grandchild = int(pidfile.read_text())
    import psutil

    try:
        assert psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


# == the CLI =================================================================================================
def test_cli_json_shape_and_exit_1_on_a_fail(tmp_path: Path) -> None:
    r = doctor_cli("--json", "--state-dir", str(tmp_path / "state"))
    checks = json.loads(r.stdout)
    assert isinstance(checks, list) and [c["name"] for c in checks] == NAMES
    for c in checks:
        assert set(c) == {"name", "status", "detail", "fix"} and c["status"] in ("pass", "warn", "fail", "skip")
        assert isinstance(c["detail"], str) and c["detail"] and isinstance(c["fix"], str)
    assert checks[0]["status"] == "fail"  # no NVIDIA driver on this machine
    assert checks[4] == {"name": "state-dir", "status": "pass", "detail": f"{tmp_path / 'state'} is writable",
                         "fix": ""}
    assert r.returncode == 1


def test_cli_text_lines_and_p2p_skip_without_gpu(tmp_path: Path) -> None:
    r = doctor_cli("--p2p", "--state-dir", str(tmp_path / "state"))
    lines = r.stdout.splitlines()
    assert [ln.split()[1] for ln in lines] == [*NAMES, "p2p"]
    assert lines[0].startswith("FAIL  nvml") and "— fix: install the NVIDIA driver" in lines[0]
    assert lines[-1].startswith("SKIP  p2p") and "no GPU" in lines[-1]
    assert r.returncode == 1 and r.stderr == ""


def test_cli_unwritable_state_dir_fails(tmp_path: Path) -> None:
    blocker = tmp_path / "f"
    blocker.write_text("")
    r = doctor_cli("--json", "--state-dir", str(blocker / "state"))
    assert {c["name"]: c["status"] for c in json.loads(r.stdout)}["state-dir"] == "fail" and r.returncode == 1


def test_run_doctor_exit_0_when_nothing_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import io

    monkeypatch.setattr(doctor, "check_nvml", lambda **_: doctor.Check("nvml", PASS, "ok"))
    monkeypatch.setattr(doctor, "check_ptrace", lambda _p: doctor.Check("py-spy", WARN, "scope 1", "grant it"))
    monkeypatch.setattr(doctor, "check_capabilities", lambda: doctor.Check("capabilities", PASS, "ok"))
    monkeypatch.setattr(doctor, "check_shm", lambda: doctor.Check("shm", PASS, "ok"))
    out = io.StringIO()
    rc = doctor.run_doctor(tmp_path, None, False, False, out)
    statuses = [ln.split()[0] for ln in out.getvalue().splitlines()]
    assert "FAIL" not in statuses and rc == 0
    assert "— fix: grant it" in out.getvalue()
