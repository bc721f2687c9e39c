"""Do the detector's GPU signatures hold on a real GPU? Three workloads on GPU 0, recorded and replayed.

    .venv/bin/python benchmarks/gpu_signatures.py [--duration 30] [--warmup 5] [--out-dir DIR] [--only NAME]

Needs one CUDA GPU with NVML (torch with CUDA); without one it prints one line and exits 69. Each workload
runs in a child process on GPU 0 with GPU_WATCHDOG_JOB_ID=ID RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 (rank 0 of
job ID) and holds ``--mem-gib`` GiB of GPU memory:

- ``spin``: ``torch.cuda._sleep`` kernels of about 1 s each, each followed by ``torch.cuda.synchronize()``,
  forever: the GPU busy at low power with no traffic while the host busy-waits in a device sync (the NCCL
  spin). Expected: a stall with signature ``spin``.
- ``host_stall``: the memory allocated, then the host blocks forever (``threading.Event().wait()``): 0 %
  utilization with memory held. Expected: a stall with signature ``idle_held``.
- ``healthy``: repeated 8192 x 8192 bf16 (fp16) matmuls with an ``.item()`` every few. Expected: no finding.

After ``--warmup`` seconds each one is recorded with the real CLI
(``gpu-watchdog record --backend nvml --duration S --output F --job ID``) and the trace replayed with
``gpu-watchdog replay F --json --config C``, where C sets ``[detect] confirm_after_s`` to ``--confirm-after``
(8 s; the default 30 s would need recordings longer than that, since these traces carry no stack dumps). Prints
NVML's view averaged over the recording (read from the trace), the replay's verdict and whether it is the
expected one. Exit 0 when every workload matches, 1 otherwise. Child processes are always stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.detector import device_signature
from gpu_watchdog.errors import EXIT_UNAVAILABLE, WatchdogError
from gpu_watchdog.model import DeviceSample, NodeSample, ProcessSample
from gpu_watchdog.sample.trace import read_trace

GIB = 1 << 30
MIB = 1 << 20
WORKLOADS = ("spin", "host_stall", "healthy")
# (kind, signature) of the one finding replay must give, or None for no finding at all.
EXPECTED: dict[str, tuple[str, str] | None] = {
    "spin": ("stall", "spin"),
    "host_stall": ("stall", "idle_held"),
    "healthy": None,
}
WHAT = {
    "spin": "~1 s sleep kernels, host busy-waiting in torch.cuda.synchronize()",
    "host_stall": "memory held, host blocked in threading.Event().wait()",
    "healthy": "8192x8192 matmuls with a periodic .item()",
}
READY_TIMEOUT_S = 180.0  # CUDA init, the allocation, cuBLAS warm-up, the spin calibration
RECORD_SLACK_S = 60.0  # the recorder's start (imports, NVML init) and end beyond --duration
REPLAY_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
MATMUL_N = 8192
SYNC_EVERY = 10  # healthy: one .item() per this many matmuls


# -- the workloads (child processes) ----------------------------------------------------------------------
def _exit_with_parent(max_s: float) -> None:
    """A workload never outlives the benchmark: it exits when its parent goes, or after ``max_s`` at most.
    A helper thread, so the main thread's own state (blocked, spinning) is what the recorder sees."""
    parent, deadline = os.getppid(), time.monotonic() + max_s

    def watch() -> None:
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _ready(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)  # the parent never reads half a file


