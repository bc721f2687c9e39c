"""FSDP2 with sharded checkpoints: fsdp2.py's model, sharded with ``fully_shard``, saved every ``--ckpt-every``
steps with ``torch.distributed.checkpoint`` from ``get_model_state_dict`` (every rank writes its own shards: a
collective save). Variants: zoo_common."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import zoo_common as zc
from fsdp2 import sharded_model
from torch.distributed.checkpoint.state_dict import get_model_state_dict


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        model = sharded_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def save(step: int) -> None:  # every rank writes its own shards
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(Path(args.workdir) / f"step-{step}"))

        zc.train_loop(args, rank, zc.plain_step(model, opt, zero_grad_last=True), save=save)


if __name__ == "__main__":
    main()
