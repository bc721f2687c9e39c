"""What does one Prometheus scrape of the agent cost? (collect + generate_latest, and update() per tick)

    .venv/bin/python benchmarks/bench_scrape.py [--gpus 8] [--procs-per-gpu 16] [--jobs 4] [--repeat 2000]

Builds a node picture by hand — ``--gpus`` GPUs with every field set, ``--procs-per-gpu`` processes on each,
``--jobs`` jobs sharing the GPUs (one stalled, one waiting on a rank) — and a fully exercised AgentMetrics,
then times:
  * ``update()``: what the sampling loop pays per tick;
  * one scrape in-process: ``generate_latest(registry)`` (every collect() included), with and without the
    process_* collector;
  * one scrape over HTTP from a served endpoint (the text a real Prometheus gets).
Prints the median and p99 wall time in µs, the CPU ms per scrape (process_time), and the size/series count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable

from gpu_watchdog.export.health import LoopHealth
from gpu_watchdog.export.http import serve
from gpu_watchdog.export.metrics import AgentMetrics
from gpu_watchdog.model import DeviceSample, GpuProcess, JobIdentity, JobStatus, NodeSample, ProcessSample, SampleError
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest


def node_picture(gpus: int, per_gpu: int, jobs: int) -> tuple[NodeSample, dict[str, JobStatus]]:
    t = time.time()
    devices, procs = [], []
    pid = 10_000
    job_ranks: dict[str, list[int]] = {f"job-{j}": [] for j in range(jobs)}  # the job's ranks on this node
    job_devs: dict[str, list[str]] = {f"job-{j}": [] for j in range(jobs)}
    for g in range(gpus):
        job = f"job-{g % jobs}"
        uuid = f"GPU-{g:08x}-0000-0000-0000-000000000000"
        gprocs = []
        for k in range(per_gpu):
            pid += 1
            if k == 0:  # one rank per GPU; the other processes are its dataloader workers
                rank = len(job_ranks[job])
                job_ranks[job].append(rank)
            gprocs.append(GpuProcess(pid, 2 << 30, 50.0))
            procs.append(ProcessSample(pid, t - 100, 1, "sleeping", 12.5, 1 << 20, 3 << 30,
                                       ("python", "train.py"), JobIdentity(job, rank, rank % 8, gpus),
                                       is_rank=k == 0))
        devices.append(DeviceSample(g, uuid, "NVIDIA H100 80GB HBM3", util_percent=97.0, mem_used_bytes=60 << 30,
                                    mem_total_bytes=80 << 30, power_w=120.0, power_limit_w=700.0,
                                    temperature_c=40.0, sm_clock_mhz=1980.0, pcie_tx_bytes_total=1 << 30,
                                    pcie_rx_bytes_total=1 << 30, processes=tuple(gprocs)))
        job_devs[job].append(uuid)
    states = ["stalled", "waiting"] + ["running"] * max(0, jobs - 2)
    statuses = {}
    for (job, ranks), st in zip(job_ranks.items(), states, strict=False):
        statuses[job] = JobStatus(job, state=st, ranks=tuple(ranks), devices=tuple(job_devs[job]),
                                  waiting_since=t - 30 if st == "waiting" else None,
                                  waiting_on=(ranks[0],) if st == "waiting" else ())
    return NodeSample(t=t, hostname="bench-node", backend="nvml", devices=tuple(devices), processes=tuple(procs),
                      errors=(SampleError("NVMLError_NotSupported", "x"),)), statuses


def exercised(registry: CollectorRegistry | None, sample: NodeSample, jobs: dict[str, JobStatus]) -> AgentMetrics:
    m = AgentMetrics(registry)
    m.update(sample, jobs, {j: i % 3 for i, j in enumerate(jobs)})
    for j in jobs:
        m.restart(j)
        m.job_config(j, "3f2a9c0d11aa")
    for kind in ("stall", "gpu_fault"):
        m.incident(kind)
    for a in ("dump_stacks", "checkpoint", "stop", "restart"):
        m.action(a, True)
    m.pyspy_dump("ok")
    m.nvml_errors(sample.errors)
    m.gpu_fault(sample.devices[0].uuid, 79)
    for i in range(100):
        m.sample_duration(0.001 * i)
        m.detection_latency(float(i))
    return m


def timeit(fn: Callable[[], object], repeat: int) -> tuple[list[float], float]:
    for _ in range(min(50, repeat)):
        fn()  # warm up
    walls = []
    c0 = time.process_time()
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return walls, (time.process_time() - c0) / repeat


def report(label: str, walls: list[float], cpu_s: float) -> None:
    walls = sorted(walls)
    p99 = walls[min(len(walls) - 1, int(len(walls) * 0.99))]
    print(f"  {label:<44} median {statistics.median(walls) * 1e6:8.1f} µs   p99 {p99 * 1e6:8.1f} µs   "
          f"CPU {cpu_s * 1e3:6.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--procs-per-gpu", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()

    sample, jobs = node_picture(args.gpus, args.procs_per_gpu, args.jobs)
    m = exercised(None, sample, jobs)  # the agent's default: own registry, process_* included
    bare = exercised(CollectorRegistry(), sample, jobs)  # a shared registry: no process_* collector
    text = m.render()
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    print(f"node: {args.gpus} GPUs x {args.procs_per_gpu} processes, {args.jobs} jobs "
          f"({sum(len(j.ranks) for j in jobs.values())} ranks); exposition {len(text)} bytes, {series} series")

    levels = {j: 1 for j in jobs}
    report("update() per tick", *timeit(lambda: m.update(sample, jobs, levels), args.repeat * 5))
    report("scrape: generate_latest (with process_*)", *timeit(lambda: generate_latest(m.registry), args.repeat))
    report("scrape: generate_latest (snapshot+counters)", *timeit(lambda: generate_latest(bare.registry),
                                                                   args.repeat))
    with serve("127.0.0.1:0", m.registry, LoopHealth(60.0)) as srv:
        def http() -> bytes:
            with urllib.request.urlopen(f"{srv.url}/metrics", timeout=10) as r:
                return r.read()
        report("scrape over HTTP (client+server, one process)", *timeit(http, max(100, args.repeat // 10)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