def run_child(name: str, ready_file: Path, mem_gib: float, max_s: float) -> int:
    """One workload on GPU 0, forever (the parent kills it). Writes ``ready_file`` once it is in its loop."""
    _exit_with_parent(max_s)
    import torch

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    held = torch.zeros(int(mem_gib * GIB), dtype=torch.uint8, device=dev)  # touched, so really resident
    torch.cuda.synchronize()
    info: dict[str, Any] = {"pid": os.getpid(), "held_bytes": held.numel(), "gpu": torch.cuda.get_device_name(0)}
    if name == "spin":
        # Cycles for ~1 s: time a probe kernel (the SM clock under this load is what counts).
        probe = 200_000_000
        torch.cuda._sleep(probe)  # first launch loads the kernel
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        cycles = int(min(max(probe / (start.elapsed_time(end) / 1000.0), 1e8), 1e10))
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        _ready(ready_file, {**info, "cycles_per_kernel": cycles})
        while True:
            torch.cuda._sleep(cycles)
            torch.cuda.synchronize()  # the host busy-waits here (CUDA's default spin wait)
    elif name == "host_stall":
        _ready(ready_file, info)
        threading.Event().wait()  # blocked for good, memory held
    elif name == "healthy":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        a = torch.randn(MATMUL_N, MATMUL_N, device=dev, dtype=dtype)
        b = torch.randn(MATMUL_N, MATMUL_N, device=dev, dtype=dtype)
        c = torch.empty(MATMUL_N, MATMUL_N, device=dev, dtype=dtype)
        for _ in range(3):  # cuBLAS picks its kernel on the first calls
            torch.matmul(a, b, out=c)
        c[0, 0].item()
        _ready(ready_file, {**info, "dtype": str(dtype)})
        i = 0
        while True:
            torch.matmul(a, b, out=c)
            i += 1
            if i % SYNC_EVERY == 0:
                c[0, 0].item()
    raise SystemExit(f"unknown workload {name!r}")


def workload_command(name: str, ready_file: Path, mem_gib: float, max_s: float) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", name, "--ready-file", str(ready_file),
            "--mem-gib", repr(mem_gib), "--max-s", repr(max_s)]


def workload_env(job_id: str) -> dict[str, str]:
    """Rank 0 of job ``job_id``, as the recorder reads identities (GPU_WATCHDOG_JOB_ID wins over Slurm's)."""
    return dict(os.environ, GPU_WATCHDOG_JOB_ID=job_id, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                PYTHONUNBUFFERED="1")


def gpu_watchdog_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpu_watchdog", *args]


# -- the benchmark (parent) -------------------------------------------------------------------------------
def gpu_missing() -> str | None:
    """Why this machine cannot run the benchmark, or None when torch sees a CUDA GPU and NVML starts."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no device visible"
        return f"torch.cuda.is_available() is false (torch {torch.__version__}, {build})"
    from gpu_watchdog.errors import BackendUnavailable
    from gpu_watchdog.sample.nvml import NvmlReader

    try:
        reader = NvmlReader()
        count = reader.start()
    except ImportError as e:
        return f"nvidia-ml-py is not importable ({e})"
    except BackendUnavailable as e:
        return str(e)
    reader.shutdown()
    return None if count else "NVML sees no GPU"


class Children:
    """Every process the benchmark starts, each in its own session, so each can be stopped with what it
    started (and Ctrl-C reaches only the benchmark, which then stops them)."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with log.open("wb") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
        self._procs.append(p)
        return p

    @staticmethod
    def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(p.pid, sig)  # its session's group: the pid is ours until it is reaped
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            self._signal(p, signal.SIGTERM)
            try:
                p.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.wait()

    def stop_all(self) -> None:
        for p in reversed(self._procs):
            self.stop(p)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        if proc.poll() is not None:
            return None
        time.sleep(0.2)
    return None


def replay(trace: Path, config: Path) -> list[dict[str, Any]]:
    """``gpu-watchdog replay TRACE --json --config C``: the findings as JSON objects."""
    cp = subprocess.run(gpu_watchdog_cli("replay", str(trace), "--json", "--config", str(config)),
                        capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S, stdin=subprocess.DEVNULL)
    if cp.returncode != 0:
        last = (cp.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"replay exited with {cp.returncode}: {last}")
    return list(json.loads(cp.stdout))


def _pair_total(*values: int | None) -> int | None:
    return sum(v for v in values if v is not None) if all(v is not None for v in values) else None


