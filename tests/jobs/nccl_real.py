"""An ordinary DDP job, written the way users write it, that hangs for real: NCCL on a GPU, gloo on a CPU.

    torchrun --standalone --nproc-per-node 2 tests/jobs/nccl_real.py --scenario own_code --rank-at 1 --step-at 10

The real-GPU counterpart of nccl_like.py (whose scenarios it follows). Nothing here emulates NCCL: the job is
``init_process_group(backend)``, DDP over a small MLP on ``cuda:LOCAL_RANK % device_count``, ``loss.backward()``
(DDP's bucket all-reduce), ``loss.item()`` every step and an optimizer step, with ``--hold-gib`` GiB of extra
device memory held per rank (2 on a GPU), and the in-job client (``gpu_watchdog.job.Client``, when importable)
for checkpoint-on-request and resume. ``benchmarks/nccl_gpu.py`` runs it under ``gpu-watchdog launch``.

Several ranks on one GPU (``--one-gpu``, the default when the GPUs are fewer than the ranks): before the process
group is created every rank sets ``NCCL_HOSTID`` to a value of its own (and, unless already set,
``NCCL_SOCKET_IFNAME=lo`` and ``NCCL_IB_DISABLE=1``). NCCL then treats each rank as its own host and runs real
kernels over its socket transport (shared/real-gpu/README.md): how the H200 captures were made.

``--backend gloo`` runs the same job on the CPU (device cpu, no CUDA call at all), so the whole harness can be
dry-run without a GPU. On gloo a rank waiting in a collective sleeps in a futex where an NCCL rank spins: the
verdicts of the two may differ, the mechanics are the same.

Scenarios (``--scenario``; ``--rank-at`` is the culprit, ``--step-at`` the step):
  healthy        train ``--steps`` steps and exit 0
  own_code       the culprit blocks in ``threading.Event().wait()`` before its backward (a thread it waits on died);
                 the peers go into DDP's all-reduce and then wait in ``loss.item()``
  slow_save      (healthy) rank 0 writes 64 KiB chunks, each fsync'd, with 50 ms sleeps, for ``--pause-s`` s after
                 step ``--step-at`` (slow storage); the others wait in the next step's all-reduce
  big_allreduce  (healthy) an extra ``--big-mib`` MiB all-reduce every step
  sigstop        the culprit stops itself with SIGSTOP before its backward
  desync         (3+ ranks) at step ``--step-at`` the culprit calls all_gather where the others call broadcast
  transport      at step ``--step-at`` every rank's transport stops moving bytes: the threads that carry the data
                 (NCCL's proxy "NCCL Progress"/"NCCL Sock" threads, gloo's "gloo_tcp_loop") get EAGAIN from every
                 send/recv/read/write, as from a network that went silent. A small LD_PRELOAD shim (C, built here
                 with cc; the run re-executes itself with it) does that; NCCL_SET_THREAD_NAME=1 names NCCL's threads
                 so the shim can tell them. NCCL's proxy keeps polling at full speed; gloo's loop thread is held
                 100 ms per call (else its level-triggered epoll would spin a core, which the proc backend reads as
                 progress). Every rank launched the collective, none completes: no culprit.

A fault fires only in the first ``--hang-runs`` runs (GPU_WATCHDOG_RESTART_COUNT, else TORCHELASTIC_RESTART_COUNT),
and never while the environment variable of ``--cured-by NAME=VALUE`` has that value (transport: default
``NCCL_P2P_DISABLE=1``, the agent's first fallback level), so the restarted run finishes.

``--events FILE``: JSON lines {"rank", "step", "t", "event", ...} as tests/jobs/train.py writes them: "start" (pid,
restart, armed, backend, device, the NCCL_* environment), "resume", "hang_onset" (the wall time the fault or the
slow phase began), "phase_start" (big_allreduce: the measured phase), "pause_end", "fault_blocked" (transport: the
calls the shim refused in its first 5 s; 0 means the fault did not take), "step", "checkpoint", "done".
"""

# No ``from __future__ import annotations``: DDP inspects annotations at runtime in places.
import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from job_events import checkpointing, log_event, slow_save  # beside this script

SCENARIOS = ("healthy", "own_code", "slow_save", "big_allreduce", "sigstop", "desync", "transport")
CURED_BY = {"transport": "NCCL_P2P_DISABLE=1"}
GIB, MIB = 1 << 30, 1 << 20
FAULT_LIB_ENV = "TRANSPORT_FAULT_LIB"  # set by the re-execution: the shim is preloaded (no NCCL_ name: the agent
# compares the ranks' NCCL_* settings)
GLOO_FAULT_DELAY_US = 100_000

# The transport fault: preloaded, it refuses every transfer of the transport's own threads once armed.
FAULT_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static volatile int armed = 0;
static volatile long delay_us = 0;
static long refused = 0;
static __thread int is_transport = 0;
static const char *TARGETS[] = {"NCCL Progress", "NCCL Sock", "gloo_tcp_loop", 0};

void fault_arm(long delay) { delay_us = delay; __atomic_store_n(&armed, 1, __ATOMIC_SEQ_CST); }
long fault_refused(void) { return __atomic_load_n(&refused, __ATOMIC_RELAXED); }

