"""A custom training loop over ``DataLoader(num_workers=2, persistent_workers=True)`` with a
``DistributedSampler``: batches come from worker processes. Extra variant ``dead_worker``: a worker of rank
``--rank`` stops (SIGSTOP) while producing the hang step's batch (a worker wedged on a dead mount); the rank's main
thread then waits on its queue — or on a batch's shared memory the wedged worker was still handing over — forever
(DataLoader's liveness check sees a live worker). Other variants: zoo_common."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Shards(Dataset):
    def __init__(self, n: int, stop_at: int | None, args: object = None) -> None:
        self.n, self.stop_at, self.args = n, stop_at, args

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stop_at is not None and i >= self.stop_at:
            zc.event(self.args, "hang_onset", step=-1)  # type: ignore[arg-type]  # the rank waits on it from now
            os.kill(os.getpid(), signal.SIGSTOP)  # a worker wedged on a dead mount
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), torch.randn(64, generator=g)


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        world = dist.get_world_size()
        per_step = 8
        wedge = args.variant == "dead_worker" and rank == args.rank and zc.fault_armed(args)
        data = Shards(per_step * world * args.steps, per_step * world * args.hang_step if wedge else None, args)
        loader = DataLoader(data, batch_size=per_step, num_workers=2, persistent_workers=True,
                            sampler=DistributedSampler(data, shuffle=False))
        model = DDP(zc.small_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        zc.train_loop(args, rank, zc.plain_step(model, opt), batches=loader)


if __name__ == "__main__":
    main()