def _traffic_total(d: DeviceSample) -> int | None:
    """PCIe + NVLink bytes as the detector adds them: the counters the GPU reports."""
    known = [v for v in (d.pcie_tx_bytes_total, d.pcie_rx_bytes_total, d.nvlink_tx_bytes_total,
                         d.nvlink_rx_bytes_total) if v is not None]
    return sum(known) if known else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_trace(path: str | Path, job_id: str, cfg: DetectConfig) -> dict[str, Any]:
    """NVML's and psutil's view of the job's rank 0 over a trace, averaged over the ticks that saw it.

    Keys: ``samples`` (ticks in the trace), ``ticks_on_gpu`` (ticks where a GPU lists the rank's pid), ``pid``,
    ``gpu`` (name), ``uuid``, ``util_percent``, ``power_w``, ``power_limit_w``, ``pcie_bytes_per_s``,
    ``nvlink_bytes_per_s`` (from the cumulative counters; None when the GPU does not report them),
    ``proc_mem_bytes`` (the rank's memory as NVML lists it; None when NVML says "not available"),
    ``device_mem_bytes``, ``cpu_cores`` (the rank tree's cpu_time_s deltas over time), ``signatures``
    (detector.device_signature per tick: {signature: ticks}), ``other_pids`` (other processes on that GPU),
    ``unsupported`` (metrics NVML could not read there), ``t0`` (the first tick) and ``seconds``.
    """
    _head, records = read_trace(path)
    samples = [r for r in records if isinstance(r, NodeSample)]
    out: dict[str, Any] = {"samples": len(samples), "ticks_on_gpu": 0, "pid": None, "gpu": None, "uuid": None,
                           "t0": samples[0].t if samples else None,
                           "seconds": samples[-1].t - samples[0].t if samples else 0.0}
    util, power, limit, proc_mem, dev_mem = [], [], [], [], []
    pcie = [0, 0.0]  # bytes, seconds
    nvlink = [0, 0.0]
    cpu = [0.0, 0.0]  # cpu seconds, seconds
    sigs: Counter[str] = Counter()
    others: set[int] = set()
    unsupported: set[str] = set()
    prev_rank: ProcessSample | None = None
    prev_dev: DeviceSample | None = None
    prev_t = 0.0
    for s in samples:
        rank = next((p for p in s.processes if p.is_rank and p.job is not None and p.job.job_id == job_id
                     and p.job.rank == 0), None)
        if rank is None:
            prev_rank = prev_dev = None
            continue
        out["pid"] = rank.pid
        if prev_rank is not None and (prev_rank.pid, prev_rank.create_time) == (rank.pid, rank.create_time) \
                and s.t > prev_t:
            cpu[0] += rank.cpu_time_s - prev_rank.cpu_time_s
            cpu[1] += s.t - prev_t
        dev = next((d for d in sorted(s.devices, key=lambda d: d.index) if rank.pid in d.pids), None)
        if dev is not None:
            out["ticks_on_gpu"] += 1
            out["gpu"], out["uuid"] = dev.name, dev.uuid
            others |= dev.pids - {rank.pid}
            unsupported |= set(dev.unsupported)
            if dev.util_percent is not None:
                util.append(dev.util_percent)
            if dev.power_w is not None:
                power.append(dev.power_w)
            if dev.power_limit_w is not None:
                limit.append(dev.power_limit_w)
            if dev.mem_used_bytes is not None:
                dev_mem.append(float(dev.mem_used_bytes))
            mine = [g.used_memory_bytes for g in dev.processes if g.pid == rank.pid]
            if mine and mine[0] is not None:
                proc_mem.append(float(mine[0]))
            traffic_bps = None
            if prev_dev is not None and prev_dev.uuid == dev.uuid and s.t > prev_t:
                dt = s.t - prev_t
                for acc, now, before in (
                        (pcie, _pair_total(dev.pcie_tx_bytes_total, dev.pcie_rx_bytes_total),
                         _pair_total(prev_dev.pcie_tx_bytes_total, prev_dev.pcie_rx_bytes_total)),
                        (nvlink, _pair_total(dev.nvlink_tx_bytes_total, dev.nvlink_rx_bytes_total),
                         _pair_total(prev_dev.nvlink_tx_bytes_total, prev_dev.nvlink_rx_bytes_total))):
                    if now is not None and before is not None and now >= before:  # a reset is skipped
                        acc[0] += now - before
                        acc[1] += dt
                total, old = _traffic_total(dev), _traffic_total(prev_dev)
                if total is not None and old is not None and total >= old:
                    traffic_bps = (total - old) / dt
            sig = device_signature(dev, cfg, traffic_bps, frozenset({rank.pid}))
            sigs[sig or "unknown"] += 1
        prev_rank, prev_dev, prev_t = rank, dev, s.t
    out.update(
        util_percent=_mean(util), power_w=_mean(power), power_limit_w=_mean(limit),
        pcie_bytes_per_s=pcie[0] / pcie[1] if pcie[1] else None,
        nvlink_bytes_per_s=nvlink[0] / nvlink[1] if nvlink[1] else None,
        proc_mem_bytes=_mean(proc_mem), device_mem_bytes=_mean(dev_mem),
        cpu_cores=cpu[0] / cpu[1] if cpu[1] else None,
        signatures=dict(sigs.most_common()), other_pids=sorted(others), unsupported=sorted(unsupported),
    )
    return out


