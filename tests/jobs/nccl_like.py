"""A CPU training job whose ranks behave on the host like NCCL ranks: the GPU's behaviour, brought to CI.

    torchrun --standalone --nproc-per-node 2 tests/jobs/nccl_like.py --scenario own_code --rank-at 1 --step-at 6

Every earlier hang rule was proven on gloo, where a rank that waits in a collective *sleeps* (0 CPU, blocked in a
futex). An NCCL rank that waits *spins* (shared/real-gpu, RESEARCH section 6): the collective is enqueued on a CUDA
stream and the host goes on; it waits at the next device sync (``loss.item()``), where CUDA's default wait is a busy
loop in ``cudaStreamSynchronize`` (~1 core, 0 voluntary wakeups), and NCCL's proxy thread polls its transport at
most of another core. py-spy shows the waiting rank "active" at the user's ``loss.item()`` line, with no
torch.distributed frame anywhere.

This job is gloo DDP (``loss.backward()`` every step, a loss read every step) whose collectives complete the NCCL way:

* DDP's comm hook issues each bucket's all-reduce with ``async_op=True`` and returns at once (NCCL's future is
  "done" once the kernel is enqueued); explicit collectives (``--scenario big_collectives``, desync) go the same
  way. Each launch is counted; the gloo future's done-callback marks it complete.
* ``synchronize()`` just before ``loss.item()`` is the device sync: ``cudaStreamSynchronize`` of nccl_stream.c
  (beside this file, built with cc, called through ctypes: no Python frame is added and the GIL is released),
  which spins until nothing is pending. The waiting rank's top Python frame is this script's line, "active", and
  its native stack (py-spy --native) has ``cudaStreamSynchronize`` under it, as on the H200.
* A proxy thread started at init (``ncclProxyProgress``, also C) spins with ``sched_yield()`` while an operation is
  pending and blocks when none is, as NCCL's does.

Scenarios (``--scenario``; ``--rank-at`` is the culprit, ``--step-at`` the step):
  healthy          train ``--steps`` steps and exit 0
  own_code         the culprit blocks in ``threading.Event().wait()`` before its backward; the peers launch the
                   bucket all-reduce and spin in the device sync
  slow_save        (healthy) rank 0 writes a checkpoint for ``--pause-s`` s after step ``--step-at``: 64 KiB chunks,
                   each fsync'd, 50 ms sleeps between them (slow storage); the others spin in the next step's sync
  big_collectives  (healthy) an extra ``--big-mib`` MiB all-reduce every step: the ranks spin while data moves
  transport        at step ``--step-at`` every rank's bucket all-reduce is launched and never completes (a broken
                   transport): counts equal and frozen, every rank spins
  sigstop          the culprit stops itself with SIGSTOP before its backward; the peers spin
  desync           at step ``--step-at`` the culprit calls all_gather where the others call broadcast; everyone
                   spins. NCCL hangs every rank on such a mismatch; gloo would let the broadcast's root and some
                   leaves finish, so the job holds the mismatched launches (counted, never completed), as NCCL does.

A fault fires only in the first ``--hang-runs`` runs (the launcher's GPU_WATCHDOG_RESTART_COUNT), and never while the
environment variable of ``--cured-by NAME=VALUE`` has that value (transport: default ``NCCL_P2P_DISABLE=1``, the
first fallback level, so a restart one level up finishes).

The in-job client (``gpu_watchdog.job.Client``) is used when the job runs under gpu-watchdog: step heartbeats, a
checkpoint on request (rank 0 saves ``<workdir>/ckpt.pt``); every run resumes from that checkpoint.

Files:
  ``--events FILE``   JSON lines {"rank", "step", "t", "event", ...}: "start" (with "pid"), "resume", "hang_onset"
                      (the wall time the fault or slow phase began), "pause_end", "step", "checkpoint", "done".
  ``$NCCL_LIKE_STATE_DIR/rank-<r>.json``  when set: this rank's NCCL-side state, rewritten atomically at every
                      change — pid, host, communicator id, collectives launched and completed by type (NCCL's RAS
                      names: AllReduce, Broadcast, AllGather, ...), bytes pending, and where the host is ("compute",
                      "sync" = spinning in the device sync, "blocked", "stopped", "save", "done"). tests/support reads
                      it to serve NCCL RAS reports (ras_standin) and to play the GPU on the NVML stand-in (gpu_play).
"""

# No ``from __future__ import annotations``: DDP checks the comm hook's annotations as objects.
import argparse
import ctypes
import functools
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from job_events import checkpointing, compute, log_event, slow_save  # beside this script
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
STATE_DIR_ENV = "NCCL_LIKE_STATE_DIR"
SCENARIOS = ("healthy", "own_code", "slow_save", "big_collectives", "transport", "sigstop", "desync")
CURED_BY = {"transport": "NCCL_P2P_DISABLE=1"}


