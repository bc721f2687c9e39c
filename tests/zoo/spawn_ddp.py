"""The PyTorch DDP tutorial's shape: ``mp.spawn(demo_basic, args=(world_size,), nprocs=world_size)``, each process
sets ``MASTER_ADDR``/``MASTER_PORT`` in its own ``os.environ`` and calls ``init_process_group("gloo", rank=rank,
world_size=world_size)``. No process carries ``RANK`` (or any torchrun variable) in the environment it started with:
the rank lives only in the code. Run as ``python spawn_ddp.py --nproc N`` (no torchrun). Variants: zoo_common."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def demo_basic(rank: int, world_size: int, port: int, args) -> None:  # type: ignore[no-untyped-def]
    setup(rank, world_size, port)
    torch.manual_seed(0)
    model = DDP(zc.small_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    zc.train_loop(args, rank, zc.plain_step(model, opt), checkpoint=(model.module, opt), straggler=False)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main() -> None:
    args = zc.parse_args(__doc__, nproc=True)
    mp.spawn(demo_basic, args=(args.nproc, free_port(), args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
