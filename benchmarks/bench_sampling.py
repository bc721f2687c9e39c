"""CPU cost of one sampling tick, and the agent's memory. A script that prints figures, not a test.

    .venv/bin/python benchmarks/bench_sampling.py [--quick]

Measured with ``time.process_time`` (CPU seconds of this process) over many ticks:

1. ``NvmlReader.read_all`` over an injected pynvml (the real error classes, fake calls that return prebuilt
   values) at 8 GPUs × 16 processes and 64 GPUs × 512 processes (processes in total, spread evenly), beside
   the *bare* cost of the same fake calls made in a plain loop: the ratio is the reader's own overhead
   against calls that cost nothing. Then the same over the real pynvml and the NVML stand-in library
   (tests/nvml_standin, compiled with gcc against nvml.h), where the bare calls cost what ctypes costs.
2. ``ProcessScanner.sample`` over ~16 real rank-like child processes (RANK in their environment), beside the
   bare psutil calls it needs (one process listing, then status/CPU/memory/cmdline/IO per rank).
3. ``detector.step`` on a steady healthy node at 8 × 16 and 64 × 512.
4. The agent's RSS: a fresh interpreter that imports gpu_watchdog and runs a few proc-backend ticks
   (without torch).

Targets: ≤ 3 ms CPU per tick at 8 × 16, ≤ 20 ms at 64 × 512, within 1.5× of the bare calls, RSS ≤ 60 MB.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import psutil
import pynvml
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.detector import DetectorState, step
from gpu_watchdog.model import DeviceSample, GpuProcess, JobIdentity, NodeSample, ProcessSample
from gpu_watchdog.sample.nvml import TRAFFIC_FIELDS, NvmlReader
from gpu_watchdog.sample.processes import ProcessScanner

GIB = 1 << 30


def cpu_per_call(fn: Callable[[], object], min_s: float, rounds: int = 5) -> float:
    """CPU seconds per call of ``fn``: the best of ``rounds`` rounds, each calling it until ``min_s / rounds``
    of CPU time was spent (the best round is the least disturbed by other work on a shared machine)."""
    fn()  # warm caches
    best = float("inf")
    for _ in range(rounds):
        n, start = 0, time.process_time()
        while True:
            fn()
            n += 1
            spent = time.process_time() - start
            if spent >= min_s / rounds:
                break
        best = min(best, spent / n)
    return best


# -- 1. NVML reader over a fake pynvml ----------------------------------------------------------------------
def fake_pynvml(n_gpus: int, n_procs: int) -> types.SimpleNamespace:
    lib = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVMLError", "NVML_"))})
    per_gpu = max(1, n_procs // n_gpus)
    util = types.SimpleNamespace(gpu=97, memory=20)
    mem = types.SimpleNamespace(used=60 * GIB, total=80 * GIB, free=20 * GIB)
    fields = [types.SimpleNamespace(fieldId=f, nvmlReturn=pynvml.NVML_SUCCESS, value=types.SimpleNamespace(ullVal=1))
              for f in TRAFFIC_FIELDS]
    procs = [[types.SimpleNamespace(pid=10_000 + g * per_gpu + j, usedGpuMemory=GIB) for j in range(per_gpu)]
             for g in range(n_gpus)]
    putil = [[types.SimpleNamespace(pid=p.pid, smUtil=90, timeStamp=1) for p in ps] for ps in procs]

    def fn(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        f.__name__ = name
        setattr(lib, name, f)
        return f

    fn("nvmlInit", lambda: None)
    fn("nvmlShutdown", lambda: None)
    fn("nvmlSystemGetDriverVersion", lambda: "550.54.15")
    fn("nvmlDeviceGetCount", lambda: n_gpus)
    fn("nvmlDeviceGetHandleByIndex", lambda i: i)
    fn("nvmlDeviceGetUUID", lambda h: f"GPU-{h:08d}")
    fn("nvmlDeviceGetName", lambda h: "NVIDIA H100 80GB HBM3")
    fn("nvmlDeviceGetUtilizationRates", lambda h: util)
    fn("nvmlDeviceGetMemoryInfo", lambda h: mem)
    fn("nvmlDeviceGetPowerUsage", lambda h: 450_000)
    fn("nvmlDeviceGetEnforcedPowerLimit", lambda h: 700_000)
    fn("nvmlDeviceGetTemperature", lambda h, s: 60)
    fn("nvmlDeviceGetClockInfo", lambda h, c: 1980)
    fn("nvmlDeviceGetFieldValues", lambda h, ids: fields)
    fn("nvmlDeviceGetComputeRunningProcesses", lambda h: procs[h])
    fn("nvmlDeviceGetProcessUtilization", lambda h, since: putil[h])
    fn("nvmlDeviceGetMaxPcieLinkGeneration", lambda h: 5)  # read once per GPU, not per tick: not in the bare tick
    fn("nvmlDeviceGetMaxPcieLinkWidth", lambda h: 16)
    fn("nvmlDeviceGetMaxClockInfo", lambda h, c: 1980)  # read once per GPU too
    fn("nvmlDeviceGetCurrentClocksEventReasons", lambda h: 0)
    fn("nvmlDeviceGetCurrPcieLinkGeneration", lambda h: 5)
    fn("nvmlDeviceGetCurrPcieLinkWidth", lambda h: 16)
    return lib


def bare_nvml_tick(lib: Any, n_gpus: int) -> None:
    """Exactly the calls read_all makes, with nothing around them."""
    for h in range(n_gpus):
        lib.nvmlDeviceGetUtilizationRates(h)
        lib.nvmlDeviceGetMemoryInfo(h)
        lib.nvmlDeviceGetPowerUsage(h)
        lib.nvmlDeviceGetEnforcedPowerLimit(h)
        lib.nvmlDeviceGetTemperature(h, 0)
        lib.nvmlDeviceGetClockInfo(h, 1)
        lib.nvmlDeviceGetFieldValues(h, list(TRAFFIC_FIELDS))
        lib.nvmlDeviceGetComputeRunningProcesses(h)
        lib.nvmlDeviceGetProcessUtilization(h, 0)
        lib.nvmlDeviceGetCurrentClocksEventReasons(h)
        lib.nvmlDeviceGetCurrPcieLinkGeneration(h)
        lib.nvmlDeviceGetCurrPcieLinkWidth(h)


def bench_nvml(min_s: float) -> list[tuple[str, float, float]]:
    out = []
    for n_gpus, n_procs in ((8, 16), (64, 512)):
        lib = fake_pynvml(n_gpus, n_procs)
        reader = NvmlReader(lib=lib)
        reader.start()
        ours = cpu_per_call(reader.read_all, min_s)
        bare = cpu_per_call(lambda lib=lib, n=n_gpus: bare_nvml_tick(lib, n), min_s)
        out.append((f"{n_gpus} GPUs x {n_procs} procs", ours, bare))
    return out


# -- 1b. the same over the real pynvml and the NVML stand-in library (tests/nvml_standin) -------------------
# Fakes cost nothing, so the ratio above is the reader's whole overhead against zero. With the real pynvml
# (ctypes) calling a real shared library that implements nvml.h, the bare calls cost what pynvml costs.
STANDIN_CHILD = """
import json, sys, pynvml
sys.path.insert(0, sys.argv[1])
from bench_sampling import cpu_per_call
from gpu_watchdog.sample.nvml import TRAFFIC_FIELDS, NvmlReader
reader = NvmlReader()
n = reader.start()
reader.read_all()
hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
since = [d.last_process_ts for d in reader._devices]
def bare():
    for i, h in enumerate(hs):
        pynvml.nvmlDeviceGetUtilizationRates(h)
        pynvml.nvmlDeviceGetMemoryInfo(h)
        pynvml.nvmlDeviceGetPowerUsage(h)
        pynvml.nvmlDeviceGetEnforcedPowerLimit(h)
        pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
        pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        pynvml.nvmlDeviceGetFieldValues(h, list(TRAFFIC_FIELDS))
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        try:
            pynvml.nvmlDeviceGetProcessUtilization(h, since[i])
        except pynvml.NVMLError_NotFound:
            pass