def build_stream(workdir: str) -> tuple[ctypes.CDLL, str]:
    """Compile nccl_stream.c for this process and load it (ctypes.CDLL: every call releases the GIL). The file stays
    while the process runs: py-spy --native reads its symbols."""
    lib_path = os.path.join(workdir, f"libnccl-stream-{os.getpid()}.so")
    subprocess.run(["cc", "-O2", "-g", "-fno-omit-frame-pointer", "-shared", "-fPIC", "-pthread", "-o", lib_path,
                    os.path.join(HERE, "nccl_stream.c")], check=True)
    lib = ctypes.CDLL(lib_path)
    for name in ("stream_pending", "stream_launched", "stream_completed"):
        getattr(lib, name).restype = ctypes.c_long
    lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    lib.ncclProxyProgress.argtypes = [ctypes.c_void_p]
    lib.ncclProxyProgress.restype = ctypes.c_void_p
    return lib, lib_path


class RankState:
    """This rank's NCCL-side state file (``$NCCL_LIKE_STATE_DIR/rank-<r>.json``); a no-op without the variable."""

    def __init__(self, rank: int, world: int) -> None:
        self.dir = os.environ.get(STATE_DIR_ENV) or None
        self.rank = rank
        self.lock = threading.Lock()
        # One communicator per run: NCCL's commHash differs for every new communicator (a restart makes a new one).
        run = f"{os.getppid()}:{os.environ.get('MASTER_PORT')}:{os.environ.get('TORCHELASTIC_RUN_ID')}"
        self.doc: dict[str, Any] = {
            "rank": rank, "world": world, "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
            "pid": os.getpid(), "host": "127.0.0.1", "comm": "0x" + hashlib.sha1(run.encode()).hexdigest()[:16],
            "restart": int(os.environ.get("GPU_WATCHDOG_RESTART_COUNT", "0")),
            "step": 0, "state": "init", "since": time.time(), "pending_bytes": 0,
            "launched": {}, "completed": {}, "t": time.time(),
        }
        self.write()

    def write(self) -> None:
        if not self.dir:
            return
        with self.lock:
            self.doc["t"] = time.time()
            text = json.dumps(self.doc)
        path = os.path.join(self.dir, f"rank-{self.rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def set(self, state: str, step: int | None = None) -> None:
        with self.lock:
            if state != self.doc["state"]:
                self.doc["since"] = time.time()
            self.doc["state"] = state
            if step is not None:
                self.doc["step"] = step
        self.write()

    def launched(self, op: str, nbytes: int) -> None:
        with self.lock:
            self.doc["launched"][op] = self.doc["launched"].get(op, 0) + 1
            self.doc["pending_bytes"] += nbytes

    def completed(self, op: str, nbytes: int) -> None:
        with self.lock:
            self.doc["completed"][op] = self.doc["completed"].get(op, 0) + 1
            self.doc["pending_bytes"] -= nbytes


class Stream:
    """NCCL-style completion of gloo collectives: launch async, count, complete in the background; the host waits
    only in ``synchronize`` (the C spin)."""

    def __init__(self, lib: ctypes.CDLL, state: RankState) -> None:
        self.lib = lib
        self.state = state
        self.works: list[object] = []

    def launch(self, op: str, work: object | None, nbytes: int) -> None:
        """Count a launched collective (NCCL RAS counts it now); ``work`` None: it never completes (held)."""
        self.state.launched(op, nbytes)
        self.lib.stream_enqueue()
        if work is None:
            return
        self.works.append(work)

        def done(_fut: object) -> None:
            self.state.completed(op, nbytes)
            self.lib.stream_complete()

        work.get_future().add_done_callback(done)  # type: ignore[attr-defined]

    def all_reduce(self, t: torch.Tensor) -> None:
        self.launch("AllReduce", dist.all_reduce(t, async_op=True), t.numel() * t.element_size())

    def raise_errors(self) -> None:
        """After a sync: surface a failed collective (a peer died), as NCCL's async error handling does."""
        works, self.works = self.works, []
        for w in works:
            w.wait()  # type: ignore[attr-defined]  # completed: returns at once, or raises its error


def small_model() -> torch.nn.Module:
    """Three layers, sized so DDP makes two gradient buckets (its first bucket closes at 1 MiB): two AllReduce per
    step, as NCCL RAS counted on the H200 (a rank behind by 2)."""
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 64))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="healthy", choices=SCENARIOS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-at", type=int, default=5)
    ap.add_argument("--rank-at", type=int, default=1)
    ap.add_argument("--pause-s", type=float, default=20.0, help="slow_save: how long rank 0 writes")
    ap.add_argument("--step-s", type=float, default=0.1, help="host compute per step (forward's stand-in)")
    ap.add_argument("--big-mib", type=float, default=8.0, help="big_collectives: size of the extra all-reduce")
    ap.add_argument("--hang-runs", type=int, default=1, help="runs (GPU_WATCHDOG_RESTART_COUNT) in which it fires")
    ap.add_argument("--cured-by", default=None, metavar="NAME=VALUE",
                    help="the fault does not fire while env NAME is VALUE (transport: NCCL_P2P_DISABLE=1)")
    ap.add_argument("--events", default=None)
    ap.add_argument("--workdir", default=".")
    args = ap.parse_args()
    cured_by = args.cured_by or CURED_BY.get(args.scenario)
    name, _, value = (cured_by or "").partition("=")
    args.armed = (int(os.environ.get("GPU_WATCHDOG_RESTART_COUNT", "0")) < args.hang_runs
                  and not (name and os.environ.get(name) == value))
    return args


