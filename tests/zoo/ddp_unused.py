"""DDP with ``find_unused_parameters=True``: a model whose forward skips a branch on some steps (a mixture of
experts, an auxiliary head), so DDP must find the unused parameters after every forward. Variants: zoo_common."""

from __future__ import annotations

import torch
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
    with zc.process_group() as rank:
        model = DDP(TwoHeads(), find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def train_step(step: int) -> None:
            x, y = zc.batch(16)
            loss = torch.nn.functional.mse_loss(model(x, use_aux=step % 2 == 0), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        zc.train_loop(args, rank, train_step, checkpoint=(model.module, opt))


if __name__ == "__main__":
    main()
