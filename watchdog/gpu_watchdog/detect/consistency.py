"""Job-configuration consistency: do all ranks of a job run with the same launch settings?

Ranks started with different ``NPROC_PER_NODE`` or NCCL settings hang (RESEARCH §0, the multi-node GRPO
report). The agent compares, across the ranks it sees on this node, the environment keys below and exports a
stable digest per job and node, so an alert can fire when nodes of one job disagree
(``prometheus/alerts.yml``: GpuWatchdogJobConfigMismatch).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from gpu_watchdog.evidence.stacks.diagnosis import format_ranks
from gpu_watchdog.model import Finding, JobStatus

ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
ENV_KEYS = ("NPROC_PER_NODE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Which run of the job the ranks belong to (kept, never compared): the nodes' settings are compared run by run.
RUN_KEYS = ("SLURM_RESTART_COUNT", "GPU_WATCHDOG_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
# Whether a process is one of torch's ranks (RANK) or an srun task known only by its SLURM_PROCID (kept, never
# compared): once any rank of a job has RANK, a task without it is a launcher that has not started its workers yet.
RANK_KEY = "RANK"
CONSISTENCY_ENV = ENV_PREFIXES + ENV_KEYS + RUN_KEYS + (RANK_KEY,)  # what the scanner keeps of each rank's environment
# Named after each node's own hardware (its NIC / HCA names): they may differ between nodes by design.
PER_NODE_KEYS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")
CROSS_NODE_S = 120.0  # compare with the other nodes this long after this node's own ranks were first compared
CROSS_NODE_EVERY_S = 5.0
CONFIG_CHECK_WAIT_S = 10.0  # compare the ranks seen so far when the rest of LOCAL_WORLD_SIZE never shows up
# Keep comparing this long after the first comparison: a wrapper that sets variables and then execs
# (``export NCCL_…; exec python …``) carries the old environment until it execs, however long that takes.
CONFIG_SETTLE_S = 30.0
# Set per restart by gpu-watchdog itself: they differ by design, not by mistake. The Flight Recorder's buffer, dump
# file and dump pipe (``[flight_recorder]``: paths under each node's own state directory) only record what the
# collectives do, never change it.
_IGNORED = ("NCCL_DEBUG_FILE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")


def relevant(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if (k.startswith(ENV_PREFIXES) or k in ENV_KEYS) and k not in _IGNORED}


@dataclass(frozen=True)
class ConfigReport:
    digest: str  # sha256 (16 hex) of the settings; identical on every node of a consistent job
    consistent: bool
    differences: tuple[str, ...]  # "NCCL_P2P_DISABLE: rank 3=1, ranks 0,1,2=(unset)"
    # What disagrees, whichever ranks and however many: (key, its distinct values). The same mismatch
    # seen again with one more rank is not news.
    mismatch: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def summary(self) -> str:
        return "consistent" if self.consistent else "; ".join(self.differences)


def _digest(settings: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(settings.items())).encode()).hexdigest()[:16]


def local_world_size(envs: Iterable[Mapping[str, str]]) -> int | None:
    """How many ranks this node should run (torchrun's LOCAL_WORLD_SIZE), when any rank says."""
    for env in envs:
        value = env.get("LOCAL_WORLD_SIZE", "")
        if value.isdigit():
            return int(value)
    return None


def torch_ranks(by_host: Mapping[str, Mapping[int, Mapping[str, str]]]) -> dict[str, dict[int, Mapping[str, str]]]:
    """The ranks to compare: when any process of the job carries torch's RANK, only those that do. An srun task
    whose rank is its SLURM_PROCID (``srun bash -c 'torchrun …'``) is the launcher of ranks not started yet, and
    has none of torchrun's variables: compared with the workers it would be a false mismatch."""
    if not any(RANK_KEY in env for ranks in by_host.values() for env in ranks.values()):
        return {host: dict(ranks) for host, ranks in by_host.items()}
    out = {host: {r: e for r, e in ranks.items() if RANK_KEY in e} for host, ranks in by_host.items()}
    return {host: ranks for host, ranks in out.items() if ranks}


def check_ranks(envs: Mapping[int, Mapping[str, str]]) -> ConfigReport:
    """Compare the launch environment of the ranks seen on this node."""
    per_rank = {r: relevant(e) for r, e in torch_ranks({"": envs}).get("", {}).items()}
    keys = sorted({k for e in per_rank.values() for k in e})
    differences, mismatch = [], []
    for k in keys:
        by_value: dict[str, list[int]] = {}
        for r in sorted(per_rank):
            by_value.setdefault(per_rank[r].get(k, "(unset)"), []).append(r)
        if len(by_value) > 1:
            parts = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}={v}" for v, rs in by_value.items()]
            differences.append(f"{k}: {', '.join(parts)}")
            mismatch.append((k, tuple(sorted(by_value))))
    if differences:
        # Inconsistent: the digest covers every rank's settings, so it matches no consistent node.
        merged = {f"{r}:{k}": v for r, e in per_rank.items() for k, v in e.items()}
        return ConfigReport(_digest(merged), False, tuple(differences), tuple(mismatch))
    first = next(iter(per_rank.values()), {})
    return ConfigReport(_digest(first), True, ())


def run_key(envs: Iterable[Mapping[str, str]]) -> str:
    """The run the ranks belong to (Slurm's restart count, launch's or torchrun's), "0" when none says."""
    for env in envs:
        for k in RUN_KEYS:
            if env.get(k, "").isdigit():
                return env[k]
    return "0"


