"""DDP over a ``torch.compile``d model: the first step compiles (a long, silent, CPU-bound pause on every rank),
the rest run the compiled graph. Variant ``compile_warmup`` is the healthy run itself (the onset event marks the
start of the first step). Other variants: zoo_common."""

from __future__ import annotations

import torch
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        model = torch.compile(DDP(zc.small_model()))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        plain = zc.plain_step(model, opt)

        def train_step(step: int) -> None:
            if step == 0 and args.variant == "compile_warmup":
                zc.event(args, "hang_onset", step=0)  # the first step compiles
            plain(step)

        zc.train_loop(args, rank, train_step)


if __name__ == "__main__":
    main()
