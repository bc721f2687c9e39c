"""DDP with ``find_unused_parameters=True``: a model whose forward skips a branch on some steps (a mixture of
experts, an auxiliary head), so DDP must find the unused parameters after every forward. Variants: zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = zc.small_model()
        self.aux = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = self.body(x)
        return self.aux(h) if use_aux else h


def main() -> None:
    args = zc.parse_args(__doc__)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(TwoHeads(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = zc.load_checkpoint(args, model.module, opt)
    zc.event(args, "start", step=start)
    for step in range(start, args.steps):
        zc.slow_phase(args, step, rank)
        x, y = zc.batch(16)
        loss = torch.nn.functional.mse_loss(model(x, use_aux=step % 2 == 0), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        zc.straggle(args, rank)
        if step % args.ckpt_every == 0 and rank == 0:
            zc.save_checkpoint(args, model.module, opt, step)
        zc.step_done(args, step)
    zc.event(args, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
