"""The demo's training job (run under torchrun, gloo, CPU): a tiny data-parallel regression.

It reproduces the field report behind the project: a peer-to-peer transfer that never completes. At step
``--hang-at`` rank ``--hang-rank`` waits in ``recv`` for a tensor no peer sends while the others call
``all_reduce`` — but only while ``NCCL_P2P_DISABLE`` is unset, so the fallback NCCL settings are what "fix"
it. (gloo ignores NCCL_* variables; the job reads the variable itself to stand in for NCCL's behaviour.)

Checkpoints: with ``--client`` the job uses gpu_watchdog.job (saves when the agent asks, even from inside
the hung collective); without it, the job saves its own checkpoint every ``--save-every`` steps, like an
unmodified training script. Either way it resumes from the newest checkpoint in ``--ckpt-dir``.
``--events FILE`` gets JSON lines (start, resume, hang_onset, step, done) for timing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path


def log_event(path: str | None, **fields: object) -> None:
    if path:
        fields.setdefault("t", time.time())
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hang-at", type=int, default=12, help="0: never hang")
    ap.add_argument("--hang-rank", type=int, default=1)
    ap.add_argument("--hang-always", action="store_true", help="hang even with NCCL_P2P_DISABLE=1")
    ap.add_argument("--hang-busy", action="store_true",
                    help="the hang rank computes forever instead (its peers wait in all_reduce): no NCCL setting "
                         "cures it, and it happens only once per --ckpt-dir (a transient fault)")
    ap.add_argument("--step-s", type=float, default=0.15, help="compute time per step")
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--client", action="store_true", help="use the gpu_watchdog.job client")
    ap.add_argument("--save-every", type=int, default=1, help="without --client: own checkpoint period")
    ap.add_argument("--events", default=None)
    ap.add_argument("--print-every", type=int, default=5, help="print the loss every N steps")
    args = ap.parse_args(argv)

    import warnings

    # torch built without NumPy warns at import in every rank; the job does not use NumPy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch.distributed as dist

    from gpu_watchdog.job import Client

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(args.ckpt_dir) / "ckpt.pt"
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 1
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"]) + 1
    p2p_disabled = os.environ.get("NCCL_P2P_DISABLE") == "1"
    log_event(args.events, rank=rank, event="start", step=start - 1, pid=os.getpid(),
              nccl_p2p_disable=os.environ.get("NCCL_P2P_DISABLE"), nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
              restart=os.environ.get("GPU_WATCHDOG_RESTART_COUNT"), host=socket.gethostname(),
              nccl={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    if rank == 0:
        print(f"[job] rank 0 of {world}: {'resuming after step ' + str(start - 1) if start > 1 else 'fresh start'}; "
              f"NCCL_P2P_DISABLE={os.environ.get('NCCL_P2P_DISABLE', '(unset)')}", flush=True)

    def save(step: int) -> None:
        if rank == 0:  # data parallel: every rank holds the same state
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            tmp.replace(ckpt)
            log_event(args.events, rank=rank, event="checkpoint", step=step)
            print(f"[job] rank 0 saved a checkpoint at step {step}", flush=True)

    client = Client.from_env()
    if args.client:
        client.on_checkpoint(save)
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(16, 1, generator=g)
    with client.training():
        for step in range(start, args.steps + 1):
            gen = torch.Generator().manual_seed(step * world + rank)  # the same data on resume
            x = torch.randn(64, 16, generator=gen)
            y = x @ w_true
            end = time.monotonic() + args.step_s
            while time.monotonic() < end:  # stand-in for a heavier forward/backward
                torch.tanh(torch.randn(64, 64) @ torch.randn(64, 64))
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            busy_once = Path(args.ckpt_dir) / "busy-hang.done"
            if step == args.hang_at and rank == args.hang_rank and args.hang_busy and not busy_once.exists():
                busy_once.touch()
                log_event(args.events, rank=rank, event="hang_onset", step=step)
                print(f"[job] rank {rank}: step {step}: computing forever", flush=True)
                while True:  # a rank stuck in its own code, alive and busy: the others wait for it
                    torch.tanh(torch.randn(64, 64) @ torch.randn(64, 64))
            if step == args.hang_at and rank == args.hang_rank and not args.hang_busy and (
                    args.hang_always or not p2p_disabled):
                log_event(args.events, rank=rank, event="hang_onset", step=step)
                print(f"[job] rank {rank}: step {step}: waiting for a P2P transfer that never arrives", flush=True)
                dist.recv(torch.zeros(1), src=(rank + 1) % world)  # nobody sends: a hung P2P
            for p in model.parameters():  # data-parallel gradient averaging
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            log_event(args.events, rank=rank, event="step", step=step)
            if rank == 0 and (step % args.print_every == 0 or step == args.steps):
                print(f"[job] step {step:3d} loss {loss.item():.4f}", flush=True)
            if not args.client and args.save_every and step % args.save_every == 0:
                save(step)
            client.step(step)
    dist.barrier()
    log_event(args.events, rank=rank, event="done", step=args.steps)
    if rank == 0:
        print(f"[job] finished {args.steps} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The process group is destroyed and every file written: leave without the interpreter's teardown, where torch
    # 2.13 (CPU, gloo) now and then aborts ("terminate called without an active exception") once its peers have
    # exited — seen on a 2-node run — which fails a finished job and holds the other node's torchrun in its exit
    # barrier for 5 minutes.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
