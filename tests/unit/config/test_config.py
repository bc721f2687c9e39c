"""Config loading: defaults, validation by key name, `config show` round trip, CLI exit codes 78 / 64."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_watchdog.config.schema import (
    SECTIONS,
    AgentConfig,
    Config,
    DetectConfig,
    FallbackConfig,
    FallbackLevel,
    RecoveryConfig,
    StacksConfig,
    config_from_dict,
    load_config,
    render_toml,
)
from gpu_watchdog.errors import EXIT_CONFIG, EXIT_USAGE, ConfigError

CLI = str(Path(sys.executable).with_name("gpu-watchdog"))


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


# -- defaults ----------------------------------------------------------------------------------------
def test_defaults_without_a_file() -> None:
    assert load_config(None) == Config()


def test_empty_file_is_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()


def test_default_values_are_sane() -> None:
    cfg = Config()
    assert cfg.agent.interval_s == 1.0 and cfg.agent.backend == "auto"
    assert cfg.detect.suspect_after_s < cfg.detect.confirm_after_s < cfg.detect.waiting_timeout_s
    assert cfg.detect.util_idle_max_percent < cfg.detect.spin_util_min_percent
    assert cfg.fallback.levels and all(lvl.env for lvl in cfg.fallback.levels)


def test_a_partial_section_keeps_the_other_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[detect]\nconfirm_after_s = 8\n[agent]\nbackend = 'proc'\n"))
    assert cfg.detect.confirm_after_s == 8.0 and isinstance(cfg.detect.confirm_after_s, float)
    assert cfg.detect.suspect_after_s == DetectConfig().suspect_after_s
    assert cfg.agent == dataclasses.replace(AgentConfig(), backend="proc")
    assert cfg.stacks == StacksConfig() and cfg.recovery == RecoveryConfig()


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[agent]\nbackend = 'nvml'\n"), {"agent.backend": "proc",
                                                                      "agent.state_dir": "/tmp/s"})
    assert cfg.agent.backend == "proc" and cfg.agent.state_dir == "/tmp/s"


def test_fallback_tables(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, """
[fallback]
healthy_reset_s = 60
network_env = { NCCL_SOCKET_IFNAME = "eth0" }
[[fallback.levels]]
name = "only"
env = { NCCL_P2P_DISABLE = "1" }
"""))
    assert cfg.fallback.healthy_reset_s == 60.0
    assert cfg.fallback.network_env == {"NCCL_SOCKET_IFNAME": "eth0"}
    assert cfg.fallback.levels == (FallbackLevel("only", {"NCCL_P2P_DISABLE": "1"}, ""),)
    assert cfg.fallback.diagnostics_env == FallbackConfig().diagnostics_env


# -- every bad value names its key -------------------------------------------------------------------
def _scalar_keys() -> list[tuple[str, str, object]]:
    out = []
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out.append((name, f.name, getattr(cls(), f.name)))
    return out


def _wrong_type(default: object) -> str:
    if isinstance(default, bool):
        return '"yes"'
    if isinstance(default, (int, float)):
        return '"1"'
    return "1"


@pytest.mark.parametrize(("section", "key", "default"), _scalar_keys(), ids=lambda v: str(v)[:30])
def test_every_key_rejects_a_wrong_type(tmp_path: Path, section: str, key: str, default: object) -> None:
    with pytest.raises(ConfigError, match=rf"\b{section}\.{key}\b"):
        load_config(write(tmp_path, f"[{section}]\n{key} = {_wrong_type(default)}\n"))


@pytest.mark.parametrize(("section", "key", "default"),
                         [k for k in _scalar_keys() if type(k[2]) in (int, float)], ids=lambda v: str(v)[:30])
def test_every_number_rejects_negative_and_non_finite(tmp_path: Path, section: str, key: str,
                                                      default: object) -> None:
    for bad in ("-1", "nan", "inf") if isinstance(default, float) else ("-1",):
        with pytest.raises(ConfigError, match=rf"\b{section}\.{key}\b"):
            load_config(write(tmp_path, f"[{section}]\n{key} = {bad}\n"))


def test_booleans_are_not_numbers_and_floats_are_not_integers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"detect\.confirm_after_s must be a number"):
        load_config(write(tmp_path, "[detect]\nconfirm_after_s = true\n"))
    with pytest.raises(ConfigError, match=r"stacks\.concurrency must be an integer"):
        load_config(write(tmp_path, "[stacks]\nconcurrency = 2.5\n"))
    with pytest.raises(ConfigError, match=r"detect\.mem_held_min_bytes must be an integer"):
        load_config(write(tmp_path, "[detect]\nmem_held_min_bytes = true\n"))


@pytest.mark.parametrize(("text", "key"), [
    ("[agent]\ninterval_s = 0\n", "agent.interval_s"),
    ("[detect]\nconfirm_after_s = 0\n", "detect.confirm_after_s"),
    ("[stacks]\nconcurrency = 0\n", "stacks.concurrency"),
    ("[detect]\nspin_power_max_ratio = 1.5\n", "detect.spin_power_max_ratio"),
    ("[detect]\nspin_util_min_percent = 101\n", "detect.spin_util_min_percent"),
    ("[detect]\nutil_idle_max_percent = 100.5\n", "detect.util_idle_max_percent"),
    ("[detect]\nutil_idle_max_percent = 95\nspin_util_min_percent = 90\n", "detect.spin_util_min_percent"),
    ("[agent]\nbackend = 'cuda'\n", "agent.backend"),
    ("[agent]\nmetrics_addr = 'localhost'\n", "agent.metrics_addr"),
    ("[agent]\nmetrics_addr = 'localhost:99999'\n", "agent.metrics_addr"),
    ("[recovery]\ncheckpoint_signal = 'SIGNOPE'\n", "recovery.checkpoint_signal"),
    ("[fallback]\nhealthy_reset_s = -5\n", "fallback.healthy_reset_s"),
    ("[fallback]\nnetwork_env = 'eth0'\n", "fallback.network_env"),
    ("[fallback]\nnetwork_env = { '1BAD' = 'x' }\n", "fallback.network_env.1BAD"),
    ("[fallback]\nnetwork_env = { NCCL_X = 1 }\n", "fallback.network_env.NCCL_X"),
    ("[fallback]\ndiagnostics_env = { NCCL_DEBUG = true }\n", "fallback.diagnostics_env.NCCL_DEBUG"),
    ("[fallback]\nlevels = 'x'\n", "fallback.levels"),
    ("[[fallback.levels]]\nenv = {}\n", "fallback.levels[0].name"),
    ("[[fallback.levels]]\nname = 'a'\nenv = { A = '1' }\n[[fallback.levels]]\nname = 'b'\nbogus = 1\n",
     "fallback.levels[1]"),
    ("[[fallback.levels]]\nname = 'a'\nadvice = 3\n", "fallback.levels[0].advice"),
    ("[[fallback.levels]]\nname = 'a'\nenv = { 'A-B' = '1' }\n", "fallback.levels[0].env.A-B"),
])
def test_range_and_shape_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text))
    assert key in str(ei.value)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("addr", ["", "127.0.0.1:9408", "0.0.0.0:0", "[::1]:9408", "node-1.example:80"])
def test_good_metrics_addresses(addr: str) -> None:
    assert config_from_dict({"agent": {"metrics_addr": addr}}).agent.metrics_addr == addr


@pytest.mark.parametrize("sig", ["", "SIGUSR1", "SIGUSR2", "SIGTERM"])
def test_good_checkpoint_signals(sig: str) -> None:
    assert config_from_dict({"recovery": {"checkpoint_signal": sig}}).recovery.checkpoint_signal == sig


@pytest.mark.parametrize(("text", "key"), [
    ("[agent]\nintervall_s = 1\n", "agent.intervall_s"),
    ("[detect]\nconfirm_after = 8\n", "detect.confirm_after"),
    ("[fallback]\nlevel = []\n", "fallback.level"),
])
def test_unknown_keys(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match="unknown key " + re.escape(key)):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(("text", "section"), [
    ("[detector]\nconfirm_after_s = 8\n", "detector"),
    ("interval_s = 1\n", "interval_s"),
])
def test_unknown_sections(tmp_path: Path, text: str, section: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown section \[{section}\]"):
        load_config(write(tmp_path, text))


def test_a_section_that_is_not_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[agent\] must be a table"):
        load_config(write(tmp_path, "agent = 5\n"))
    # ... also when a command-line override targets it
    with pytest.raises(ConfigError, match=r"\[agent\] must be a table"):
        load_config(write(tmp_path, "agent = 5\n"), {"agent.backend": "proc"})


def test_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[agent\n"))


# -- `config show` round trip --------------------------------------------------------------------------
def test_render_round_trips_the_defaults() -> None:
    assert config_from_dict(_toml(render_toml(Config()))) == Config()


def test_render_round_trips_a_customised_config() -> None:
    cfg = dataclasses.replace(
        Config(),
        agent=dataclasses.replace(AgentConfig(), hostname='we"ird\\host \u00e9\U0001f600\x7f',
                                  metrics_addr="127.0.0.1:9999"),
        detect=dataclasses.replace(DetectConfig(), confirm_after_s=8.0, spin_power_max_w=60.0),
        recovery=dataclasses.replace(RecoveryConfig(), checkpoint_signal="SIGUSR1"),
        fallback=FallbackConfig(levels=(FallbackLevel("x", {"NCCL_PROTO": "^LL"}, "line one\nline 'two'\t"),),
                                network_env={"NCCL_SOCKET_IFNAME": "=eth"}, diagnostics_env={},
                                healthy_reset_s=5.0),
    )
    assert config_from_dict(_toml(render_toml(cfg))) == cfg


def _toml(text: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads(text)


def test_config_show_output_round_trips_through_load_config(tmp_path: Path) -> None:
    src = write(tmp_path, "[detect]\nconfirm_after_s = 8.0\n[fallback]\nnetwork_env = { NCCL_SOCKET_IFNAME = 'ib0' }\n")
    out = subprocess.run([CLI, "config", "show", "--config", str(src)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    shown = tmp_path / "shown.toml"
    shown.write_text(out)
    assert load_config(shown) == load_config(src)
    assert load_config(shown).detect.confirm_after_s == 8.0


# -- the console script ------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "key"), [
    ("[detect]\nconfirm_after_s = -1\n", "detect.confirm_after_s"),
    ("[agent]\nbogus = 1\n", "agent.bogus"),
    ("[nope]\n", "[nope]"),
])
def test_cli_bad_config_exits_78_with_one_line(tmp_path: Path, text: str, key: str) -> None:
    cfg = write(tmp_path, text)
    for argv in (["config", "show", "--config", str(cfg)],
                 ["replay", "--config", str(cfg), str(tmp_path / "whatever.trace")]):
        r = subprocess.run([CLI, *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_CONFIG, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and key in lines[0], r.stderr
        assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("argv", [
    ["config", "show", "--bogus"],
    ["record", "--duration", "-1", "--output", "x.trace"],
    ["record", "--duration", "1"],
    ["record", "--duration", "1", "--output", "x", "--backend", "cuda"],
    ["replay"],
    ["dump-stacks", "notapid"],
    ["no-such-command"],
    [],
])
def test_cli_bad_arguments_exit_64_with_one_line(tmp_path: Path, argv: list[str]) -> None:
    r = subprocess.run([CLI, *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == EXIT_USAGE, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "x.trace").exists()
