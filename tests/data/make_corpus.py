"""Regenerate the detector corpus in tests/data/: traces, their labels (corpus.json) and the latency table.

Two kinds of traces:

* **recorded** (``proc-*``): a real 4-rank gloo job (``tests/jobs/train.py`` under ``torchrun --standalone``)
  sampled by ``gpu_watchdog.sample.record.record`` with the proc backend, scoped to the torchrun process tree (other
  jobs on the machine are not recorded). The job's own ``--events`` file gives the truth: its
  ``hang_onset`` event becomes an ``event`` record in the trace (name ``hang_onset`` for a hang,
  ``pause_start``/``pause_end`` for a legitimate pause) and the label's ``true_onset``.
* **hand-made** (``nvml-*``): 8 GPUs × 8 ranks, 1 s interval, 60 s (90-120 s for long pauses), written from
  code below — the GPU signatures a CPU machine cannot produce (0 % util with memory held, the NCCL spin, a lost
  GPU, ...).

What a blocked NCCL rank's host does (and why the ``*-busy`` traces exist): NCCL collectives are asynchronous.
The rank's Python thread returns from ``all_reduce`` at once and blocks later, in a device sync
(``cudaStreamSynchronize``/``cudaEventSynchronize`` behind ``.item()``, ``.cpu()``, ``synchronize()``). CUDA's
default scheduling (``cudaDeviceScheduleAuto``) *spins* on the CPU in that sync when the process has fewer
contexts than the machine has cores — the usual case — so the process burns about one core while its GPU spins
in the collective kernel at ~100 % utilization and idle power; NCCL's proxy and watchdog threads add a little.
Its main thread never blocks in the kernel, so it shows no voluntary context switches (``wakeups``) either. A
gloo rank is the opposite (it sleeps in a futex), which is what the ``proc-*`` traces record. A healthy slow
input pipeline looks like a third thing: GPUs starved (idle, memory held), main threads waiting on a queue and
dataloader workers burning several cores.

Traces named ``*-stacks`` carry the stack dumps the live agent would have taken: the generator runs the detector
tick by tick and, whenever it asks for stacks (``JobStatus.needs_stacks``), writes a ``stacks`` record stamped
with that tick (what ``collect_stack_evidence`` does live), so ``replay`` reaches the live agent's verdict. A
dump wakes each dumped thread twice (py-spy's attach): the records and the wakeup counters include that.

Traces are plain JSONL (``read_trace`` reads no gzip). To stay small, fields equal to their default are left
out (the format allows it: docs/trace-format.md), command lines and sampling errors are dropped, and a
recorded trace starts one sample before the job's ranks appear; hand-made traces carry only the fields the
detector reads (no temperature or clocks, TX traffic counters only).

Usage (from the repository root)::

    .venv/bin/python tests/data/make_corpus.py                 # everything; the recorded runs take ~4 min
    .venv/bin/python tests/data/make_corpus.py --synthetic     # only the hand-made traces (instant)
    .venv/bin/python tests/data/make_corpus.py --only proc-hang nvml-spin
    .venv/bin/python tests/data/make_corpus.py --latency-table # print the table for docs/detection-latency.md

The recorded traces differ from run to run (pids, timings); the labels are re-derived from each run, and
``tests/test_corpus.py`` checks the detector against whatever the current files say.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpu_watchdog.config.schema import DetectConfig
from gpu_watchdog.detect.detector import DetectorState, step
from gpu_watchdog.detect.replay import replay_trace
from gpu_watchdog.model import (
    DeviceSample,
    GpuFault,
    GpuProcess,
    JobIdentity,
    NodeSample,
    ProcessSample,
    RankStack,
    StackEvidence,
)
from gpu_watchdog.sample.backends import ProcBackend
from gpu_watchdog.sample.processes import ProcessScanner
from gpu_watchdog.sample.record import record
from gpu_watchdog.sample.trace import header, read_trace

DATA = Path(__file__).resolve().parent
ROOT = DATA.parents[1]
TRAIN = ROOT / "tests" / "jobs" / "train.py"
MANIFEST = DATA / "corpus.json"
TORCHRUN = Path(sys.executable).with_name("torchrun")
HOST = "corpus-node"
GIB = 1 << 30
# The configuration the live end-to-end test uses; the corpus is checked with it and with the defaults.
TEST_CONFIG = {"confirm_after_s": 8.0}


def detect_config_for_tests() -> DetectConfig:
    return dataclasses.replace(DetectConfig(), **TEST_CONFIG)


# -- writing compact traces ---------------------------------------------------------------------------
def compact(obj: Any) -> Any:
    """A dataclass as a JSON object without the fields that equal their defaults."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue
            if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
                continue
            out[f.name] = compact(value)
        return out
    if isinstance(obj, (tuple, list)):
        return [compact(x) for x in obj]
    return obj


