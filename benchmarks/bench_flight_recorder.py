"""What does PyTorch's Flight Recorder cost a training step? Prints steps/s side by side, and memory per entry.

    .venv/bin/python benchmarks/bench_flight_recorder.py [--rounds 7] [--seconds 2.5] [--quick]

Real 2-rank gloo DDP jobs (``loss.backward()``: DDP's bucket all-reduces) with the Flight Recorder buffer set
four ways — ``TORCH_FR_BUFFER_SIZE`` unset, ``0`` (off), ``2000`` and ``20000`` — all started up front, one job
(two processes) per setting, each waiting on its stdin. Round after round, every job in turn (the order rotates
each round) trains for ``--seconds`` while the others sleep; steps/s per run, the median over the rounds, and the
ratio to ``0`` (off) are printed. Two models: a small MLP (one bucket: one all_reduce a step) and a bigger one with
1 MiB buckets (many all_reduces a step), so the cost per collective shows against the step.

Then a micro-benchmark: a 1-element all_reduce in a tight loop (the cost per collective, with nothing to hide it
behind), the resident memory of each setting after 25,000 collectives (the 20,000-entry ring full), and the size of
a dump (``_dump_fr_trace()`` pickle) per entry.

Note: torch 2.13 records by default (``TORCH_FR_BUFFER_SIZE`` unset means 2000 entries; FlightRecorder.hpp) —
``0`` is the real "off". ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is not measured here: gloo has no dump pipe (the
variable does nothing on gloo); what it costs an NCCL rank is in docs/evidence.md (read from PyTorch's source).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

SETTINGS = (("unset", None), ("0 (off)", "0"), ("2000", "2000"), ("20000", "20000"))
BASELINE = "0 (off)"
MODELS = {  # name: (widths, batch, bucket_cap_mb)
    "small": ((64, 256, 10), 32, 25.0),
    "big": ((256,) + (512,) * 12 + (10,), 64, 0.5),
}


# -- worker (one rank) ---------------------------------------------------------------------------------------------
def worker(rank: int, port: int, model: str) -> None:
    import pickle

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    world = 1 if model == "solo" else 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pg = dist.distributed_c10d._get_default_group()

    def say(obj: object) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def seq() -> int:
        return int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if model == "solo":  # one rank: no peer to wait for, so the time per call is the issuing thread's own work
        t = torch.zeros(1)

        def at_depth(depth: int, n: int) -> float:  # FR captures the Python stack: a training loop is deep
            if depth > 0:
                return at_depth(depth - 1, n)
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t)
            return (time.perf_counter() - t0) / n * 1e6

        at_depth(0, 2000)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] != "time":
                break
            n = int(cmd[1])
            say({"shallow": at_depth(0, n), "deep": at_depth(40, n)})
        dist.destroy_process_group()
        return

    if model == "micro":
        t = torch.zeros(1)
        for _ in range(200):
            dist.all_reduce(t)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "time":
                n = int(cmd[1])
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(n):
                    dist.all_reduce(t)
                say({"us_per_op": (time.perf_counter() - t0) / n * 1e6,
                     "cpu_us_per_op": (time.process_time() - c0) / n * 1e6})
            elif cmd[0] == "fill":
                for _ in range(int(cmd[1])):
                    dist.all_reduce(t)
                dist.barrier()
                before = rss()  # before any dump: symbolizing a dump imports modules and grows the heap
                t0 = time.perf_counter()
                torch._C._distributed_c10d._dump_fr_trace()  # type: ignore[attr-defined]
                t1 = time.perf_counter()
                blob = torch._C._distributed_c10d._dump_fr_trace()  # type: ignore[attr-defined]
                t2 = time.perf_counter()
                entries = len(pickle.loads(blob)["entries"])
                say({"rss": before, "entries": entries, "dump_bytes": len(blob), "first_dump_s": t1 - t0,
                     "dump_s": t2 - t1})
            else:
                break
        dist.destroy_process_group()
        return

    widths, batch, bucket_mb = MODELS[model]
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = DDP(torch.nn.Sequential(*layers[:-1]), bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(batch, widths[0])
    y = torch.randint(0, widths[-1], (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def train(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()

    train(10)  # warm-up (DDP rebuilds its buckets after the first step)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] != "run":
            break
        seconds = float(cmd[1])
        dist.barrier()
        s0, t0, c0, steps = seq(), time.perf_counter(), time.process_time(), 0
        while True:  # rank 0 decides when to stop; both ranks must run the same number of steps
            train(5)
            steps += 5
            flag = torch.tensor([1.0 if rank == 0 and time.perf_counter() - t0 >= seconds else 0.0])
            dist.all_reduce(flag)
            if flag.item():
                break
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        # collectives per step: DDP's bucket all-reduces (the stop flag's all_reduce every 5 steps left out)
        say({"steps_per_s": steps / dt, "cpu_ms_per_step": cpu / steps * 1e3,
             "collectives_per_step": (seq() - s0 - steps // 5) / steps})
    dist.destroy_process_group()


# -- orchestrator --------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """One 2-rank gloo job with one Flight Recorder setting, driven over the ranks' stdin/stdout."""

    def __init__(self, model: str, setting: str | None) -> None:
        nranks = 1 if model == "solo" else 2
        env = {k: v for k, v in os.environ.items()
               if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
        if setting is not None:
            env["TORCH_FR_BUFFER_SIZE"] = setting
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        port = free_port()
        self.ranks = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port), model],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                      for r in range(nranks)]

    def ask(self, line: str) -> list[dict[str, float]]:
        for p in self.ranks:
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()
        out = []
        for p in self.ranks:
            assert p.stdout is not None
            reply = p.stdout.readline()
            if not reply:
                raise RuntimeError(f"a rank exited (code {p.wait()})")
            out.append(json.loads(reply))
        return out

    def close(self) -> None:
        for p in self.ranks:
            try:
                assert p.stdin is not None
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
        for p in self.ranks:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _order(names: list[str], r: int) -> list[str]:
    return names[r % len(names):] + names[:r % len(names)]  # rotate: no setting always runs first