static int transport_thread(void) {
  if (is_transport) return 1;
  char name[17] = {0};
  if (prctl(PR_GET_NAME, name, 0, 0, 0) != 0) return 0;
  for (int i = 0; TARGETS[i]; i++)
    if (strncmp(name, TARGETS[i], strlen(TARGETS[i])) == 0) return is_transport = 1;
  return 0; /* not cached: a thread can be named after its first call */
}

static int refuse(void) {
  if (!__atomic_load_n(&armed, __ATOMIC_RELAXED) || !transport_thread()) return 0;
  __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
  if (delay_us > 0) {
    struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
    nanosleep(&ts, 0);
  }
  errno = EAGAIN;
  return 1;
}

#define WRAP(ret, name, params, args)                                        \
  typedef ret (*name##_fn) params;                                           \
  ret name params {                                                          \
    static name##_fn real;                                                   \
    if (!real) real = (name##_fn)dlsym(RTLD_NEXT, #name);                    \
    return refuse() ? -1 : real args;                                        \
  }

WRAP(ssize_t, send, (int fd, const void *b, size_t n, int fl), (fd, b, n, fl))
WRAP(ssize_t, recv, (int fd, void *b, size_t n, int fl), (fd, b, n, fl))
WRAP(ssize_t, sendmsg, (int fd, const struct msghdr *m, int fl), (fd, m, fl))
WRAP(ssize_t, recvmsg, (int fd, struct msghdr *m, int fl), (fd, m, fl))
WRAP(ssize_t, read, (int fd, void *b, size_t n), (fd, b, n))
WRAP(ssize_t, write, (int fd, const void *b, size_t n), (fd, b, n))
WRAP(ssize_t, readv, (int fd, const struct iovec *v, int n), (fd, v, n))
WRAP(ssize_t, writev, (int fd, const struct iovec *v, int n), (fd, v, n))
"""


def restart_count() -> int:
    env = os.environ
    return int(env.get("GPU_WATCHDOG_RESTART_COUNT") or env.get("TORCHELASTIC_RESTART_COUNT") or 0)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="healthy", choices=SCENARIOS)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                    help="default: nccl when CUDA is available, else gloo (gloo never touches CUDA)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-at", type=int, default=10)
    ap.add_argument("--rank-at", type=int, default=1)
    ap.add_argument("--pause-s", type=float, default=20.0, help="slow_save: how long rank 0 writes")
    ap.add_argument("--step-s", type=float, default=0.1, help="host work per step (a data loader's stand-in)")
    ap.add_argument("--big-mib", type=float, default=256.0, help="big_allreduce: size of the extra all-reduce")
    ap.add_argument("--hold-gib", type=float, default=None, help="extra device memory held per rank (2 on a GPU, "
                                                                "0 on the CPU)")
    ap.add_argument("--one-gpu", action=argparse.BooleanOptionalAction, default=None,
                    help="a distinct NCCL_HOSTID per rank (default: when this node has fewer GPUs than ranks)")
    ap.add_argument("--hang-runs", type=int, default=1, help="runs (restart count) in which the fault fires")
    ap.add_argument("--cured-by", default=None, metavar="NAME=VALUE",
                    help="the fault does not fire while env NAME is VALUE (transport: NCCL_P2P_DISABLE=1)")
    ap.add_argument("--events", default=None)
    ap.add_argument("--workdir", default=".")
    args = ap.parse_args()
    cured_by = args.cured_by or CURED_BY.get(args.scenario)
    name, _, value = (cured_by or "").partition("=")
    args.armed = (args.scenario != "healthy" and restart_count() < args.hang_runs
                  and not (name and os.environ.get(name) == value))
    return args


def host_work(seconds: float) -> None:
    """A data loader's share of a step: the host busy for ``seconds`` (plain Python, no torch threads)."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def preload_fault_shim(args: argparse.Namespace) -> None:
    """transport, armed run: build the shim and run this process again with it preloaded (same pid, so torchrun
    and the agent see nothing). A no-op once preloaded."""
    if os.environ.get(FAULT_LIB_ENV):
        return
    # One path for every rank (each builds its own copy and renames it there): the ranks' environments stay equal.
    lib = os.path.join(os.path.abspath(args.workdir), "libnccl-real-fault.so")
    tmp = f"{lib}.{os.getpid()}"
    with open(tmp + ".c", "w") as f:
        f.write(FAULT_SHIM_C)
    cp = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", tmp, tmp + ".c", "-ldl"], capture_output=True,
                        text=True)
    os.unlink(tmp + ".c")
    if cp.returncode != 0:
        raise SystemExit(f"nccl_real: building the transport fault shim failed: {cp.stderr.strip()[-600:]}")
    os.replace(tmp, lib)
    env = dict(os.environ, **{FAULT_LIB_ENV: lib, "NCCL_SET_THREAD_NAME": "1"})
    env["LD_PRELOAD"] = ":".join(p for p in (lib, os.environ.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def arm_fault_shim(args: argparse.Namespace, rank: int, step: int, gloo: bool) -> None:
    lib = ctypes.CDLL(os.environ[FAULT_LIB_ENV])  # the preloaded copy
    lib.fault_refused.restype = ctypes.c_long
    lib.fault_arm(ctypes.c_long(GLOO_FAULT_DELAY_US if gloo else 0))
    log_event(args.events, rank=rank, step=step, event="hang_onset")

    def report() -> None:
        time.sleep(5.0)
        log_event(args.events, rank=rank, step=step, event="fault_blocked", calls=int(lib.fault_refused()))

    threading.Thread(target=report, name="fault-report", daemon=True).start()


class _NoClient:
    """Stands in for gpu_watchdog.job.Client when the package is not importable."""

    def on_checkpoint(self, fn) -> None:
        pass

    def step(self, n: int) -> None:
        pass

    def training(self):
        import contextlib

        return contextlib.nullcontext(self)


def make_client():
    try:
        from gpu_watchdog.job import Client
    except ImportError:
        return _NoClient()
    return Client.from_env()


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    gloo = backend == "gloo"
    culprit = rank == args.rank_at and args.armed
    if gloo:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        count = torch.cuda.device_count()
        dev = torch.device("cuda", local_rank % count)
        torch.cuda.set_device(dev)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        one_gpu = args.one_gpu if args.one_gpu is not None else count < local_world
        if one_gpu:  # each rank its own NCCL "host": no "Duplicate GPU detected", the socket transport between them
            os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-nccl-real-rank{rank}"
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_IB_DISABLE", "1")
    dist.init_process_group(backend)

    hold_gib = args.hold_gib if args.hold_gib is not None else (0.0 if gloo else 2.0)
    held = torch.zeros(int(hold_gib * GIB), dtype=torch.uint8, device=dev) if hold_gib > 0 else None  # noqa: F841
    torch.manual_seed(0)
    # Three layers, so DDP makes two gradient buckets (its first closes at 1 MiB): two AllReduce per step, as NCCL
    # RAS counted on the H200 (a rank behind by 2).
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(dev)
    model = DDP(model) if gloo else DDP(model, device_ids=[dev.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    big = (torch.ones(int(args.big_mib * MIB) // 4, device=dev) if args.scenario == "big_allreduce" else None)
    start, save = checkpointing(args.workdir, model, opt, rank, args.events, map_location=dev)

    client = make_client()
    client.on_checkpoint(save)
    log_event(args.events, rank=rank, step=start - 1, event="start", pid=os.getpid(), host=socket.gethostname(),
              restart=restart_count(), armed=args.armed, backend=backend, device=str(dev),
              nccl={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})

    with client.training():
        for step in range(start, args.steps + 1):
            at = step == args.step_at and args.armed
            host_work(args.step_s)
            x, y = torch.randn(256, 64, device=dev), torch.randn(256, 64, device=dev)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if at and culprit and args.scenario == "own_code":
                log_event(args.events, rank=rank, step=step, event="hang_onset")
                threading.Event().wait()  # a thread it waits on died without setting it
            if at and culprit and args.scenario == "sigstop":
                log_event(args.events, rank=rank, step=step, event="hang_onset")
                os.kill(os.getpid(), signal.SIGSTOP)
            if at and args.scenario == "transport":
                arm_fault_shim(args, rank, step, gloo)
            opt.zero_grad()
            loss.backward()  # DDP's bucket all-reduces
            if big is not None:
                if step == args.step_at and rank == 0:
                    log_event(args.events, rank=rank, step=step, event="phase_start")
                dist.all_reduce(big)
            if at and args.scenario == "desync":
                t = torch.ones(4, device=dev)
                if culprit:  # a rank-dependent branch: this rank gathers where the others broadcast
                    log_event(args.events, rank=rank, step=step, event="hang_onset")
                    dist.all_gather([torch.empty_like(t) for _ in range(world)], t)
                else:
                    dist.broadcast(t, src=0 if args.rank_at != 0 else 1)
            opt.step()
            value = loss.item()  # on a GPU: the device sync where a rank waits for NCCL
            log_event(args.events, rank=rank, step=step, event="step", loss=value)
            client.step(step)
            if at and args.scenario == "slow_save" and rank == 0:
                log_event(args.events, rank=rank, step=step, event="hang_onset")
                written = slow_save(os.path.join(args.workdir, "slow-ckpt.bin"), args.pause_s)
                log_event(args.events, rank=rank, step=step, event="pause_end", bytes=written)
    if gloo:
        dist.barrier()
    else:
        dist.barrier(device_ids=[dev.index])
    log_event(args.events, rank=rank, step=args.steps, event="done")
    dist.destroy_process_group()
    return 0


def main() -> None:
    args = parse_args()
    if args.scenario == "transport" and args.armed:
        preload_fault_shim(args)
    try:
        code = run(args)
    except SystemExit as e:  # the client's exits (85: checkpointed, 86: aborted)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # a collective failed (a peer died), ...: report it and exit non-zero
        import traceback

        traceback.print_exc()
        code = 1
    # Leave without the interpreter's teardown (NCCL's and gloo's threads may still be blocked).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