def bare_read():
    # The same calls plus reading the values the agent needs out of pynvml's structs (each attribute of a
    # pynvml struct goes through a Python-level __getattribute__): the least code that gets the same data.
    for i, h in enumerate(hs):
        u = pynvml.nvmlDeviceGetUtilizationRates(h)
        u.gpu, u.memory
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        m.used, m.total
        pynvml.nvmlDeviceGetPowerUsage(h)
        pynvml.nvmlDeviceGetEnforcedPowerLimit(h)
        pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
        pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        for v in pynvml.nvmlDeviceGetFieldValues(h, list(TRAFFIC_FIELDS)):
            v.nvmlReturn, v.value.ullVal
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            p.pid, p.usedGpuMemory
        try:
            pynvml.nvmlDeviceGetProcessUtilization(h, since[i])
        except pynvml.NVMLError_NotFound:
            pass
min_s = float(sys.argv[2])
print(json.dumps([cpu_per_call(reader.read_all, min_s), cpu_per_call(bare, min_s),
                  cpu_per_call(bare_read, min_s)]))
"""


def bench_nvml_standin(min_s: float) -> list[tuple[str, float, float]] | str:
    import json
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    try:
        from nvml_standin import StandinBuildError, StandinState, build_standin, standin_env
    except ImportError as e:
        return f"skipped ({e})"
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-nvml-") as tmp:
        try:
            lib = build_standin(tmp)
        except StandinBuildError as e:
            return f"skipped (stand-in does not build: {str(e).splitlines()[0]})"
        for n_gpus, n_procs in ((8, 16), (64, 512)):
            state = StandinState(Path(tmp, f"state-{n_gpus}.json"))
            per_gpu = n_procs // n_gpus
            with state.batch():
                for g in range(n_gpus):
                    state.add_gpu(utilization_gpu=97, memory_used=60 * GIB, power_mw=450_000)
                    for j in range(per_gpu):
                        state.place_process(g, 10_000 + g * per_gpu + j, GIB)
                        state.add_process_sample(g, 10_000 + g * per_gpu + j, 90)
            r = subprocess.run([sys.executable, "-c", STANDIN_CHILD, str(Path(__file__).parent), str(min_s)],
                               env=standin_env(lib.parent, state.path), capture_output=True, text=True,
                               timeout=300)
            if r.returncode != 0:
                return f"skipped (child failed: {r.stderr.strip().splitlines()[-1:]})"
            ours, bare, bare_read = json.loads(r.stdout)
            out.append((f"{n_gpus} GPUs x {n_procs} procs", ours, bare))
            out.append((f"{n_gpus} GPUs x {n_procs} procs, values read", ours, bare_read))
    return out


# -- 2. psutil scanner over real processes ----------------------------------------------------------------
RANK_CODE = "import time\nwhile True: time.sleep(0.05)"  # ~idle, but really scheduled


def start_ranks(n: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    for r in range(n):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r % 8), "WORLD_SIZE": str(n),
               "TORCHELASTIC_RUN_ID": "bench"}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_CODE], env=env, start_new_session=True))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until every child exec'd (its environ shows RANK)
        try:
            if all("RANK" in psutil.Process(p.pid).environ() for p in procs):
                break
        except psutil.Error:
            pass
        time.sleep(0.05)
    return procs


def bare_psutil_tick(pids: list[int]) -> None:
    ppids = {p.pid: p.info["ppid"] for p in psutil.process_iter(["ppid"])}
    for pid in pids:
        if pid not in ppids:
            continue
        p = psutil.Process(pid)
        with p.oneshot():
            p.status()
            p.cpu_times()
            p.memory_info()
            p.cmdline()
            p.io_counters()


def bench_scanner(n_ranks: int, min_s: float) -> tuple[float, float, float, int]:
    procs = start_ranks(n_ranks)
    try:
        pids = [p.pid for p in procs]
        scanner = ProcessScanner(root_pid=os.getpid())
        found = len(scanner.sample()[0])
        ours = cpu_per_call(scanner.sample, min_s)
        node = ProcessScanner()  # the daemon: every process on the node is in scope
        node_cost = cpu_per_call(node.sample, min_s)
        bare = cpu_per_call(lambda: bare_psutil_tick(pids), min_s)
        return ours, bare, node_cost, found
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


# -- 3. detector ------------------------------------------------------------------------------------------------
def node_samples(n_gpus: int, n_procs: int, ticks: int) -> list[NodeSample]:
    per_gpu = max(1, n_procs // n_gpus)
    out = []
    for k in range(ticks):
        t = 1_767_225_600.0 + k
        devices, procs = [], []
        for g in range(n_gpus):
            pids = [10_000 + g * per_gpu + j for j in range(per_gpu)]
            devices.append(DeviceSample(g, f"GPU-{g:08d}", "H100", util_percent=97.0, mem_used_bytes=60 * GIB,
                                        mem_total_bytes=80 * GIB, power_w=500.0, power_limit_w=700.0,
                                        pcie_tx_bytes_total=k * 10**9, nvlink_tx_bytes_total=k * 10**10,
                                        processes=tuple(GpuProcess(p, GIB) for p in pids)))
            for j, pid in enumerate(pids):
                rank = g * per_gpu + j
                procs.append(ProcessSample(pid, 1.0, 1, "running", 10.0 + k, k * 10**6, GIB,
                                           job=JobIdentity(f"job-{rank // 64}", rank % 64, rank % 8, 64),
                                           is_rank=True))
        out.append(NodeSample(t, "bench", "nvml", tuple(devices), tuple(procs)))
    return out


def bench_detector(min_s: float) -> list[tuple[str, float]]:
    cfg = DetectConfig()
    out = []
    for n_gpus, n_procs in ((8, 16), (64, 512)):
        samples = node_samples(n_gpus, n_procs, 2)
        state, _ = step(DetectorState(), samples[0], cfg)
        out.append((f"{n_gpus} GPUs x {n_procs} procs", cpu_per_call(lambda s=state, x=samples[1]: step(s, x, cfg),
                                                                     min_s)))
    return out


# -- 4. agent RSS ---------------------------------------------------------------------------------------------------
RSS_CODE = """
import sys, time, resource
from gpu_watchdog.sample.backends import choose_backend
from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.detector import DetectorState, step
backend, why = choose_backend("proc")
state = DetectorState()
for _ in range(5):
    state, _f = step(state, backend.sample(), DetectConfig())
    time.sleep(0.05)
