"""PyTorch Lightning with ``Trainer(strategy="ddp_spawn", accelerator="cpu", devices=N)``, run as a plain
``python lightning_ddp_spawn.py --nproc N``: Lightning spawns the ranks itself (``torch.multiprocessing``) and hands
each its rank in code, so no process carries ``RANK`` in its environment. A validation loop and Lightning's
checkpoint callback; the variant's slow phase or fault is injected in ``training_step``. Variants: zoo_common."""

from __future__ import annotations

import argparse
import atexit
import gc

import lightning as L
import torch
import zoo_common as zc


class Module(L.LightningModule):
    """At module level, with its arguments as state: ddp_spawn pickles it into every rank."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = zc.small_model()

    def on_fit_start(self) -> None:
        zc.event(self.args, "start", step=0)
        # ddp_spawn leaves each rank's gloo group to its interpreter's exit, where torch 2.13 CPU's teardown can abort
        # (SIGABRT, "terminate called without an active exception": PyTorch's, docs/evidence.md; CI saw it end both
        # rows of this program under load). Destroy it first, at the rank's exit, as lightning_ddp.py does after fit.
        # --leave-group keeps Lightning's own behaviour (benchmarks/bench_teardown_abort.py measures its abort rate).
        if not self.args.leave_group:
            atexit.register(_destroy_group)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        zc.slow_phase(self.args, self.global_step, self.global_rank)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        zc.event(self.args, "step", step=self.global_step)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_fit_end(self) -> None:
        zc.event(self.args, "done")

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _destroy_group() -> None:
    gc.collect()  # DDP's Reducer first, then the group
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    args = zc.parse_args(__doc__, nproc=True, more=lambda p: p.add_argument(
        "--leave-group", action="store_true", help="leave each rank's group to interpreter exit, as Lightning does"))
    data = torch.utils.data.TensorDataset(torch.randn(512, 64), torch.randn(512, 64))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = L.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=args.nproc, max_steps=args.steps,
                        val_check_interval=4, limit_val_batches=2, default_root_dir=args.workdir,
                        enable_progress_bar=False, logger=False, enable_model_summary=False)
    trainer.fit(Module(args), loader, loader)


if __name__ == "__main__":
    main()
