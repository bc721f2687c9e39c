"""A Hugging Face ``Trainer`` run (accelerate and DDP underneath, gloo on CPU): a tiny GPT-2 from a config, a
synthetic token dataset, evaluation and checkpoint saves every 4 steps. The variant's slow phase or fault is
injected from a ``TrainerCallback`` at ``--hang-step`` (the way users hook into the loop). Variants: zoo_common."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
import zoo_common as zc


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.data = torch.randint(3, 128, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main() -> None:
    args = zc.parse_args(__doc__)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Inject(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):  # type: ignore[no-untyped-def]
            zc.slow_phase(args, state.global_step, dist.get_rank())

        def on_step_end(self, targs, state, control, **kw):  # type: ignore[no-untyped-def]
            zc.event(args, "step", step=state.global_step)

    targs = TrainingArguments(output_dir=args.workdir, max_steps=args.steps, per_device_train_batch_size=4,
                              per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=4,
                              save_strategy="steps", save_steps=4, logging_steps=4, report_to=[], use_cpu=True,
                              ddp_backend="gloo", disable_tqdm=True)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(256), eval_dataset=Tokens(24),
                      callbacks=[Inject()])
    zc.event(args, "start", step=0)
    trainer.train()
    zc.event(args, "done")
    del trainer, model  # DDP's Reducer holds the gloo group: free it before the group (see tests/jobs/hf_trainer.py)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