def judge(expected: tuple[str, str] | None, findings: list[dict[str, Any]],
          summary: dict[str, Any]) -> tuple[bool, str]:
    """(matches, why not). The one expected (kind, signature) and nothing else, or no finding at all; and the
    recording must have seen the workload on a GPU, else a "no finding" proves nothing."""
    if summary["ticks_on_gpu"] == 0:
        why = ("the workload's process is not in the trace" if summary["pid"] is None else
               f"no GPU lists pid {summary['pid']} (NVML reports another PID namespace, e.g. in a container?)")
        return False, why
    got = sorted({(f["kind"], f["signature"]) for f in findings})
    want = [expected] if expected is not None else []
    if got == want:
        return True, ""
    return False, f"expected {_verdict_text(want)}, replay gave {_verdict_text(got)}"


def _verdict_text(pairs: list[tuple[str, str]]) -> str:
    return ", ".join(f"{k} {s}" for k, s in pairs) or "none"


def write_detect_config(path: Path, confirm_after_s: float) -> None:
    path.write_text("# benchmarks/gpu_signatures.py: these traces carry no stack dumps, so a stall is confirmed\n"
                    "# by time alone, after confirm_after_s.\n"
                    f"[detect]\nconfirm_after_s = {float(confirm_after_s)!r}\n")


def run_one(name: str, base: Path, args: argparse.Namespace, children: Children, config: Path,
            cfg: DetectConfig) -> dict[str, Any]:
    job_id = f"gpusig-{name}-{os.getpid()}"
    ready, trace, log = base / f"{name}.ready", base / f"{name}.trace", base / f"{name}.workload.log"
    res: dict[str, Any] = {"workload": name, "job_id": job_id, "expected": EXPECTED[name], "trace": str(trace),
                           "error": None, "notes": [], "info": None, "findings": None, "summary": None, "ok": False}
    ready.unlink(missing_ok=True)
    max_s = READY_TIMEOUT_S + args.warmup + args.duration + RECORD_SLACK_S + 60.0
    print(f"{name}: starting on GPU 0 ({WHAT[name]}), job {job_id}", flush=True)
    work = children.start(workload_command(name, ready, args.mem_gib, max_s), log, workload_env(job_id))
    try:
        info = _wait_ready(work, ready, READY_TIMEOUT_S)
        if info is None:
            state = (f"exited with code {work.returncode}" if work.poll() is not None
                     else f"not ready after {READY_TIMEOUT_S:.0f} s")
            res["error"] = f"the workload {state}: {_tail(log)}"
            return res
        res["info"] = info
        time.sleep(args.warmup)
        if work.poll() is not None:
            res["error"] = f"the workload exited with code {work.returncode} during the warm-up: {_tail(log)}"
            return res
        print(f"{name}: pid {work.pid} ready; recording {args.duration:g} s", flush=True)
        rec_log = base / f"{name}.record.log"
        rec = children.start(gpu_watchdog_cli("record", "--backend", "nvml", "--duration", repr(args.duration),
                                              "--output", str(trace), "--job", job_id), rec_log)
        try:
            rc = rec.wait(args.duration + RECORD_SLACK_S)
        except subprocess.TimeoutExpired:
            children.stop(rec)
            res["error"] = f"gpu-watchdog record did not finish within {args.duration + RECORD_SLACK_S:.0f} s"
            return res
        if rc != 0 or not trace.exists():
            res["error"] = f"gpu-watchdog record exited with {rc}: {_tail(rec_log)}"
            return res
        if work.poll() is not None:
            res["notes"].append(f"the workload exited with code {work.returncode} during the recording")
    finally:
        children.stop(work)  # frees GPU 0 for the next workload
    try:
        res["findings"] = replay(trace, config)
        res["summary"] = summarize_trace(trace, job_id, cfg)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, OSError) as e:
        res["error"] = f"replay: {e}"
        return res
    except WatchdogError as e:  # a TraceError from read_trace: one line naming the line and field
        res["error"] = str(e)
        return res
    res["ok"], why = judge(EXPECTED[name], res["findings"], res["summary"])
    if why:
        res["notes"].append(why)
    return res