def check_nodes(by_host: Mapping[str, Mapping[int, Mapping[str, str]]]) -> ConfigReport:
    """Compare the launch settings of one job's ranks across nodes ({host: {rank: env}}); differences name the
    nodes and their ranks ("NPROC_PER_NODE: n1 (ranks 0,1)=2, n2 (ranks 2-5)=4"). Keys named after a node's own
    hardware (PER_NODE_KEYS) are left out, and so are srun tasks that have not started their ranks (torch_ranks)."""
    by_host = torch_ranks(by_host)
    keys = sorted({k for ranks in by_host.values() for env in ranks.values() for k in relevant(env)
                   if k not in PER_NODE_KEYS})
    differences, mismatch = [], []
    for k in keys:
        seen: dict[str, dict[str, list[int]]] = {}  # value → host → ranks
        for host in sorted(by_host):
            for rank in sorted(by_host[host]):
                v = relevant(by_host[host][rank]).get(k, "(unset)")
                seen.setdefault(v, {}).setdefault(host, []).append(rank)
        if len(seen) > 1:
            parts = [f"{host} ({format_ranks(rs)})={v}" for v, hosts in seen.items() for host, rs in hosts.items()]
            differences.append(f"{k}: {', '.join(parts)}")
            mismatch.append((k, tuple(sorted(seen))))
    return ConfigReport("", not differences, tuple(differences), tuple(mismatch))


def launch_env(pid: int, scanner: Any) -> Mapping[str, str]:
    """A rank's environment as it is now (after any exec; the scanner caches the one it first saw), limited
    to the keys the consistency check compares; the scanner's copy when /proc cannot be read."""
    try:
        env = psutil.Process(pid).environ()
    except psutil.Error:
        return scanner.env_of(pid)  # type: ignore[no-any-return]
    return {k: v for k, v in env.items() if k.startswith(CONSISTENCY_ENV)}


class ConfigWatch:
    """One job's consistency check: when to compare its ranks (``due``) and whether a mismatch is news.

    Due once the same rank processes were seen two ticks in a row and every local rank is there, or no more
    came for ``wait_s``; then every tick for ``settle_s`` more, so a rank that execs late is compared as the
    program it became and the exported digest ends on the final settings. A mismatch is reported when two
    comparisons in a row show it (one read before an exec is not a mismatch), and then once: the same
    disagreement seen again (another rank, a restarted run) is not news; a different one is.
    """

    def __init__(self, wait_s: float = CONFIG_CHECK_WAIT_S, settle_s: float = CONFIG_SETTLE_S) -> None:
        self.wait_s, self.settle_s = wait_s, settle_s
        self._seen: dict[int, int] = {}
        self._since = 0.0
        self._first_compared: float | None = None  # when these ranks were first compared
        self._last: tuple[tuple[str, tuple[str, ...]], ...] = ()  # what the previous comparison disagreed on
        self._reported: tuple[tuple[str, tuple[str, ...]], ...] = ()
        self._cross_at = float("-inf")  # the last comparison with the other nodes
        self._cross_reported: tuple[tuple[str, tuple[str, ...]], ...] = ()
        self._cross_last: tuple[tuple[str, tuple[str, ...]], ...] = ()  # what the previous cross comparison showed

    def new_run(self) -> None:
        """The job was restarted: its new ranks are checked again (a known mismatch stays known)."""
        self._seen, self._first_compared, self._last = {}, None, ()

    def due(self, rank_pids: Mapping[int, int], env_of: Callable[[int], Mapping[str, str]], t: float) -> bool:
        if not rank_pids:
            return False
        if rank_pids != self._seen:  # every tick: compare, copy only on a change
            self._seen, self._since, self._first_compared = dict(rank_pids), t, None
            return False
        if self._first_compared is not None:
            return t - self._first_compared < self.settle_s
        expected = local_world_size(env_of(pid) for pid in rank_pids.values())
        if expected is None or len(rank_pids) >= expected or t - self._since >= self.wait_s:
            self._first_compared = t
            return True
        return False

    def check(self, status: JobStatus, scanner: Any, t: float) -> tuple[ConfigReport, Finding | None]:
        """Compare the job's ranks now; the finding is None unless the mismatch is news."""
        report = check_ranks({r: launch_env(pid, scanner) for r, pid in status.rank_pids.items()})
        if not self.news(report):
            return report, None
        return report, Finding("config_mismatch", "env_mismatch", status.job_id, status.ranks, (), t, t,
                               detail=f"ranks were launched with different settings: {report.summary}",
                               basis="process")

    def cross_due(self, t: float) -> bool:
        """Time to compare with the other nodes (``fallback.shared_dir``): every CROSS_NODE_EVERY_S, for CROSS_NODE_S
        after this node's own ranks were first compared (the other nodes' ranks may start later)."""
        if self._first_compared is None or t - self._first_compared > CROSS_NODE_S \
                or t - self._cross_at < CROSS_NODE_EVERY_S:
            return False
        self._cross_at = t
        return True

    def cross_finding(self, report: ConfigReport, status: JobStatus, t: float) -> Finding | None:
        """A config_mismatch finding naming the nodes, once per disagreement, and only when two comparisons in a
        row show it: another node's record may be a moment old (its ranks exec'd, or started, since)."""
        previous, self._cross_last = self._cross_last, report.mismatch
        if report.consistent or report.mismatch != previous or report.mismatch == self._cross_reported:
            return None
        self._cross_reported = report.mismatch
        return Finding("config_mismatch", "env_mismatch_nodes", status.job_id, status.ranks, (), t, t,
                       detail=f"nodes of the job were launched with different settings: {report.summary}",
                       basis="process")

    def news(self, report: ConfigReport) -> bool:
        previous, self._last = self._last, report.mismatch
        if report.consistent or report.mismatch != previous or report.mismatch == self._reported:
            return False
        self._reported = report.mismatch
        return True
