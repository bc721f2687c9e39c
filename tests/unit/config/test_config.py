"""Config loading: defaults, validation by key name, `config show` round trip, CLI exit codes 78 / 64."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_watchdog.config.load import config_from_dict, load_config
from gpu_watchdog.config.render import render_toml
from gpu_watchdog.config.schema import (
    SECTIONS,
    AgentConfig,
    Config,
    DaemonSettings,
    DetectConfig,
    FallbackConfig,
    FallbackLevel,
    FaultsConfig,
    FlightRecorderConfig,
    HookSpec,
    RasConfig,
    RecoveryConfig,
    StacksConfig,
    StragglerConfig,
)
from gpu_watchdog.errors import EXIT_CONFIG, EXIT_USAGE, ConfigError, NoInputError

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
            default = getattr(cls(), f.name)
            if isinstance(default, (bool, int, float, str)):
                out.append((name, f.name, default))
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
    ("[ras]\nenabled = 'yes'\n", "ras.enabled"),
    ("[ras]\naddr = 'localhost'\n", "ras.addr"),
    ("[ras]\ntimeout_s = 0\n", "ras.timeout_s"),
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
    ("[faults]\napplication_xids = [0]\n", "faults.application_xids"),
    ("daemon = 5\n", "[daemon]"),
    ("[daemon]\ncontrol_socket = 'run/c.sock'\n", "daemon.control_socket"),
    ("[daemon]\ncontrol_socket = '/" + "x" * 120 + "'\n", "daemon.control_socket"),
    ("[daemon]\nallowed_uids = ['root']\n", "daemon.allowed_uids"),
    ("[daemon]\nallowed_uids = 1000\n", "daemon.allowed_uids"),
    ("[daemon]\nallowed_gids = [-1]\n", "daemon.allowed_gids"),
    ("[daemon]\nallowed_gids = [true]\n", "daemon.allowed_gids"),
    ("[daemon]\nmax_request_bytes = 2.5\n", "daemon.max_request_bytes"),
    ("[daemon]\npreempt_timeout_s = nan\n", "daemon.preempt_timeout_s"),
    ("hooks = 5\n", "[hooks]"),
    ("[hooks]\nh = 5\n", "[hooks.h]"),
    ("[hooks.'a b']\nargv = ['x']\n", "hooks.a b"),
    ("[hooks.h]\ntype = ['command']\n", "hooks.h.type"),
    ("[hooks.h]\nargv = 'rm -rf'\n", "hooks.h.argv"),
    ("[hooks.h]\nargv = ['x', \"a\\u0000b\"]\n", "hooks.h.argv[1]"),
    ("[hooks.h]\nargv = ['x']\ntimeout_s = 0\n", "hooks.h.timeout_s"),
    ("[hooks.h]\nargv = ['x']\ntimeout_s = 86401\n", "hooks.h.timeout_s"),
    ("[hooks.h]\nargv = ['x']\ntimeout_s = true\n", "hooks.h.timeout_s"),
    ("[faults]\ndrain_hook = 'drain'\n[hooks.requeue]\ntype = 'slurm-requeue'\n", "faults.drain_hook"),
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
    ("[daemon]\nsocket = '/x'\n", "daemon.socket"),
    ("[hooks.h]\nargv = ['x']\nshell = true\n", "hooks.h.shell"),
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
    with pytest.raises(NoInputError, match="file not found"):  # a missing input: exit 66, not 78
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[agent\n"))


# -- [daemon] and [hooks.NAME] ------------------------------------------------------------------------
def test_daemon_and_hooks_are_part_of_the_config(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, """
[daemon]
control_socket = ""
allowed_uids = [1000, 1001]
max_request_bytes = 4096
preempt_timeout_s = 5
[hooks.sr]
type = "slurm-requeue"
[hooks.k]
type = "k8s-delete-pod"
[hooks.c]
argv = ["/bin/true", "{job_id}"]
timeout_s = 5
"""), {"daemon.socket_group": ""})
    assert cfg.daemon == DaemonSettings(control_socket="", socket_group="", allowed_uids=(1000, 1001),
                                        max_request_bytes=4096, preempt_timeout_s=5.0)
    assert isinstance(cfg.daemon.preempt_timeout_s, float)
    assert cfg.hooks["sr"] == HookSpec("sr", "slurm-requeue", ("scontrol", "requeue", "{job_id}"), 60.0)
    assert cfg.hooks["k"].argv[:3] == ("kubectl", "delete", "pod")
    assert cfg.hooks["c"] == HookSpec("c", "command", ("/bin/true", "{job_id}"), 5.0)
    assert Config().daemon == DaemonSettings() and Config().hooks == {}


@pytest.mark.parametrize(("argv", "key"), [
    (["rm", "{cmd}"], "hooks.h.argv[1]"),
    (["rm", "{job_id!r}"], "hooks.h.argv[1]"),
    (["rm", "{job_id:>99}"], "hooks.h.argv[1]"),
    (["rm", "{job_id.__class__}"], "hooks.h.argv[1]"),
    (["rm", "{0}"], "hooks.h.argv[1]"),
    (["{job_id}"], "hooks.h.argv[0]"),
    ([""], "hooks.h.argv[0]"),
    ([], "hooks.h.argv"),
    (["rm", "{"], "hooks.h.argv[1]"),
])
def test_bad_hook_templates_name_the_element(argv: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        config_from_dict({"hooks": {"h": {"argv": argv}}})


def test_unknown_hook_type_and_command_without_argv() -> None:
    with pytest.raises(ConfigError, match=r"hooks\.h\.type must be one of command, slurm-requeue"):
        config_from_dict({"hooks": {"h": {"type": "sh"}}})
    with pytest.raises(ConfigError, match=r"hooks\.h\.argv must be a non-empty array"):
        config_from_dict({"hooks": {"h": {}}})


def test_hooks_and_drain_command_have_their_own_placeholders() -> None:
    """One template validator, two placeholder sets: a drain knows the fault, a restart hook the level."""
    drain = config_from_dict({"faults": {"drain_command": ["/bin/d", "{reason}", "{gpu}", "{xid}", "{node}"]}})
    assert drain.faults.drain_command[1:] == ("{reason}", "{gpu}", "{xid}", "{node}")
    hook = config_from_dict({"hooks": {"h": {"argv": ["/bin/h", "{level}", "{job_id}", "{node}", "{incident}"]}}})
    assert hook.hooks["h"].argv[1] == "{level}"
    with pytest.raises(ConfigError, match=r"faults\.drain_command\[1\]: unknown placeholder \{level\}"):
        config_from_dict({"faults": {"drain_command": ["/bin/d", "{level}"]}})
    with pytest.raises(ConfigError, match=r"hooks\.h\.argv\[1\]: unknown placeholder \{reason\}"):
        config_from_dict({"hooks": {"h": {"argv": ["/bin/h", "{reason}"]}}})


def test_drain_hook_is_checked_against_the_hooks(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[faults]\ndrain_hook = "d"\n[hooks.d]\nargv = ["/bin/d", "{node}"]\n'))
    assert cfg.faults.drain_hook == "d" and cfg.hooks["d"].argv == ("/bin/d", "{node}")
    with pytest.raises(ConfigError, match=r"faults\.drain_hook names no \[hooks\.d\]"):
        load_config(write(tmp_path, '[faults]\ndrain_hook = "d"\n'))


def test_a_straggler_window_too_short_for_its_slices_is_refused() -> None:
    cfg = config_from_dict({"straggler": {"interval_s": 2.0, "window_s": 40.0, "slices": 5}})
    assert cfg.straggler.window_s == 40.0  # 5 slices x 4 samples x 2 s
    with pytest.raises(ConfigError, match=r"straggler\.window_s must hold 4 samples per slice: at least slices x 4 x "
                                          r"interval_s = 40, got 39"):
        config_from_dict({"straggler": {"interval_s": 2.0, "window_s": 39.0, "slices": 5}})
    with pytest.raises(ConfigError, match=r"straggler\.signal_window_s must hold 4 ticks per slice: at least "
                                          r"signal_slices x 4 x agent.interval_s = 60, got 59"):
        config_from_dict({"straggler": {"signal_window_s": 59.0, "signal_slices": 15}})
    assert config_from_dict({"straggler": {"signal_window_s": 59.0, "signals": False}}).straggler.signals is False
    with pytest.raises(ConfigError, match=r"straggler\.max_share_ratio must be between 0 and 1"):
        config_from_dict({"straggler": {"max_share_ratio": 1.5}})


# -- `config show` round trip --------------------------------------------------------------------------
WEIRD = 'we"ird\\ \'q\' \u00e9\U0001f600\x7f\t\n\x01'  # quotes, backslash, unicode, DEL, control characters

# Every key of every section set to a value other than its default (test_every_key_is_set_in_FULL checks).
FULL = Config(
    agent=AgentConfig(interval_s=0.25, backend="proc", state_dir="/var/tmp/gw \"state\"", hostname=WEIRD,
                      metrics_addr="[::1]:9999", incident_trace_s=30.0,
                      no_rank_warning_s=12.5),
    detect=DetectConfig(util_idle_max_percent=0.0, mem_held_min_bytes=0, proc_rss_held_min_bytes=1,
                        spin_util_min_percent=99.5, spin_power_max_ratio=1.0, spin_power_max_w=61.5,
                        spin_traffic_max_bytes_per_s=0.0, spin_mem_util_max_percent=3.0,
                        spin_traffic_max_link_ratio=0.5, progress_cpu_min_cores=0.25,
                        progress_io_min_bytes_per_s=1e-3, progress_wakeups_min_per_s=7.0, progress_min_window_s=0.75,
                        suspect_after_s=1.5, confirm_after_s=8.0, stack_confirm_gap_s=1e6, waiting_timeout_s=1e20,
                        deadline_margin_s=5.0, deadline_warn_ratio=0.75, deadline_still_max_s=9.0,
                        clear_after_s=4.0, waiting_stack_interval_s=30.0, heartbeat_stale_steps=3.0,
                        comm_progress_max_age_s=20.0),
    stacks=StacksConfig(enabled=False, py_spy="/opt/py spy/py-spy", timeout_s=2.5, concurrency=4, native=True,
                        nonblocking=False),
    recovery=RecoveryConfig(enabled=False, checkpoint_signal="SIGUSR2", checkpoint_grace_s=0.0, stop_grace_s=5.0,
                            memory_release_timeout_s=7.5, max_restarts=0, restart_window_s=60.0,
                            max_no_progress_restarts=5, restart_backoff_s=0.0, restart_backoff_max_s=60.0,
                            client_boundary_s=1.5, restart_on_crash=True),
    fallback=FallbackConfig(levels=(FallbackLevel("x", {"NCCL_PROTO": "^LL"}, WEIRD), FallbackLevel("y \u00e9", {})),
                            network_env={"NCCL_SOCKET_IFNAME": "=eth \"0\""}, diagnostics_env={},
                            healthy_reset_s=5.0, shared_dir="/shared/gpu-watchdog runs", actor_grace_s=0.0),
    faults=FaultsConfig(xid_events=False, event_wait_ms=100, application_xids=(13, 79),
                        drain_command=("/usr/bin/drain", "--node={node}", "{reason} \u00e9 \\{{x}}"),
                        drain_hook="node-drain", drain_timeout_s=9.0),
    ras=RasConfig(enabled="on", addr="[::1]:28029", timeout_s=3.5, poll_interval_s=2.0, confirm_gap_s=0.5,
                  watch_interval_s=0.0),
    flight_recorder=FlightRecorderConfig(enabled=False, buffer_size=20000, dump_on_suspect=False),
    straggler=StragglerConfig(enabled=False, interval_s=10.0, window_s=600.0, cpu_budget_percent=0.2, slices=4,
                              min_peer_wait_share=0.3, max_share_ratio=0.4, signals=False, signal_window_s=300.0,
                              signal_slices=10),
    daemon=DaemonSettings(control_socket="/tmp/gw/c.sock", socket_group="", allowed_uids=(1000, 1001),
                          allowed_gids=(2000,), allow_root=False, max_request_bytes=4096, preempt_timeout_s=5.0,
                          peer_timeout_s=7.0, stop_unregistered=True, incident_max_age_days=1.5,
                          incident_max_total_mb=64.0, housekeeping_interval_s=30.0, give_up_hook="requeue"),
    hooks={
        "node-drain": HookSpec("node-drain", "command", ("/usr/local/bin/drain", "{node}", "'{incident}'"), 15.0),
        "requeue": HookSpec("requeue", "slurm-requeue", ("scontrol", "requeue", "--lvl={level}", "{job_id}"), 120.0),
        "k8s_pod": HookSpec("k8s_pod", "k8s-delete-pod", ("kubectl", "delete", "pod", "{job_id}"), 86400.0),
    },
)


def test_every_key_is_set_in_FULL() -> None:
    """A key added to the schema must be added to FULL too, so the round trip below covers it."""
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert getattr(getattr(FULL, name), f.name) != getattr(cls(), f.name), f"{name}.{f.name}"
    assert {h.type for h in FULL.hooks.values()} == {"command", "slurm-requeue", "k8s-delete-pod"}
    assert FULL.faults.drain_hook in FULL.hooks


@pytest.mark.parametrize("cfg", [
    Config(),
    FULL,
    dataclasses.replace(FULL, fallback=FallbackConfig(levels=())),  # an empty ladder is not the default ladder
], ids=["defaults", "every-key", "no-levels"])
def test_render_round_trips_through_load_config(tmp_path: Path, cfg: Config) -> None:
    text = render_toml(cfg)
    assert config_from_dict(_toml(text)) == cfg
    (tmp_path / "shown.toml").write_text(text, encoding="utf-8")
    assert load_config(tmp_path / "shown.toml") == cfg
    assert "[daemon]" in text and all(f"[hooks.{name}]" in text for name in cfg.hooks)


def _toml(text: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads(text)


def _show(config: Path) -> str:
    r = subprocess.run([CLI, "config", "show", "--config", str(config)], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode("utf-8")


@pytest.mark.parametrize("source", ["hand-written", "every-key"])
def test_config_show_output_loads_back_to_the_same_output(tmp_path: Path, source: str) -> None:
    """`config show` output saved and given back through --config prints the same text (drain_hook set)."""
    text = ("[detect]\nconfirm_after_s = 8.0\n[fallback]\nnetwork_env = { NCCL_SOCKET_IFNAME = 'ib0' }\n"
            "[faults]\ndrain_hook = 'node-drain'\n[hooks.node-drain]\nargv = ['/bin/drain', '{node}']\n"
            "[hooks.requeue]\ntype = 'slurm-requeue'\n[daemon]\nallowed_uids = [1000]\n"
            if source == "hand-written" else render_toml(FULL))
    src = tmp_path / "src.toml"
    src.write_text(text, encoding="utf-8")
    out = _show(src)
    shown = tmp_path / "shown.toml"
    shown.write_bytes(out.encode("utf-8"))
    assert _show(shown) == out
    assert load_config(shown) == load_config(src)
    if source == "every-key":
        assert load_config(shown) == FULL
    else:
        assert "[daemon]\n" in out and "[hooks.node-drain]\n" in out and "[hooks.requeue]\n" in out
        assert load_config(shown).hooks["requeue"].argv == ("scontrol", "requeue", "{job_id}")


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
