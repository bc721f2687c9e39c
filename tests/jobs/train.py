"""A small real gloo training job for tests, run under torchrun. Scenarios make it hang or pause for real.

    torchrun --nproc-per-node 4 tests/jobs/train.py --scenario hang --rank-at 1 --step-at 5

Scenarios (``--scenario``):
  healthy     train ``--steps`` steps and exit 0
  hang        rank ``--rank-at`` stops joining collectives at step ``--step-at``: it blocks for good in a receive
              from a peer that never sends (the others wait in all_reduce)
  desync      rank ``--rank-at`` calls barrier() at step ``--step-at`` while the others call all_reduce
  queue       rank ``--rank-at``'s producer thread dies at step ``--step-at``; its main thread blocks in Queue.get
  save        rank 0 writes a checkpoint for ``--pause-s`` seconds at step ``--step-at``; peers wait in barrier
  eval        rank 0 computes an "evaluation" for ``--pause-s`` seconds at step ``--step-at``; peers wait in barrier
  stop        rank ``--rank-at`` stops itself with SIGSTOP at step ``--step-at`` (a debugger, job control)
  worker      rank ``--rank-at`` hands step ``--step-at`` to a multiprocessing worker (as vLLM's generate() hands
              work to its workers) and waits on a result queue; the worker blocks in an all_reduce of a private
              2-process gloo group whose other member never joins
  exit        rank ``--rank-at`` exits with code 3 at step ``--step-at``
  abort       rank ``--rank-at`` dies by SIGABRT at step ``--step-at`` (a crash in native code mid-training)
  abort_at_exit  every step done and the group destroyed, rank ``--rank-at`` dies by SIGABRT after ``--pause-s``
              seconds (PyTorch's teardown abort at interpreter exit) while its peers exit 0 after ``--linger-s``;
              with ``--after-peers`` its pause starts only once its peers' processes have ended (a loaded host can
              hold a peer's interpreter exit for seconds, and torchrun would then SIGTERM it)
  dsleep      rank ``--rank-at`` sits in uninterruptible sleep (state D, as on a hung NFS mount) for ``--pause-s``
              seconds at step ``--step-at``, then trains on (dsleep.c beside this script, built with cc)

``--client`` runs the loop inside the in-job client's ``training()`` and reports each step (gpu_watchdog.job).

``--cured-by NAME=VALUE`` arms the scenario's fault only while the environment variable NAME is not VALUE: a
stand-in for a hang that a fallback setting cures (e.g. ``NCCL_P2P_DISABLE=1``) on a CPU box.

``--fr-pipe`` emulates ProcessGroupNCCL's Flight Recorder dump pipe for gloo (which has none): with
TORCH_FR_BUFFER_SIZE, TORCH_FR_DUMP_TEMP_FILE and TORCH_NCCL_DEBUG_INFO_PIPE_FILE set, rank r creates the FIFO
``<pipe prefix><r>.pipe``; a byte written to it makes the rank write its trace to ``<dump prefix><r>``.

Every rank appends JSON lines to ``--events FILE`` (when given): {"rank", "step", "t", "event"}; the
"hang_onset" event carries the wall time at which the scenario's hang or pause began.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import signal
import threading
import time

import torch
import torch.distributed as dist
from dstate import uninterruptible_sleep  # beside this script
from gpu_watchdog.job import Client
from job_events import compute, log_event  # beside this script


def save_checkpoint(path: str, seconds: float) -> None:
    """Write real bytes to disk for ``seconds``: CPU and I/O progress, like torch.save of a big model."""
    end = time.monotonic() + seconds
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        while time.monotonic() < end:
            f.write(chunk)
            f.flush()
            f.seek(0)  # keep the file small; the writes still count as I/O


def _worker_in_collective(port: int, wrank: int, results: object) -> None:
    """A worker process of a rank: joins a private 2-process gloo group; member 0 blocks in all_reduce because
    member 1 never calls it (a collective hang behind a process boundary)."""
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):  # not torchrun's group: a private one
        os.environ.pop(var, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=wrank, world_size=2)
    if wrank == 0:
        t = torch.ones(4)
        dist.all_reduce(t)
        results.put(float(t[0]))  # type: ignore[attr-defined]
    while True:
        time.sleep(3600)


def hand_to_workers(events: str | None, rank: int, step: int) -> None:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")  # a fork would inherit the rank's default process group
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker_in_collective, args=(port, w, results), daemon=True) for w in (0, 1)]
    for w in workers:
        w.start()
    log_event(events, rank=rank, step=step, event="hang_onset", worker_pids=[w.pid for w in workers])
    results.get()  # the rank's main thread waits on its workers: a queue wait, the collective is elsewhere


def start_fr_pipe(rank: int) -> threading.Event:
    """Serve dump requests from a helper thread: the main thread may be blocked in a collective. The event is set
    once the helper is warm (the first dump of recorded entries imports torch._dynamo) or when FR is off."""
    warm = threading.Event()
    pipe_prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    dump_prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if not pipe_prefix or not dump_prefix:
        warm.set()
        return warm
    path = f"{pipe_prefix}{rank}.pipe"
    if not os.path.exists(path):
        os.mkfifo(path)
    rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # like NCCL: the reader stays open
    os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # our own writer keeps select() from spinning on EOF

    def serve() -> None:
        import select

        import torch._dynamo  # noqa: F401  # a dump's symbolizing imports it (~10 s on a loaded box): pay it now
        warm.set()
        while True:
            select.select([rfd], [], [])
            if not os.read(rfd, 4096):
                continue
            data = torch._C._distributed_c10d._dump_fr_trace()
            tmp = f"{dump_prefix}{rank}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, f"{dump_prefix}{rank}")

    threading.Thread(target=serve, daemon=True, name="fr-pipe").start()
    return warm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="healthy",
                    choices=["healthy", "hang", "desync", "queue", "save", "eval", "stop", "worker", "exit", "abort",
                             "abort_at_exit", "dsleep"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-at", type=int, default=5)
    ap.add_argument("--rank-at", type=int, default=1)
    ap.add_argument("--pause-s", type=float, default=45.0)
    ap.add_argument("--step-s", type=float, default=0.3, help="compute time per step")
    ap.add_argument("--linger-s", type=float, default=0.0, help="abort_at_exit: the peers' wait before exiting")
    ap.add_argument("--after-peers", action="store_true",
                    help="abort_at_exit: the aborting rank waits until its peers' processes have ended")
    ap.add_argument("--client", action="store_true", help="train inside the in-job client's training()")
    ap.add_argument("--events", default=None)
    ap.add_argument("--workdir", default=".")
    ap.add_argument("--fr-pipe", action="store_true", help="serve Flight Recorder dumps on a FIFO")
    ap.add_argument("--cured-by", default=None, metavar="NAME=VALUE",
                    help="arm the fault only while env NAME is not VALUE")
    args = ap.parse_args()
    if args.cured_by:
        name, _, value = args.cured_by.partition("=")
        if os.environ.get(name) == value:
            args.scenario = "healthy"

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.fr_pipe:
        start_fr_pipe(rank)
    log_event(args.events, rank=rank, step=0, event="start", pid=os.getpid())

    batches: queue.Queue[int] = queue.Queue(maxsize=2)

    def producer() -> None:
        for i in range(args.steps + 1):
            if args.scenario == "queue" and rank == args.rank_at and i == args.step_at - 1:
                return  # the producer "dies": the main thread will block in Queue.get forever
            batches.put(i)

    threading.Thread(target=producer, daemon=True, name="producer").start()

    t = torch.ones(1024)
    client = Client.from_env() if args.client else None
    with client.training() if client is not None else contextlib.nullcontext():
        train(args, rank, batches, t, client)
    dist.barrier()
    log_event(args.events, rank=rank, step=args.steps, event="done")
    peers: list[int] = []
    if args.scenario == "abort_at_exit" and args.after_peers:
        pids: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        peers = [p for p in pids if p != os.getpid()]
    dist.destroy_process_group()
    if args.scenario == "abort_at_exit":
        if rank == args.rank_at:
            wait_until_ended(peers)
        time.sleep(args.pause_s if rank == args.rank_at else args.linger_s)
        if rank == args.rank_at:
            os.abort()


def wait_until_ended(pids: list[int], timeout_s: float = 120.0) -> None:
    """Until each process is gone or a zombie (its exit status is its parent's to read)."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] == "Z":
                        break
            except OSError:
                break
            time.sleep(0.05)


def train(args: argparse.Namespace, rank: int, batches: queue.Queue[int], t: torch.Tensor,
          client: Client | None) -> None:
    for step in range(1, args.steps + 1):
        at = step == args.step_at
        if at and args.scenario == "queue" and rank == args.rank_at:
            log_event(args.events, rank=rank, step=step, event="hang_onset")
        batches.get()
        compute(args.step_s)
        if at and args.scenario == "hang" and rank == args.rank_at:
            log_event(args.events, rank=rank, step=step, event="hang_onset")
            # A message that never comes: rank 0 is in the next all_reduce, not sending (a lost message, as
            # an NCCL P2P transport bug leaves it). A sleeping rank would be a slow rank, not a hung one.
            dist.recv(torch.zeros(1), src=0 if rank != 0 else 1)
        if at and args.scenario == "stop" and rank == args.rank_at:
            log_event(args.events, rank=rank, step=step, event="hang_onset")
            os.kill(os.getpid(), signal.SIGSTOP)
        if at and args.scenario == "worker" and rank == args.rank_at:
            hand_to_workers(args.events, rank, step)
        if at and args.scenario == "exit" and rank == args.rank_at:
            log_event(args.events, rank=rank, step=step, event="hang_onset")
            os._exit(3)
        if at and args.scenario == "abort" and rank == args.rank_at:
            log_event(args.events, rank=rank, step=step, event="hang_onset")
            os.abort()
        if at and args.scenario == "dsleep" and rank == args.rank_at:
            log_event(args.events, rank=rank, step=step, event="hang_onset")
            uninterruptible_sleep(args.pause_s, args.workdir)
            log_event(args.events, rank=rank, step=step, event="pause_end")
        if at and args.scenario == "desync" and rank == args.rank_at:
            log_event(args.events, rank=rank, step=step, event="hang_onset")
            dist.barrier()
        if at and args.scenario in ("save", "eval"):
            if rank == 0:
                log_event(args.events, rank=rank, step=step, event="hang_onset")
                if args.scenario == "save":
                    save_checkpoint(os.path.join(args.workdir, f"ckpt-rank{rank}.bin"), args.pause_s)
                else:
                    compute(args.pause_s)
                log_event(args.events, rank=rank, step=step, event="pause_end")
            dist.barrier()
        dist.all_reduce(t)
        log_event(args.events, rank=rank, step=step, event="step")
        if client is not None:
            client.step(step)


if __name__ == "__main__":
    main()
