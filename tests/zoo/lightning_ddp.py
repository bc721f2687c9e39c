"""PyTorch Lightning: a ``LightningModule`` trained by ``Trainer(strategy="ddp", accelerator="cpu")`` under
torchrun (Lightning reads torchrun's environment and starts no processes of its own; ``devices`` must equal
the ranks per node), a validation loop and a
checkpoint callback. The variant's slow phase or fault is injected in ``training_step``. Variants: zoo_common."""

from __future__ import annotations

import gc
import os

import torch
import zoo_common as zc


def main() -> None:
    args = zc.parse_args(__doc__)
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = zc.small_model()

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            zc.slow_phase(args, self.global_step, self.global_rank)
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            zc.event(args, "step", step=self.global_step)
            return loss

        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(512, 64), torch.randn(512, 64))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        max_steps=args.steps,
                        val_check_interval=4, limit_val_batches=2, default_root_dir=args.workdir,
                        enable_progress_bar=False, logger=False, enable_model_summary=False)
    zc.event(args, "start", step=0)
    module = Module()
    trainer.fit(module, loader, loader)
    zc.event(args, "done")
    # Lightning leaves the gloo group to interpreter exit, where its teardown can abort (SIGABRT) on torch 2.13 CPU:
    # free DDP's Reducer first, then the group (as tests/jobs/hf_trainer.py does for the HF Trainer).
    del trainer, module
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