def bench_model(model: str, rounds: int, seconds: float) -> None:
    jobs = {name: Job(model, value) for name, value in SETTINGS}
    try:
        names = [n for n, _ in SETTINGS]
        wall: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        per_step: dict[str, float] = {}
        for r in range(rounds):
            for n in _order(names, r):
                rank0 = jobs[n].ask(f"run {seconds}")[0]
                wall[n].append(rank0["steps_per_s"])
                cpu[n].append(rank0["cpu_ms_per_step"])
                per_step[n] = rank0["collectives_per_step"]
        widths, batch, bucket = MODELS[model]
        shape = f"{widths[0]}-{widths[1]}x{len(widths) - 2}-{widths[-1]}" if len(widths) > 4 else \
            "-".join(map(str, widths))
        print(f"\n{model} MLP {shape}, batch {batch}, bucket_cap_mb {bucket:g}: {per_step[BASELINE]:.0f} all_reduce(s) "
              f"per step; {rounds} rounds x {seconds:g} s per setting, alternating")
        print("  best = the least disturbed round (max steps/s, min CPU); median over the rounds")
        print(f"{'TORCH_FR_BUFFER_SIZE':<21}{'steps/s best':>13}{'vs off':>8}{'median':>9}{'vs off':>8}"
              f"{'CPU ms/step best':>18}{'vs off':>8}{'median':>9}{'vs off':>8}")
        bw, mw0 = max(wall[BASELINE]), statistics.median(wall[BASELINE])
        bc, mc0 = min(cpu[BASELINE]), statistics.median(cpu[BASELINE])
        for n in names:
            w, mw, c, mc = max(wall[n]), statistics.median(wall[n]), min(cpu[n]), statistics.median(cpu[n])
            print(f"{n:<21}{w:>13.1f}{w / bw:>8.3f}{mw:>9.1f}{mw / mw0:>8.3f}"
                  f"{c:>18.3f}{c / bc:>8.3f}{mc:>9.3f}{mc / mc0:>8.3f}")
    finally:
        for j in jobs.values():
            j.close()