# -- output -----------------------------------------------------------------------------------------------
def _num(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v / scale, fmt)


def _verdict(findings: list[dict[str, Any]] | None) -> str:
    if findings is None:
        return "error"
    return _verdict_text(sorted({(f["kind"], f["signature"]) for f in findings}))


COLUMNS = (("workload", 10), ("ticks", 5), ("util %", 6), ("power W (of limit)", 19), ("PCIe MiB/s", 10),
           ("NVLink MiB/s", 12), ("proc GiB", 8), ("CPU cores", 9), ("device sig", 15), ("verdict", 16),
           ("expected", 16), ("match", 5))


def table_rows(results: list[dict[str, Any]]) -> list[str]:
    lines = ["  ".join(f"{h:<{w}}" for h, w in COLUMNS)]
    for r in results:
        s = r["summary"] or {}
        power, limit = s.get("power_w"), s.get("power_limit_w")
        pw = _num(power, ".0f")
        if power is not None and limit:
            pw += f"/{limit:.0f} ({100.0 * power / limit:.0f}%)"
        sigs = s.get("signatures") or {}
        top = next(iter(sigs), None)
        sig = f"{top} {sigs[top]}/{s['ticks_on_gpu']}" if top else "-"
        cells = (r["workload"], str(s.get("samples", "-")), _num(s.get("util_percent"), ".1f"), pw,
                 _num(s.get("pcie_bytes_per_s"), ".2f", MIB), _num(s.get("nvlink_bytes_per_s"), ".2f", MIB),
                 _num(s.get("proc_mem_bytes"), ".2f", GIB), _num(s.get("cpu_cores"), ".2f"), sig,
                 _verdict(r["findings"]), _verdict_text([r["expected"]] if r["expected"] else []),
                 "yes" if r["ok"] else "NO")
        lines.append("  ".join(f"{c:<{w}}" for c, (_h, w) in zip(cells, COLUMNS, strict=True)).rstrip())
    return lines


def notes(r: dict[str, Any]) -> list[str]:
    out = []
    if r["error"]:
        out.append(f"error: {r['error']}")
    out.extend(r["notes"])
    s = r["summary"] or {}
    for f in r["findings"] or []:
        t0 = s.get("t0") or f["onset"]
        out.append(f"{f['kind']} {f['signature']}: onset +{f['onset'] - t0:.1f} s into the recording, confirmed "
                   f"{f['confirmed_at'] - f['onset']:.1f} s later by {f['evidence']} ({f['detail']})")
    if s.get("other_pids"):
        out.append(f"GPU shared with pid(s) {', '.join(map(str, s['other_pids']))}: its counters are theirs too")
    if s.get("unsupported"):
        out.append(f"NVML cannot read here: {', '.join(s['unsupported'])}")
    if s.get("device_mem_bytes") is not None and s.get("proc_mem_bytes") is None and s.get("ticks_on_gpu"):
        out.append(f"per-process memory not available from NVML; the GPU's total in use: "
                   f"{s['device_mem_bytes'] / GIB:.2f} GiB")
    if len(s.get("signatures") or {}) > 1:
        out.append("device signature per tick: " + ", ".join(f"{k} {v}" for k, v in s["signatures"].items()))
    if r["info"] and "cycles_per_kernel" in r["info"]:
        out.append(f"spin kernel: torch.cuda._sleep({r['info']['cycles_per_kernel']}) ≈ 1 s")
    return out