def run(args: argparse.Namespace) -> int:
    from gpu_watchdog.job import Client

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    culprit = rank == args.rank_at and args.armed
    lib, args.lib_path = build_stream(args.workdir)
    threading.Thread(target=lib.ncclProxyProgress, args=(None,), name="nccl-proxy", daemon=True).start()
    state = RankState(rank, world)
    stream = Stream(lib, state)
    synchronize = functools.partial(lib.cudaStreamSynchronize, None)  # C all the way: no Python frame added

    torch.manual_seed(0)
    model = DDP(small_model())
    state.launched("Broadcast", 0)  # DDP's module-state sync at init (a blocking gloo broadcast)
    state.completed("Broadcast", 0)
    held = {"transport": False}

    def nccl_hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer().div_(world)
        if held["transport"]:
            stream.launch("AllReduce", None, buf.numel() * buf.element_size())  # launched; the transport drops it
        else:
            stream.all_reduce(buf)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)  # "done" once enqueued, as an NCCL work's future is to the host
        return fut

    model.register_comm_hook(None, nccl_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    big = torch.ones(int(args.big_mib * (1 << 20)) // 4) if args.scenario == "big_collectives" else None
    start, save = checkpointing(args.workdir, model, opt, rank, args.events, map_location=None)

    client = Client.from_env()
    client.on_checkpoint(save)
    log_event(args.events, rank=rank, step=start - 1, event="start", pid=os.getpid(), host=socket.gethostname(),
              restart=os.environ.get("GPU_WATCHDOG_RESTART_COUNT"), armed=args.armed,
              nccl={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    state.set("compute", start - 1)

    with client.training():
        for step in range(start, args.steps + 1):
            at = step == args.step_at and args.armed
            state.set("compute", step)
            gen = torch.Generator().manual_seed(step * world + rank)
            x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)
            compute(args.step_s)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if at and culprit and args.scenario == "own_code":
                state.set("blocked")
                log_event(args.events, rank=rank, step=step, event="hang_onset")
                threading.Event().wait()  # a thread it waits on died without setting it
            if at and culprit and args.scenario == "sigstop":
                state.set("stopped")
                log_event(args.events, rank=rank, step=step, event="hang_onset")
                os.kill(os.getpid(), signal.SIGSTOP)
            if at and args.scenario == "transport":
                held["transport"] = True
                log_event(args.events, rank=rank, step=step, event="hang_onset")
            opt.zero_grad()
            loss.backward()  # DDP launches each bucket's all-reduce from the comm hook; the host goes on
            if big is not None:
                stream.all_reduce(big)
            if at and args.scenario == "desync":
                t = torch.ones(4)
                if culprit:  # a rank-dependent branch: this rank gathers where the others broadcast
                    log_event(args.events, rank=rank, step=step, event="hang_onset")
                    stream.launch("AllGather", None, t.numel() * 4 * world)
                else:
                    stream.launch("Broadcast", None, t.numel() * 4)
            opt.step()
            state.set("sync")
            synchronize()  # what loss.item() does on a GPU: wait (spinning) for every kernel queued, NCCL's included
            stream.raise_errors()
            value = loss.item()
            state.set("compute")
            log_event(args.events, rank=rank, step=step, event="step", loss=value)
            client.step(step)
            if step == args.step_at and args.scenario == "slow_save" and rank == 0:
                state.set("save")
                log_event(args.events, rank=rank, step=step, event="hang_onset")
                written = slow_save(os.path.join(args.workdir, "slow-ckpt.bin"), args.pause_s)
                log_event(args.events, rank=rank, step=step, event="pause_end", bytes=written)
    dist.barrier()
    state.set("done", args.steps)
    log_event(args.events, rank=rank, step=args.steps, event="done")
    dist.destroy_process_group()
    return 0


def main() -> None:
    args = parse_args()
    args.lib_path = None
    try:
        code = run(args)
    except SystemExit as e:  # the client's exits (85: checkpointed, 86: aborted)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # a collective failed (a peer died), ...: report it and exit non-zero
        import traceback

        traceback.print_exc()
        code = 1
    if args.lib_path:
        try:
            os.unlink(args.lib_path)
        except OSError:
            pass
    # Leave without the interpreter's teardown (the proxy thread is in C; torch 2.13's gloo teardown now and then
    # aborts once the peers have exited, see gpu_watchdog/demo/train.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
