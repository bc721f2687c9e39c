"""Stragglers' evidence: the rank a job's other ranks keep waiting for, and why (docs/stragglers.md).

- ``score``: per-rank wait shares over a sliding window of stack samples, and the strict verdict (pure);
- ``causes``: what the node shows about a rank's slowness (cgroup CPU throttling and memory pressure, input, its
  GPU's clock slowdown reasons and PCIe link).

The sampling and the findings are detect.stragglers'.
"""
