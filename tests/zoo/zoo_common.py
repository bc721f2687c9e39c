"""What the zoo's training programs share, so each program file reads like its users' code: arguments, a small
model and batches, the process group, the training loop (``train_loop``) and its plain step, an atomic checkpoint,
the events file, and the slow phases and faults each variant injects at ``--hang-step``. Imported by the programs
beside it (a script's own directory is on its sys.path).

Events (``--events FILE``, JSON lines {"rank", "step", "t", "event", ...}): "start", "hang_onset" (the wall time the
variant's slow phase or fault began), "step", "done". A fault fires only in the first ``--hang-runs`` runs (the
launcher's GPU_WATCHDOG_RESTART_COUNT), so a restarted run can show the recovery.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

HEALTHY = ("healthy", "poll", "slow_reader", "slow_save", "eval", "straggler", "compile_warmup", "logger")
FAULTS = ("event_wait", "lock", "recv", "subprocess_wait", "busy", "desync", "crash", "sigstop", "dead_worker",
          "dstate")


def parse_args(doc: str | None, nproc: bool = False,
               more: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """The variant's arguments; ``nproc``: the program starts its ranks itself (``mp.spawn``), ``--nproc`` many;
    ``more`` adds a program's own."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if more is not None:
        more(p)
    if nproc:
        p.add_argument("--nproc", type=int, default=3, help="ranks to spawn")
    p.add_argument("--variant", default="healthy")
    p.add_argument("--rank", type=int, default=2, help="the rank a fault hits")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hang-step", type=int, default=4)
    p.add_argument("--hang-runs", type=int, default=1, help="runs in which the fault fires")
    p.add_argument("--pause-s", type=float, default=20.0, help="length of a healthy slow phase")
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--workdir", default=".")
    p.add_argument("--events", default="")
    p.add_argument("--data-addr", default="", help="HOST:PORT of zoo/data_service.py (slow_reader, recv)")
    p.add_argument("--pg-timeout-s", type=float, default=None,
                   help="the process group's timeout (init_process_group(timeout=)); default: PyTorch's")
    return p.parse_args()


