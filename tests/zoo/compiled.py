"""DDP over a ``torch.compile``d model: the first step compiles (a long, silent, CPU-bound pause on every rank),
the rest run the compiled graph. Variant ``compile_warmup`` is the healthy run itself (the onset event marks the
start of the first step). Other variants: zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = zc.parse_args(__doc__)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.compile(DDP(zc.small_model()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    zc.event(args, "start", step=0)
    for step in range(args.steps):
        if step == 0 and args.variant == "compile_warmup":
            zc.event(args, "hang_onset", step=0)
        zc.slow_phase(args, step, rank)
        x, y = zc.batch(16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        zc.straggle(args, rank)
        zc.step_done(args, step)
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