def write_trace(path: Path, backend: str, interval_s: float, records: list[NodeSample] | list[NodeSample |
                StackEvidence], events: list[dict[str, Any]]) -> None:
    """Header, then samples (and stack dumps, after the sample that asked for them) with the events merged in
    time order (an event goes before the first later sample)."""
    samples = [r for r in records if isinstance(r, NodeSample)]
    lines = [json.dumps(header(backend, HOST, interval_s, samples[0].t), separators=(",", ":"))]
    pending = sorted(events, key=lambda e: e["t"])
    for rec in records:
        if isinstance(rec, StackEvidence):
            lines.append(json.dumps({"type": "stacks", **compact(rec)}, separators=(",", ":")))
            continue
        while pending and pending[0]["t"] <= rec.t:
            lines.append(json.dumps({"type": "event", **pending.pop(0)}, separators=(",", ":")))
        lines.append(json.dumps({"type": "sample", **compact(rec)}, separators=(",", ":")))
    lines += [json.dumps({"type": "event", **e}, separators=(",", ":")) for e in pending]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


# -- recorded runs ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class RealRun:
    name: str
    description: str
    job_args: list[str]
    duration_s: float
    expected: list[dict[str, Any]]
    onset_event: str  # the job's event that marks the true onset (hang) or pause start
    trace_event: str  # its name in the trace


REAL_RUNS = [
    RealRun("proc-healthy", "4-rank gloo job training normally (0.3 s compute + all_reduce per step)",
            ["--scenario", "healthy", "--steps", "400"], 22.0, [], "", ""),
    RealRun("proc-hang", "rank 1 stops joining all_reduce at step 8 (sleeps); ranks 0, 2, 3 block in all_reduce",
            ["--scenario", "hang", "--rank-at", "1", "--step-at", "8", "--steps", "400"], 52.0,
            [{"kind": "stall", "signature": "idle_held"}], "hang_onset", "hang_onset"),
    RealRun("proc-save", "rank 0 writes a checkpoint for 45 s at step 8 while ranks 1-3 wait in barrier(), "
            "then training resumes", ["--scenario", "save", "--step-at", "8", "--pause-s", "45", "--steps", "30"],
            62.0, [], "hang_onset", "pause_start"),
    RealRun("proc-eval", "rank 0 runs a 30 s evaluation at step 8 while ranks 1-3 wait in barrier(), "
            "then training resumes", ["--scenario", "eval", "--step-at", "8", "--pause-s", "30", "--steps", "30"],
            46.0, [], "hang_onset", "pause_start"),
]


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # stragglers of the group, even after torchrun itself exited
    except ProcessLookupError:
        pass
    p.wait()


def record_real(run: RealRun) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="corpus-") as tmp:
        events_file = Path(tmp, "events.jsonl")
        env = {**os.environ, "GPU_WATCHDOG_JOB_ID": f"corpus-{run.name}", "OMP_NUM_THREADS": "1"}
        log = Path(tmp, "job.log").open("wb")
        job = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "4", str(TRAIN), *run.job_args,
                                "--events", str(events_file), "--workdir", tmp],
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        raw = Path(tmp, "raw.trace")
        try:
            backend = ProcBackend(ProcessScanner(root_pid=job.pid), HOST)
            record(backend, raw, run.duration_s, 1.0)
        finally:
            _kill_group(job)
            log.close()
        events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
        head, records = read_trace(raw)
        samples = [dataclasses.replace(r, errors=(), processes=tuple(dataclasses.replace(p, cmdline=())
                                                                     for p in r.processes))
                   for r in records if isinstance(r, NodeSample)]
    first = next(i for i, s in enumerate(samples) if s.devices)
    samples = samples[max(0, first - 1):]
    trace_events, true_onset = [], None
    onset_ev = [e for e in events if e.get("event") == run.onset_event] if run.onset_event else []
    if onset_ev:
        e = onset_ev[0]
        true_onset = e["t"]
        trace_events.append({"t": e["t"], "name": run.trace_event, "rank": e["rank"], "step": e["step"]})
        end = [x for x in events if x.get("event") == "pause_end"]
        if end:
            trace_events.append({"t": end[0]["t"], "name": "pause_end", "rank": end[0]["rank"]})
    elif run.onset_event:
        raise SystemExit(f"{run.name}: the job logged no {run.onset_event} event (see its log)")
    path = DATA / f"{run.name}.trace"
    write_trace(path, "proc", head["interval_s"], samples, trace_events)
    return {"name": run.name, "file": path.name, "source": "recorded", "backend": "proc",
            "description": run.description, "job": f"corpus-{run.name}", "interval_s": head["interval_s"],
            "expected": run.expected, "true_onset": true_onset if run.expected else None,
            "pause_start": true_onset if not run.expected and onset_ev else None}