def rank() -> int:
    """The process group's rank once it is up (a spawned rank has no RANK), torchrun's RANK before."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def event(args: argparse.Namespace, name: str, **fields: object) -> None:
    if not args.events:
        return
    line = json.dumps({"rank": rank(), "pid": os.getpid(), "t": time.time(), "event": name, **fields})
    with open(args.events, "a") as f:
        f.write(line + "\n")


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 64), torch.randn(n, 64)


def fault_armed(args: argparse.Namespace) -> bool:
    return int(os.environ.get("GPU_WATCHDOG_RESTART_COUNT", "0")) < args.hang_runs


def _ckpt(args: argparse.Namespace) -> Path:
    return Path(args.workdir) / "ckpt.pt"


def save_checkpoint(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Atomic: a torn write never replaces the last good checkpoint."""
    path = _ckpt(args)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def load_checkpoint(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """The step to start from (0 without a checkpoint)."""
    path = _ckpt(args)
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"]) + 1


def step_done(args: argparse.Namespace, step: int) -> None:
    event(args, "step", step=step)
    time.sleep(args.step_s)


def straggle(args: argparse.Namespace, r: int) -> None:
    if args.variant == "straggler" and r == 1:
        time.sleep(args.step_s)  # this rank's steps take twice as long


@contextlib.contextmanager
def process_group(backend: str = "gloo", timeout_s: float | None = None) -> Iterator[int]:
    """``init_process_group`` from torchrun's environment (with the group timeout ``timeout_s`` when given), the rank
    to the body, ``destroy_process_group`` once the body has run to its end (not after an exception: as a script
    calling both itself)."""
    import datetime

    import torch.distributed as dist

    if timeout_s is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    yield dist.get_rank()
    dist.destroy_process_group()


def train_loop(args: argparse.Namespace, rank: int, step_fn: Callable[..., object], *,
               checkpoint: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None,
               save: Callable[[int], object] | None = None, batches: Iterable[object] | None = None,
               steps: int | None = None, within: contextlib.AbstractContextManager[object] | None = None,
               handled: tuple[str, ...] = (), straggler: bool = True) -> None:
    """The training loop of the programs, around each one's own step ``step_fn(step)``. Event "start", then each
    step: the variant's slow phase or fault (``handled``: see slow_phase), ``step_fn``, a straggler's extra sleep
    (``straggler=False``: a program without one), the checkpoint every ``--ckpt-every`` steps, event "step"; event
    "done" once the loop and ``within`` (a context around it: DDP's ``Join``) have ended.

    ``checkpoint`` (model, optimizer): the run resumes from its atomic checkpoint, which rank 0 saves; ``save(step)``:
    the program's own checkpoint, called on every rank. ``batches``: each step's batch is drawn from it before the
    slow phase (as ``for x, y in loader`` does) and handed over, ``step_fn(step, batch)``. ``steps``: this rank's
    number of steps (``--steps``)."""
    start = load_checkpoint(args, *checkpoint) if checkpoint else 0
    event(args, "start", step=start)
    numbers = range(start, args.steps if steps is None else steps)
    with within if within is not None else contextlib.nullcontext():
        for step, data in zip(numbers, itertools.repeat(None) if batches is None else batches, strict=False):
            slow_phase(args, step, rank, handled)
            if batches is None:
                step_fn(step)
            else:
                step_fn(step, data)
            if straggler:
                straggle(args, rank)
            if step % args.ckpt_every == 0:
                if checkpoint and rank == 0:
                    save_checkpoint(args, *checkpoint, step)
                if save is not None:
                    save(step)
            step_done(args, step)
    event(args, "done")


def plain_step(model: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer, *,
               zero_grad_last: bool = False) -> Callable[..., None]:
    """The step most programs take, for train_loop: a batch of 16 (unless the loop hands one over), the MSE loss,
    backward, the optimizer step; gradients zeroed before the backward (DDP's tutorial) or after the step
    (``zero_grad_last``, as FSDP2's docs write it)."""

    def train_step(step: int, data: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        x, y = batch(16) if data is None else data
        loss = torch.nn.functional.mse_loss(model(x), y)
        if not zero_grad_last:
            opt.zero_grad()
        loss.backward()
        opt.step()
        if zero_grad_last:
            opt.zero_grad()

    return train_step


def tp_dp_step(shard: torch.nn.Module, opt: torch.optim.Optimizer, tp: object, dp: object) -> Callable[[int], None]:
    """The step of the TP x DP programs, for train_loop: the same batch on every rank, the row-parallel sum of the
    activations in the rank's TP group (``tp``), backward, each gradient all-reduced in its DP group (``dp``)."""
    import torch.distributed as dist

    def train_step(step: int) -> None:
        torch.manual_seed(1000 + step)
        x, y = batch(16)
        out = shard(x)
        dist.all_reduce(out, group=tp)  # the row-parallel sum of the TP pair
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        for p in shard.parameters():
            dist.all_reduce(p.grad, group=dp)
        opt.step()

    return train_step


def poll_for_shard(args: argparse.Namespace, step: int) -> None:
    """Wait for the next shard file the way data pipelines often do: look every 2 s."""
    shard = Path(args.workdir) / f"shard-{step}"
    if rank() == 0:
        threading.Timer(args.pause_s, shard.touch).start()  # another process would produce it
    while not os.path.exists(shard):
        time.sleep(2)


def read_shard(args: argparse.Namespace, what: str) -> bytes:
    """Ask the data service for a shard and read it to the end (``what``: "slow" trickles, "stall" never sends)."""
    host, port = args.data_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"{what} {rank()}\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def evaluate(seconds: float) -> None:
    end = time.monotonic() + seconds
    a = torch.randn(128, 128)
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def slow_save(args: argparse.Namespace) -> None:
    """A checkpoint crawling to a slow disk: 1 MiB writes, each flushed and fsynced."""
    end = time.monotonic() + args.pause_s
    chunk = os.urandom(1 << 20)
    with open(Path(args.workdir) / "big-ckpt.bin", "wb") as f:
        while time.monotonic() < end:
            f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            time.sleep(0.5)


def slow_phase(args: argparse.Namespace, step: int, r: int, handled: tuple[str, ...] = ()) -> None:
    """The variant's slow phase or fault at ``--hang-step`` (nothing at other steps). ``handled``: variants the
    program injects its own way (ddp_plain's prefetch thread for event_wait, a program's own desync)."""
    if step != args.hang_step or args.variant in handled:
        return
    v = args.variant
    healthy_everyone = v in ("poll", "slow_reader")
    target = v in FAULTS and (r == args.rank or v == "desync") and fault_armed(args)
    if healthy_everyone or target or (v in ("slow_save", "eval", "logger") and r == 0):
        event(args, "hang_onset", step=step)
    if v == "poll":
        poll_for_shard(args, step)
    elif v == "slow_reader":
        read_shard(args, "slow")
    elif v == "slow_save" and r == 0:
        slow_save(args)
    elif v == "eval":
        if r == 0:
            evaluate(args.pause_s)
        import torch.distributed as dist

        dist.barrier()
    elif v == "logger" and r == 0:
        upload_logs(args)
    elif not target:
        return
    elif v == "event_wait":
        threading.Event().wait()  # a thread it waits on died without setting it
    elif v == "lock":
        held = threading.Lock()
        held.acquire()
        held.acquire()  # a lock its owner never releases (a deadlock in user code)
    elif v == "recv":
        read_shard(args, "stall")
    elif v == "subprocess_wait":
        import subprocess

        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]).wait()
    elif v == "busy":
        while True:
            pass
    elif v == "crash":
        raise RuntimeError(f"rank {r}: injected crash at step {step}")
    elif v == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif v == "desync":
        desync(args, r)
    elif v == "dstate":
        in_uninterruptible_sleep(args)


def in_uninterruptible_sleep(args: argparse.Namespace) -> None:
    """The rank reads a checkpoint from a hard NFS mount whose server went away: state D for good."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
    from dstate import uninterruptible_sleep

    uninterruptible_sleep(3600, args.workdir)


def desync(args: argparse.Namespace, r: int) -> None:
    """A rank-dependent branch: rank ``--rank`` calls all_gather where the others call broadcast."""
    import torch.distributed as dist

    t = torch.ones(4)
    if r == args.rank:
        dist.all_gather([torch.zeros(4) for _ in range(dist.get_world_size())], t)
    else:
        dist.broadcast(t, src=0)


def upload_logs(args: argparse.Namespace) -> None:
    """Rank 0 uploads its logs to a slow endpoint before going on (its peers wait in the next collective)."""
    if args.data_addr:
        read_shard(args, "slow")
    else:
        time.sleep(args.pause_s)