# -- main -------------------------------------------------------------------------------------------------
def _seconds(minimum: float, strict: bool) -> Any:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (v > minimum if strict else v >= minimum) or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}, got {text!r}")
        return v
    return parse


_positive = _seconds(0.0, strict=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=_positive, default=30.0, metavar="S", help="recording per workload (30)")
    ap.add_argument("--warmup", type=_seconds(0.0, strict=False), default=5.0, metavar="S",
                    help="seconds between a workload being ready and its recording (5)")
    ap.add_argument("--confirm-after", type=_positive, default=8.0, metavar="S",
                    help="[detect] confirm_after_s for the replay (8; the default config's is 30)")
    ap.add_argument("--mem-gib", type=_positive, default=2.0, metavar="G", help="GPU memory each workload holds (2)")
    ap.add_argument("--out-dir", metavar="DIR", help="keep traces, logs and summary.json here (default: temp, removed)")
    ap.add_argument("--only", choices=WORKLOADS, metavar="NAME", help=f"one workload: {', '.join(WORKLOADS)}")
    ap.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)  # internal: run one workload
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--max-s", type=_positive, default=3600.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child and not args.ready_file:
        ap.error("--child needs --ready-file")
    return args


def _raise_on_signal(signum: int, _frame: Any) -> None:
    print(f"gpu_signatures: stopped by {signal.Signals(signum).name}; stopping the workloads", file=sys.stderr)
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the children


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, Path(args.ready_file), args.mem_gib, args.max_s)
    missing = gpu_missing()
    if missing:
        print(f"gpu_signatures: needs a CUDA GPU with NVML; none here: {missing}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    names = [args.only] if args.only else list(WORKLOADS)
    if args.duration < args.confirm_after + 3.0:
        print(f"gpu_signatures: warning: --duration {args.duration:g} s leaves too little time to confirm a stall "
              f"(confirm_after_s {args.confirm_after:g} s, plus 2 s to suspect)", flush=True)
    base = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="gpu-signatures-"))
    base.mkdir(parents=True, exist_ok=True)
    config = base / "detect.toml"
    write_detect_config(config, args.confirm_after)
    cfg = DetectConfig(confirm_after_s=args.confirm_after)
    print(f"gpu_signatures: {', '.join(names)} on GPU 0, {args.duration:g} s each after {args.warmup:g} s warm-up, "
          f"replayed with confirm_after_s = {args.confirm_after:g}; work dir {base}", flush=True)
    children = Children()
    handlers = {sig: signal.signal(sig, _raise_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    results = []
    try:
        for name in names:
            results.append(run_one(name, base, args, children, config, cfg))
    except KeyboardInterrupt:
        print("gpu_signatures: interrupted; workloads stopped", file=sys.stderr)
        return 130
    finally:
        children.stop_all()
        for sig, old in handlers.items():
            signal.signal(sig, old)
        if not args.out_dir:
            shutil.rmtree(base, ignore_errors=True)
    gpu = next((r["summary"]["gpu"] for r in results if r["summary"] and r["summary"]["gpu"]), None)
    print(f"\nGPU 0: {gpu or 'unknown'}; NVML's view averaged over each recording (trace), verdict from replay")
    for line in table_rows(results):
        print("  " + line)
    for r in results:
        for line in notes(r):
            print(f"  {r['workload']}: {line}")
    if args.out_dir:
        (base / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"  traces, logs and summary.json kept in {base}")
    ok = all(r["ok"] for r in results)
    print(f"  {'all workloads match' if ok else 'MISMATCH'}: "
          f"{sum(r['ok'] for r in results)}/{len(results)} as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