# -- hand-made NVML traces ----------------------------------------------------------------------------------
class Gpus:
    """8 H100s and one 8-rank job; ``tick`` advances every counter by what each GPU/rank does this second."""

    N = 8
    T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
    JOB = "corpus-nvml"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.t = self.T0
        self.cpu = [50.0 + r for r in range(self.N)]
        self.io = [1 << 30] * self.N
        self.nvlink = [1 << 40] * self.N
        self.pcie = [1 << 36] * self.N
        self.alive = set(range(self.N))
        self.wakeups = [1000] * self.N  # main threads' voluntary context switches
        self.samples: list[NodeSample] = []
        self.records: list[NodeSample | StackEvidence] = []  # samples and stack dumps, in order

    def pid(self, r: int) -> int:
        return 48_100 + r

    def tick(self, mode: Callable[[int], str], faults: dict[int, GpuFault] | None = None) -> None:
        """``mode(rank)``: train | idle (0 % util, memory held) | spin (NCCL spin) | eval | save | gone, and
        spin_busy (the spin with the host busy-waiting in a device sync: ~1 core, no wakeups) | comm (a
        communication-bound phase: 100 % util at ~25 % power, heavy NVLink traffic) | starved (a slow input
        pipeline: GPU idle with memory held, main thread waiting on a queue, dataloader workers burning cores)."""
        rnd = self.rng.uniform
        devices, procs = [], []
        for r in range(self.N):
            m = mode(r) if r in self.alive else "gone"
            if m == "gone":
                self.alive.discard(r)
            util, power = {"train": (rnd(93, 99), rnd(540, 660)), "idle": (0.0, rnd(68, 80)),
                           "spin": (100.0, rnd(88, 110)), "spin_busy": (100.0, rnd(88, 110)),
                           "comm": (100.0, rnd(160, 190)), "starved": (rnd(0, 4), rnd(70, 85)),
                           "eval": (rnd(85, 95), rnd(380, 450)),
                           "save": (rnd(0, 3), rnd(75, 90)), "gone": (0.0, rnd(60, 66))}[m]
            cores = {"train": rnd(0.9, 1.2), "eval": rnd(0.9, 1.1), "save": rnd(1.0, 1.3),
                     "spin_busy": rnd(1.0, 1.15), "comm": rnd(1.0, 1.1), "starved": rnd(2.0, 4.0)}.get(
                m, rnd(0.0, 0.04))
            self.cpu[r] += cores
            self.io[r] += int(rnd(8e8, 1.2e9)) if m == "save" else int(rnd(2e6, 4e6)) if m == "starved" else \
                int(rnd(0, 2e4))
            # A healthy loop blocks and wakes all the time; a thread spinning or blocked for good does not.
            self.wakeups[r] += {"train": 60, "eval": 40, "comm": 30, "save": 20, "starved": 8}.get(m, 0)
            if m in ("train", "comm"):
                self.nvlink[r] += int(rnd(1.8e10, 2.2e10))
                self.pcie[r] += int(rnd(2e8, 4e8))
            elif m != "gone":
                self.pcie[r] += int(rnd(0, 4e3))  # telemetry chatter, far below the traffic threshold
            mem = int(0.5 * GIB) if m == "gone" else int(61.5 * GIB + r * 0.1 * GIB)
            fault = (faults or {}).get(r)
            if fault is not None:
                devices.append(DeviceSample(r, f"GPU-c0ffee{r:02d}-0000-4000-8000-00000000000{r}",
                                            "NVIDIA H100 80GB HBM3", fault=fault))
            else:
                devices.append(DeviceSample(
                    r, f"GPU-c0ffee{r:02d}-0000-4000-8000-00000000000{r}", "NVIDIA H100 80GB HBM3",
                    util_percent=round(util, 1), mem_used_bytes=mem, mem_total_bytes=80 * GIB,
                    power_w=round(power, 1), power_limit_w=700.0,
                    # Only what the detector reads: TX counters stand for both directions (size budget).
                    pcie_tx_bytes_total=self.pcie[r], nvlink_tx_bytes_total=self.nvlink[r],
                    processes=() if m == "gone" else (GpuProcess(self.pid(r), mem - int(0.5 * GIB)),)))
            if m != "gone":
                procs.append(ProcessSample(
                    pid=self.pid(r), create_time=self.T0 - 3600.0, ppid=48_000, status="sleeping",
                    cpu_time_s=round(self.cpu[r], 3), io_bytes=self.io[r], rss_bytes=int(7.5 * GIB),
                    job=JobIdentity(self.JOB, r, r, self.N), is_rank=True, wakeups=self.wakeups[r]))
        sample = NodeSample(t=self.t, hostname=HOST, backend="nvml", devices=tuple(devices), processes=tuple(procs))
        self.samples.append(sample)
        self.records.append(sample)
        self.t += 1.0

    def dump(self, t: float, stack: Callable[[int], RankStack | None]) -> None:
        """The live agent's dump of every live rank, stamped with the tick ``t`` that asked for it."""
        ranks = []
        for r in sorted(self.alive):
            rs = stack(r)
            if rs is None:
                continue
            before = self.wakeups[r]
            self.wakeups[r] += 2  # py-spy's attach wakes the thread
            ranks.append(dataclasses.replace(rs, rank=r, pid=self.pid(r), wakeups_before=before,
                                             wakeups_after=self.wakeups[r]))
        self.records.append(StackEvidence(self.JOB, t, tuple(ranks)))


