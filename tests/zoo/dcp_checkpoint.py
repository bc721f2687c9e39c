"""DDP with ``torch.distributed.checkpoint``: every ``--ckpt-every`` steps all ranks save the model and optimizer
with DCP, alternating ``dcp.save`` and ``dcp.async_save`` (the upload runs in a background thread while training
goes on). Variants: zoo_common."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


class Checkpointer:
    """Saves the model with DCP, ``dcp.save`` and ``dcp.async_save`` in turn, one async save in flight at a time;
    the end of training (leaving it) waits for the last."""

    def __init__(self, args: argparse.Namespace, model: DDP) -> None:
        self.args, self.model, self.pending = args, model, None

    def save(self, step: int) -> None:
        state = {"model": self.model.module.state_dict(), "step": step}
        where = str(Path(self.args.workdir) / f"dcp-{step}")
        if self.pending is not None:
            self.pending.result()  # one async save in flight at a time
        if (step // self.args.ckpt_every) % 2:
            self.pending = dcp.async_save(state, checkpoint_id=where)
        else:
            dcp.save(state, checkpoint_id=where)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None and self.pending is not None:
            self.pending.result()


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        model = DDP(zc.small_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ckpt = Checkpointer(args, model)
        zc.train_loop(args, rank, zc.plain_step(model, opt), save=ckpt.save, within=ckpt)


if __name__ == "__main__":
    main()
