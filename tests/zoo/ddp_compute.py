"""DDP over a compute-bound model fed by a ``DataLoader`` whose worker does the preprocessing — the shape of most
vision and speech loops. Every rank runs the same code: nothing in it says which rank is slow. Run under torchrun
(gloo, CPU, one torch thread per rank); the tests slow one rank from outside (its cgroup's CPU quota, or its
loader worker's), as a noisy neighbour or a throttled host does.

Variants (``zoo_common``): ``healthy`` trains to the end; ``eval``: rank 0 evaluates for ``--pause-s`` seconds
once, at ``--hang-step``, while its peers wait in a barrier; ``uneven``: rank ``--rank`` gets twice the data of
each of its peers every step (uneven shards: the same collectives, twice its own compute).

``--batch``: samples per rank and step (32). At 32 the step is bound by gloo's all-reduce of the 4.7 MB gradient,
not by compute: twice the data on one rank barely slows it (10.3 against 10.5 steps/s, measured) — not a straggler.
At 384 compute dominates and the rank with twice the data keeps its peers waiting."""

from __future__ import annotations

import torch
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

WIDTH = 384


class Augmented(Dataset):
    """Samples with a little CPU preprocessing each (the loader worker's work)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(WIDTH, generator=g)
        for _ in range(40):  # an augmentation pipeline's worth of arithmetic
            x = torch.tanh(x * 1.01 + 0.01)
        return x, torch.randn(WIDTH, generator=g)


def main() -> None:
    args = zc.parse_args(__doc__, more=lambda p: p.add_argument("--batch", type=int, default=32,
                                                                help="samples per rank and step"))
    torch.set_num_threads(1)
    with zc.process_group() as rank:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(WIDTH, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, WIDTH)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        per_rank = args.batch
        data = Augmented(per_rank * torch.distributed.get_world_size() * args.steps)
        loader = DataLoader(data, batch_size=per_rank, sampler=DistributedSampler(data, shuffle=False),
                            num_workers=1, persistent_workers=True, prefetch_factor=2)

        def train_step(step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            x, y = batch
            if args.variant == "uneven" and rank == args.rank:
                x, y = torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])
            for _ in range(3):  # a few micro-steps per batch: the rank's own compute
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()

        zc.train_loop(args, rank, train_step, checkpoint=(model.module, opt), batches=loader, straggler=False)


if __name__ == "__main__":
    main()