def _synthetic(name: str, description: str, build: Callable[[Gpus], list[dict[str, Any]]],
               expected: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    g = Gpus(seed)
    events = build(g)
    path = DATA / f"{name}.trace"
    write_trace(path, "nvml", 1.0, g.records, events)
    onset = next((e["t"] for e in events if e["name"] in ("hang_onset", "gpu_lost", "rank_died")), None)
    pause = next((e["t"] for e in events if e["name"] == "pause_start"), None)
    return {"name": name, "file": path.name, "source": "hand-made", "backend": "nvml", "description": description,
            "job": Gpus.JOB, "interval_s": 1.0, "expected": expected, "true_onset": onset, "pause_start": pause}


def _phases(g: Gpus, *phases: tuple[int, Callable[[int], str]], faults_from: int | None = None,
            faults: dict[int, GpuFault] | None = None) -> None:
    k = 0
    for n, mode in phases:
        for _ in range(n):
            g.tick(mode, faults if faults_from is not None and k >= faults_from else None)
            k += 1


StackOf = Callable[[int], "RankStack | None"]


def _live(g: Gpus, *phases: tuple[int, Callable[[int], str], StackOf]) -> None:
    """Phases of (ticks, mode, stack of a rank) with the live agent's stack dumps: after each tick the detector
    (default config) runs, and when it asks for stacks the dump is recorded, to be fed in with the next tick."""
    state, pending, cfg = DetectorState(), [], DetectConfig()
    for n, mode, stack in phases:
        for _ in range(n):
            g.tick(mode)
            state, _ = step(state, g.samples[-1], cfg, pending)
            job = state.jobs.get(g.JOB)
            pending = []
            if job is not None and job.needs_stacks:
                g.dump(g.samples[-1].t, stack)
                pending = [g.records[-1]]


def _rs(state: str, where: str, *outer: str, active: bool = False, op: str | None = None) -> RankStack:
    """A rank's classified main thread as gpu_watchdog.evidence.stacks.classify makes it (rank and pid are filled
    in later)."""
    return RankStack(0, 0, state, " <- ".join((where, *outer)), active, op, where)


_MAIN = ("main (train.py:90)", "<module> (train.py:99)")
# A host busy-waiting in .item() behind a spinning NCCL kernel: py-spy (no --native) shows the calling line,
# on CPU; the classifier calls that compute. It never moves.
ITEM_SYNC = _rs("compute", "train_step (train.py:55)", *_MAIN, active=True)
NCCL_BARRIER = _rs("collective", "barrier (torch/distributed/distributed_c10d.py:4811)", *_MAIN, active=True,
                   op="barrier")
SAVING = _rs("io", "_save (torch/serialization.py:1208)", "save (torch/serialization.py:966)",
             "save_checkpoint (train.py:40)", *_MAIN, active=True)
QUEUE_STUCK = _rs("data_wait", "Queue.get (queue.py:171)", "next_batch (train.py:30)", *_MAIN)


def build_idle_held(g: Gpus) -> list[dict[str, Any]]:
    _phases(g, (21, lambda r: "train"), (39, lambda r: "idle"))
    return [{"t": g.T0 + 20.5, "name": "hang_onset", "note": "every rank blocks host-side; GPUs 0 % util"}]


def build_spin(g: Gpus) -> list[dict[str, Any]]:
    _phases(g, (21, lambda r: "train"), (39, lambda r: "spin"))
    return [{"t": g.T0 + 20.5, "name": "hang_onset", "note": "NCCL kernels spin: 100 % util at ~100 W of 700 W"}]


def build_save(g: Gpus) -> list[dict[str, Any]]:
    _phases(g, (16, lambda r: "train"), (35, lambda r: "save" if r == 0 else "spin"), (9, lambda r: "train"))
    return [{"t": g.T0 + 15.5, "name": "pause_start", "rank": 0, "note": "torch.save on rank 0"},
            {"t": g.T0 + 50.5, "name": "pause_end", "rank": 0}]


def build_eval(g: Gpus) -> list[dict[str, Any]]:
    _phases(g, (16, lambda r: "train"), (30, lambda r: "eval" if r == 0 else "idle"), (14, lambda r: "train"))
    return [{"t": g.T0 + 15.5, "name": "pause_start", "rank": 0, "note": "evaluation on GPU 0"},
            {"t": g.T0 + 45.5, "name": "pause_end", "rank": 0}]


def build_rank_died(g: Gpus) -> list[dict[str, Any]]:
    _phases(g, (25, lambda r: "train"), (35, lambda r: "gone" if r == 5 else "idle"))
    return [{"t": g.T0 + 24.5, "name": "rank_died", "rank": 5, "note": "rank 5 segfaults; peers keep memory"}]


def build_gpu_lost(g: Gpus) -> list[dict[str, Any]]:
    lost = {3: GpuFault("gpu_lost", "GPU 3 is lost (fell off the bus?)")}

    def mode(k: int) -> Callable[[int], str]:
        if k < 30:
            return lambda r: "train"
        if k < 32:
            return lambda r: "spin"  # rank 3's GPU is gone; its peers block in the collective
        if k < 33:
            return lambda r: "gone" if r == 3 else "spin"  # rank 3 dies on a CUDA error
        return lambda r: "gone"  # torchrun tears the job down

    for k in range(60):
        g.tick(mode(k), lost if k >= 30 else None)
    return [{"t": g.T0 + 29.5, "name": "gpu_lost", "gpu": 3, "note": "Xid 79: GPU 3 fell off the bus"}]


def build_spin_busy(g: Gpus) -> list[dict[str, Any]]:
    _phases(g, (21, lambda r: "train"), (39, lambda r: "spin_busy"))
    return [{"t": g.T0 + 20.5, "name": "hang_onset", "note": "NCCL spin; every host busy-waits in a device sync"}]


def build_spin_busy_stacks(g: Gpus) -> list[dict[str, Any]]:
    _live(g, (21, lambda r: "train", lambda r: None), (39, lambda r: "spin_busy", lambda r: ITEM_SYNC))
    return [{"t": g.T0 + 20.5, "name": "hang_onset", "note": "NCCL spin; every rank frozen at one .item() sync"}]


def _host_stuck(r: int) -> str:
    return "idle" if r == 3 else "spin_busy"


def build_host_stuck(g: Gpus) -> list[dict[str, Any]]:
    _phases(g, (21, lambda r: "train"), (39, _host_stuck))
    return [{"t": g.T0 + 20.5, "name": "hang_onset", "rank": 3,
             "note": "rank 3 blocks host-side (GPU idle, memory held); ranks 0-2, 4-7 spin and busy-wait"}]


def build_host_stuck_stacks(g: Gpus) -> list[dict[str, Any]]:
    _live(g, (21, lambda r: "train", lambda r: None),
          (39, _host_stuck, lambda r: QUEUE_STUCK if r == 3 else ITEM_SYNC))
    return [{"t": g.T0 + 20.5, "name": "hang_onset", "rank": 3,
             "note": "rank 3 blocks in Queue.get (dead producer); the others spin at one .item() sync"}]


def build_comm_bound(g: Gpus) -> list[dict[str, Any]]:
    _live(g, (20, lambda r: "train", lambda r: None), (30, lambda r: "comm", lambda r: ITEM_SYNC),
          (10, lambda r: "train", lambda r: None))
    return [{"t": g.T0 + 19.5, "name": "pause_start", "note": "all-to-all heavy phase: NVLink saturated"},
            {"t": g.T0 + 49.5, "name": "pause_end"}]


def build_save_90s(g: Gpus) -> list[dict[str, Any]]:
    _live(g, (16, lambda r: "train", lambda r: None),
          (90, lambda r: "save" if r == 0 else "spin_busy", lambda r: SAVING if r == 0 else NCCL_BARRIER),
          (14, lambda r: "train", lambda r: None))
    return [{"t": g.T0 + 15.5, "name": "pause_start", "rank": 0, "note": "torch.save on rank 0; NCCL barrier"},
            {"t": g.T0 + 105.5, "name": "pause_end", "rank": 0}]


def build_slow_input(g: Gpus) -> list[dict[str, Any]]:
    _live(g, (15, lambda r: "train", lambda r: None), (40, lambda r: "starved", lambda r: QUEUE_STUCK),
          (5, lambda r: "train", lambda r: None))
    return [{"t": g.T0 + 14.5, "name": "pause_start", "note": "input pipeline too slow: GPUs starved"},
            {"t": g.T0 + 54.5, "name": "pause_end"}]


SYNTHETIC = [
    ("nvml-idle-held", "8 GPUs: every rank blocks host-side at t+20.5 s; 0 % util with 62 GiB held per GPU",
     build_idle_held, [{"kind": "stall", "signature": "idle_held"}], 1),
    ("nvml-spin", "8 GPUs: NCCL spin from t+20.5 s: 100 % util at ~100 W of 700 W, no NVLink/PCIe traffic",
     build_spin, [{"kind": "stall", "signature": "spin"}], 2),
    ("nvml-save", "8 GPUs: rank 0 saves a checkpoint for 35 s (CPU + 1 GB/s writes) while GPUs 1-7 spin in a "
     "barrier; training resumes", build_save, [], 3),
    ("nvml-eval", "8 GPUs: GPU 0 evaluates for 30 s while GPUs 1-7 sit idle with memory held; training resumes",
     build_eval, [], 4),
    ("nvml-rank-died", "8 GPUs: rank 5's process dies at t+24.5 s; ranks 0-4, 6, 7 sit at 0 % util holding "
     "memory", build_rank_died, [{"kind": "stall", "signature": "rank_exited", "culprit_ranks": [5]}], 5),
    ("nvml-gpu-lost", "8 GPUs: GPU 3 falls off the bus at t+29.5 s; rank 3 dies, torchrun stops the job",
     build_gpu_lost, [{"kind": "gpu_fault", "signature": "gpu_lost", "devices": [
         "GPU-c0ffee03-0000-4000-8000-000000000003"]}], 6),
    ("nvml-spin-busy", "8 GPUs: NCCL spin from t+20.5 s while every host busy-waits in a device sync (~1 core "
     "each, no wakeups); no stack dumps", build_spin_busy, [{"kind": "stall", "signature": "spin"}], 7),
    ("nvml-spin-busy-stacks", "as nvml-spin-busy, with the live agent's stack dumps: every rank frozen on CPU at "
     "one .item() line", build_spin_busy_stacks, [{"kind": "stall", "signature": "spin", "stacks": True}], 8),
    ("nvml-host-stuck", "8 GPUs: rank 3 blocks host-side at t+20.5 s (GPU idle, memory held, no CPU) while the "
     "other 7 spin with busy-waiting hosts; no stack dumps", build_host_stuck,
     [{"kind": "stall", "signature": "spin"}], 9),
    ("nvml-host-stuck-stacks", "as nvml-host-stuck, with the live agent's stack dumps (rank 3 in Queue.get, the "
     "others at one .item() line)", build_host_stuck_stacks,
     [{"kind": "stall", "signature": "spin", "stacks": True}], 10),
    ("nvml-comm-bound", "8 GPUs: a 30 s communication-bound phase (100 % util at ~25 % power, heavy NVLink "
     "traffic); healthy", build_comm_bound, [], 11),
    ("nvml-save-90s", "8 GPUs: rank 0 saves for 90 s (GPU idle, CPU + writes) while GPUs 1-7 spin in an NCCL "
     "barrier with busy-waiting hosts; with the live agent's stack dumps; healthy", build_save_90s, [], 12),
    ("nvml-slow-input", "8 GPUs: a 40 s input-pipeline stall: GPUs starved (idle, memory held), main threads in "
     "Queue.get, dataloader workers burning 2-4 cores per rank; healthy", build_slow_input, [], 13),
]


# -- manifest and latency table ----------------------------------------------------------------------------
def load_manifest() -> dict[str, Any]:
    if MANIFEST.exists():
        return json.loads(MANIFEST.read_text())
    return {"version": 1, "test_config": TEST_CONFIG, "traces": []}


def save_manifest(entries: list[dict[str, Any]]) -> None:
    manifest = load_manifest()
    by_name = {e["name"]: e for e in manifest["traces"]}
    for e in entries:
        by_name[e["name"]] = e
    order = [r.name for r in REAL_RUNS] + [s[0] for s in SYNTHETIC]
    manifest["test_config"] = TEST_CONFIG
    manifest["traces"] = sorted(by_name.values(), key=lambda e: order.index(e["name"]) if e["name"] in order
                                else len(order))
    tmp = MANIFEST.with_name(MANIFEST.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(MANIFEST)


def _expected_text(e: dict[str, Any]) -> str:
    if not e["expected"]:
        return "none"
    return ", ".join(f"{x['kind']} {x['signature']}" + (f" (culprit {x['culprit_ranks']})" if
                                                         x.get("culprit_ranks") else "") for x in e["expected"])


def latency_rows() -> Iterator[str]:
    for e in load_manifest()["traces"]:
        path = DATA / e["file"]
        found = {name: replay_trace(path, cfg) for name, cfg in (("default", DetectConfig()),
                                                                 ("test", detect_config_for_tests()))}
        got = ", ".join(f"{f.kind} {f.signature}" for f in found["default"]) or "none"
        if e["true_onset"] is None or not found["default"]:
            err, lat_d = "–", "–"
        else:
            f = found["default"][0]
            err, lat_d = f"{f.onset - e['true_onset']:+.2f} s", f"{f.confirmed_at - e['true_onset']:.1f} s"
        lat_t = (f"{found['test'][0].confirmed_at - e['true_onset']:.1f} s"
                 if e["true_onset"] is not None and found["test"] else "–")
        yield f"| {e['name']} | {_expected_text(e)} | {got} | {err} | {lat_d} | {lat_t} |"


def latency_table() -> str:
    head = ("| trace | expected | found (default config) | onset error | latency, default config "
            "| latency, test config |\n|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(latency_rows())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--synthetic", action="store_true", help="only the hand-made NVML traces")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these traces")
    ap.add_argument("--latency-table", action="store_true", help="print the latency table and exit")
    args = ap.parse_args()
    if args.latency_table:
        print(latency_table())
        return 0
    names = set(args.only or [])
    entries = []
    for name, desc, build, expected, seed in SYNTHETIC:
        if not names or name in names:
            entries.append(_synthetic(name, desc, build, expected, seed))
            print(f"wrote {name}", file=sys.stderr)
    if not args.synthetic:
        for run in REAL_RUNS:
            if not names or run.name in names:
                t = time.monotonic()
                entries.append(record_real(run))
                print(f"recorded {run.name} in {time.monotonic() - t:.0f} s", file=sys.stderr)
    save_manifest(entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