def bench_micro(rounds: int, calls: int) -> None:
    jobs = {name: Job("micro", value) for name, value in SETTINGS}
    try:
        names = [n for n, _ in SETTINGS]
        wall: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for n in _order(names, r):
                rank0 = jobs[n].ask(f"time {calls}")[0]
                wall[n].append(rank0["us_per_op"])
                cpu[n].append(rank0["cpu_us_per_op"])
        bw, bc = min(wall[BASELINE]), min(cpu[BASELINE])
        print(f"\n2-rank 1-element gloo all_reduce, {calls} calls x {rounds} rounds per setting; best round")
        print(f"{'TORCH_FR_BUFFER_SIZE':<21}{'wall us/op':>12}{'vs off':>8}{'CPU us/op':>12}{'vs off':>8}"
              f"{'extra CPU':>11}")
        for n in names:
            mw, mc = min(wall[n]), min(cpu[n])
            print(f"{n:<21}{mw:>12.1f}{mw / bw:>8.3f}{mc:>12.1f}{mc / bc:>8.3f}{mc - bc:>8.1f} us")
        mem = {n: jobs[n].ask("fill 25000")[0] for n in names}
        off = mem[BASELINE]["rss"]
        print("\nmemory of rank 0 after 25,000 collectives (RSS before any dump; the dump is the pickle torch writes)")
        print(f"{'TORCH_FR_BUFFER_SIZE':<21}{'RSS MiB':>9}{'vs off':>10}{'entries':>9}{'B/entry':>9}"
              f"{'dump KiB':>10}{'dump B/entry':>14}{'1st dump s':>12}{'next dump s':>13}")
        for n in names:
            m = mem[n]
            extra = m["rss"] - off
            per = f"{extra / m['entries']:.0f}" if m["entries"] else "-"
            dper = f"{m['dump_bytes'] / m['entries']:.0f}" if m["entries"] else "-"
            print(f"{n:<21}{m['rss'] / 2**20:>9.1f}{extra / 2**20:>+9.1f}M{m['entries']:>9}{per:>9}"
                  f"{m['dump_bytes'] / 1024:>10.0f}{dper:>14}{m['first_dump_s']:>12.2f}{m['dump_s']:>13.2f}")
        if mem["20000"]["entries"] > mem["2000"]["entries"]:
            d = (mem["20000"]["rss"] - mem["2000"]["rss"]) / (mem["20000"]["entries"] - mem["2000"]["entries"])
            print(f"ring growth 2000 -> 20000 entries: {d:.0f} bytes per entry")
    finally:
        for j in jobs.values():
            j.close()


def bench_solo(rounds: int, calls: int) -> None:
    jobs = {name: Job("solo", value) for name, value in SETTINGS}
    try:
        names = [n for n, _ in SETTINGS]
        res: dict[str, dict[str, list[float]]] = {n: {"shallow": [], "deep": []} for n in names}
        for r in range(rounds):
            for n in _order(names, r):
                out = jobs[n].ask(f"time {calls}")[0]
                for k in ("shallow", "deep"):
                    res[n][k].append(out[k])
        print(f"\n1-rank gloo all_reduce (no peer: the issuing thread's own cost), {calls} calls x {rounds} rounds; "
              "the minimum over rounds is the least disturbed")
        print(f"{'TORCH_FR_BUFFER_SIZE':<21}{'us/op, stack 1 frame':>22}{'extra':>9}{'us/op, stack 42 frames':>24}"
              f"{'extra':>9}")
        base = {k: min(res[BASELINE][k]) for k in ("shallow", "deep")}
        for n in names:
            sh, dp = min(res[n]["shallow"]), min(res[n]["deep"])
            print(f"{n:<21}{sh:>22.2f}{sh - base['shallow']:>6.2f} us{dp:>24.2f}{dp - base['deep']:>6.2f} us")
    finally:
        for j in jobs.values():
            j.close()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--seconds", type=float, default=0.8, help="training time per setting per round")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 0.5 s (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds = 3, 0.5
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo, 2 ranks (1 thread each)")
    t0 = time.monotonic()
    for model in MODELS:
        bench_model(model, args.rounds, args.seconds)
    bench_solo(args.rounds, 2000 if args.quick else 5000)
    bench_micro(args.rounds, 500 if args.quick else 1000)
    print(f"\n({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
