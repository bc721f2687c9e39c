"""The systemd integration files, checked with systemd's own tools.

The tools are skipped only when absent, and then only outside CI: with ``CI=true`` a missing tool is
a failure, so CI cannot go green without really checking the unit (install the ``systemd`` and
``procps`` Debian packages there).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_watchdog.errors import EXIT_CONFIG
from repo_paths import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "gpu-watchdog.service"
SYSUSERS = SYSTEMD / "gpu-watchdog.sysusers.conf"
TMPFILES = SYSTEMD / "gpu-watchdog.tmpfiles.conf"
EXAMPLE_CONFIG = SYSTEMD / "config.example.toml"
INSTALLED_EXEC = "/usr/bin/gpu-watchdog"
EXPECTED_CAPS = {"CAP_SYS_PTRACE", "CAP_KILL", "CAP_DAC_READ_SEARCH"}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (Debian package: systemd)"
        if _in_ci():
            pytest.fail(f"{msg}; CI must run the systemd checks")
        pytest.skip(msg)
    return path


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def parse_unit(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order; repeated keys stay separate."""
    out: list[tuple[str, str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        assert "=" in line and not line.endswith("\\"), f"unexpected unit line: {raw!r}"
        key, value = line.split("=", 1)
        out.append((section, key.strip(), value.strip()))
    return out


def unit_settings(section: str = "Service") -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for sec, key, value in parse_unit(UNIT.read_text()):
        if sec == section:
            settings.setdefault(key, []).append(value)
    return settings


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key, [])
    assert len(values) == 1, f"{key}= set {len(values)} times: {values}"
    return values[0]


def _console_script() -> str:
    """The installed console script, so that verify checks a real executable."""
    here = Path(sys.executable).parent / "gpu-watchdog"
    found = str(here) if here.exists() else shutil.which("gpu-watchdog")
    assert found, "the gpu-watchdog console script is not installed (pip install -e .)"
    return found


def _verify(unit_text: str, tmp_path: Path) -> list[str]:
    """Run `systemd-analyze verify` on a copy; return the problems it reports about that unit.

    verify exits 0 on unknown keys and unparsable values (it only logs them), so the log lines are
    the result; lines about other units on this host are not ours to judge.
    """
    tool = _tool("systemd-analyze")
    unit = tmp_path / UNIT.name
    unit.write_text(unit_text)
    proc = _run([tool, "verify", str(unit)])
    ours = [line for line in (proc.stdout + proc.stderr).splitlines()
            if str(unit) in line or line.startswith(UNIT.name)]
    if proc.returncode != 0:
        ours.append(f"exit status {proc.returncode}: {proc.stderr.strip()}")
    return ours


def _deployable_unit_text() -> str:
    """The unit with ExecStart pointing at the executable installed here instead of /usr/bin."""
    text = UNIT.read_text()
    assert text.count(f"ExecStart={INSTALLED_EXEC} ") == 1
    text = text.replace(f"ExecStart={INSTALLED_EXEC} ", f"ExecStart={_console_script()} ")
    kill = one(unit_settings(), "ExecReload").split()[0]
    assert Path(kill).exists(), f"{kill} (ExecReload=) is missing: install the procps package"
    return text


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    assert _verify(_deployable_unit_text(), tmp_path) == []


def test_verify_check_catches_mistakes(tmp_path: Path) -> None:
    """The check above is not vacuous: typos and bad values are reported."""
    text = _deployable_unit_text()
    assert any("WatchdogSecs" in p for p in _verify(text.replace("WatchdogSec=", "WatchdogSecs="), tmp_path))
    bad_value = text.replace("ProtectSystem=strict", "ProtectSystem=strickt")
    assert any("protect system" in p.lower() for p in _verify(bad_value, tmp_path))
    missing_exec = text.replace(_console_script(), "/nonexistent/gpu-watchdog")
    assert _verify(missing_exec, tmp_path)


def test_unit_security_exposure(tmp_path: Path) -> None:
    """`systemd-analyze security` (offline) keeps the sandbox from regressing: exposure <= 5.0 of 10."""
    tool = _tool("systemd-analyze")
    version = _run([tool, "--version"]).stdout.split()
    if len(version) < 2 or not version[1].isdigit() or int(version[1]) < 250:
        pytest.skip(f"systemd-analyze security --offline needs systemd >= 250, have {version[:2]}")
    unit = tmp_path / UNIT.name
    unit.write_text(_deployable_unit_text())
    proc = _run([tool, "security", "--offline=yes", "--threshold=50", str(unit)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert m and float(m.group(1)) <= 5.0, proc.stdout[-500:]


def test_unit_settings() -> None:
    s = unit_settings()
    assert one(s, "Type") == "notify"
    assert one(s, "NotifyAccess") == "main"
    assert one(s, "ExecStart") == f"{INSTALLED_EXEC} run --config /etc/gpu-watchdog/config.toml"
    assert one(s, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(s, "WatchdogSec") == "30"
    assert one(s, "Restart") == "on-failure"
    assert one(s, "RestartSec") == "5"
    assert one(s, "RestartPreventExitStatus") == str(EXIT_CONFIG)  # a bad config is not retried
    assert one(s, "StateDirectory") == "gpu-watchdog"
    assert one(s, "RuntimeDirectory") == "gpu-watchdog"
    for key, value in {"ProtectSystem": "strict", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
                       "ProtectHome": "read-only", "ProtectKernelTunables": "yes",
                       "ProtectControlGroups": "yes"}.items():
        assert one(s, key) == value, key
    assert set(one(s, "RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert one(s, "ReadWritePaths") == ""  # State/RuntimeDirectory are writable; nothing else is
    # NVML needs /dev/nvidia*: anything that turns on the device allow-list would hide it.
    # We must see every user's processes: no hidepid.
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "ProtectProc",
                "ProcSubset", "PrivateUsers", "PrivateNetwork", "DynamicUser", "User"):
        assert key not in s, f"{key}= must not be set (see the comments in the unit)"


def test_capabilities_are_minimal_and_explained() -> None:
    s = unit_settings()
    caps = one(s, "CapabilityBoundingSet").split()
    assert set(caps) == EXPECTED_CAPS and len(caps) == len(EXPECTED_CAPS)
    assert one(s, "AmbientCapabilities") == ""
    comments = "\n".join(line for line in UNIT.read_text().splitlines() if line.lstrip().startswith("#"))
    for cap in EXPECTED_CAPS | {"CAP_SYS_ADMIN"}:  # and why CAP_SYS_ADMIN is left out
        assert re.search(rf"^#\s+{cap}\s+\S", comments, re.M), f"{cap} has no explanation"


def test_sysusers_and_tmpfiles_apply_to_a_scratch_root(tmp_path: Path) -> None:
    """Both files are applied for real, into an empty root: sysusers first, as on a real install."""
    sysusers, tmpfiles = _tool("systemd-sysusers"), _tool("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)

    proc = _run([sysusers, "--dry-run", f"--root={root}", str(SYSUSERS)])
    assert proc.returncode == 0 and "gpu-watchdog" in proc.stdout + proc.stderr, proc.stderr
    proc = _run([sysusers, f"--root={root}", str(SYSUSERS)])
    assert proc.returncode == 0, proc.stderr
    groups = {line.split(":")[0]: int(line.split(":")[2])
              for line in (root / "etc/group").read_text().splitlines()}
    unit = unit_settings()
    assert one(unit, "Group") in groups

    proc = _run([tmpfiles, "--create", f"--root={root}", str(TMPFILES)])
    problems = [line for line in proc.stderr.splitlines() if line.strip()]
    if os.geteuid() == 0:
        assert proc.returncode == 0 and not problems, proc.stderr
    else:  # only chown to root/the new gid needs privileges; anything else is a real error
        assert all(re.match(r"fchownat\(\) of \S+ failed: Operation not permitted", p) for p in problems), \
            proc.stderr
        assert proc.returncode in (0, 73), proc.stderr  # 73: EX_CANTCREAT, from the chown only

    state = root / "var/lib/gpu-watchdog"
    assert state.is_dir() and (root / "etc/gpu-watchdog").is_dir()
    # The same mode and group the service itself gives the directory.
    assert oct(state.stat().st_mode & 0o7777) == oct(int(one(unit, "StateDirectoryMode"), 8))
    if os.geteuid() == 0:
        assert state.stat().st_gid == groups[one(unit, "Group")]
        assert state.stat().st_uid == 0


def test_tmpfiles_rejects_a_bad_line(tmp_path: Path) -> None:
    """The tmpfiles check above would notice a broken line (exit 65, EX_DATAERR)."""
    tmpfiles = _tool("systemd-tmpfiles")
    bad = tmp_path / "bad.conf"
    bad.write_text(TMPFILES.read_text().replace("0755 root root", "07z5 root root"))
    (tmp_path / "root").mkdir()
    proc = _run([tmpfiles, "--create", f"--root={tmp_path / 'root'}", str(bad)])
    assert proc.returncode != 0 and "Invalid mode" in proc.stderr


def test_missing_tool_skips_locally_but_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        _tool("systemd-analyze")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run"):
        _tool("systemd-analyze")


def test_example_config_is_valid() -> None:
    from gpu_watchdog.config.load import load_config

    tomllib.loads(EXAMPLE_CONFIG.read_text())
    load_config(EXAMPLE_CONFIG)  # raises ConfigError naming the key if a key is wrong