assert "torch" not in sys.modules
rss = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")][0]
print(rss * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, why)
"""


def bench_rss() -> tuple[int, int, str]:
    r = subprocess.run([sys.executable, "-c", RSS_CODE], capture_output=True, text=True, timeout=120, check=True)
    rss, peak, why = r.stdout.split(maxsplit=2)
    return int(rss), int(peak), why.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter measurements (noisier)")
    args = ap.parse_args()
    min_s = 0.3 if args.quick else 1.5
    ms = 1000.0

    print("NvmlReader.read_all (injected pynvml), CPU per tick:")
    nvml = bench_nvml(min_s)
    for label, ours, bare in nvml:
        print(f"  {label:24s} {ours * ms:7.3f} ms   bare calls {bare * ms:7.3f} ms   ratio {ours / bare:4.2f}x")

    print("NvmlReader.read_all (real pynvml + NVML stand-in library), CPU per tick:")
    standin = bench_nvml_standin(min_s)
    if isinstance(standin, str):
        print(f"  {standin}")
    else:
        for label, o, b in standin:
            print(f"  {label:24s} {o * ms:7.3f} ms   bare calls {b * ms:7.3f} ms   ratio {o / b:4.2f}x")

    ours, bare, node_cost, found = bench_scanner(16, min_s)
    print(f"ProcessScanner.sample, {found} real rank processes, CPU per tick "
          f"({len(psutil.pids())} processes on this machine):")
    print(f"  {'root_pid scope':24s} {ours * ms:7.3f} ms   bare psutil {bare * ms:7.3f} ms   ratio {ours / bare:4.2f}x")
    print(f"  {'whole node (daemon)':24s} {node_cost * ms:7.3f} ms")

    print("detector.step, steady healthy node, CPU per tick:")
    det = bench_detector(min_s)
    for label, cost in det:
        print(f"  {label:24s} {cost * ms:7.3f} ms")

    real = standin if not isinstance(standin, str) else nvml
    print("Agent tick, NVML read (stand-in when it built) + detector step (targets: <= 3 ms, <= 20 ms):")
    print(f"  {'8 GPUs x 16 procs':24s} {(real[0][1] + det[0][1]) * ms:7.3f} ms, "
          f"{(real[0][1] + det[0][1] + ours) * ms:7.3f} ms with the scan of 16 ranks")
    print(f"  {'64 GPUs x 512 procs':24s} {(real[1][1] + det[1][1]) * ms:7.3f} ms")

    rss, peak, why = bench_rss()
    print(f"Agent RSS after 5 proc ticks (no torch): {rss / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB; "
          f"target <= 60 MB); {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
