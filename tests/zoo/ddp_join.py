"""DDP with uneven inputs: each rank has a different number of batches and the loop runs under
``Join([model])``, so ranks that run out shadow the others' collectives instead of hanging. Variants:
zoo_common."""

from __future__ import annotations

import torch
import zoo_common as zc
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group(timeout_s=args.pg_timeout_s) as rank:
        model = DDP(zc.small_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        my_steps = args.steps + rank  # uneven: rank r has r more batches
        zc.train_loop(args, rank, zc.plain_step(model, opt), steps=my_steps, within=Join([model]))


if __name__ == "__main__":
    main()
