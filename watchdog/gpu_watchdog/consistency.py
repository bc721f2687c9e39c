"""Job-configuration consistency: do all ranks of a job run with the same launch settings?

Ranks started with different ``NPROC_PER_NODE`` or NCCL settings hang (RESEARCH §0, the multi-node GRPO
report). The agent compares, across the ranks it sees on this node, the environment keys below and exports a
stable digest per job and node, so an alert can fire when nodes of one job disagree
(``prometheus/alerts.yml``: GpuWatchdogJobConfigMismatch).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
ENV_KEYS = ("NPROC_PER_NODE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Set per restart by gpu-watchdog itself: they differ by design, not by mistake.
_IGNORED = ("NCCL_DEBUG_FILE",)


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


def check_ranks(envs: Mapping[int, Mapping[str, str]]) -> ConfigReport:
    """Compare the launch environment of the ranks seen on this node."""
    per_rank = {r: relevant(e) for r, e in envs.items()}
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
