"""A healthy Hugging Face ``transformers.Trainer`` run under torchrun (DDP on gloo, CPU): a tiny GPT-2 built from
a config, a synthetic token dataset, periodic evaluation and checkpoint saves, two dataloader workers per rank.

    torchrun --standalone --nproc-per-node 3 tests/jobs/hf_trainer.py --output-dir /tmp/hf-out --events /tmp/ev.jsonl

It finishes with exit 0. Its quiet phases are real ones: evaluation (ranks run eval forward passes, then
gather), checkpoint saves (rank 0 writes safetensors/optimizer state while the others wait in a barrier),
dataloader worker start-up at every epoch and evaluation.

``--teardown`` (how the script ends after ``trainer.train()``):
  release  (default) drop the Trainer and model (and with them DDP's Reducer), gc, then barrier() and
           destroy_process_group(): exits 0.
  barrier  barrier() and destroy_process_group() with the Trainer still alive. Seen to hang at exit (2 of 3 runs,
           torch 2.13 CPU, gloo): when main() returns, freeing DDP's Reducer drops the last reference to the gloo
           process group; ~ProcessGroupGloo joins its pt_gloo_runloop thread while holding the GIL, and that
           thread waits for the GIL to free a finished work's tensors. The "exit" event is logged, the process never
           exits (rank 0 main thread: std::thread::join in ~ProcessGroupGloo under pybind11_object_dealloc).
  none     neither: the process group is left to interpreter exit.

Every rank appends JSON lines to ``--events FILE``: {"rank", "step", "t", "event"}: "start" (with "pid") after
the process group is up, "eval" / "save" when the Trainer evaluates / saves (from a TrainerCallback), "done"
after train() returns, "exit" after the teardown.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from job_events import log_event  # beside this script


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic random token sequences; labels = input_ids (causal LM loss)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(3, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--steps", type=int, default=40, help="max_steps")
    ap.add_argument("--eval-steps", type=int, default=10)
    ap.add_argument("--save-steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4, help="per-device batch size")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--train-size", type=int, default=256)
    ap.add_argument("--eval-size", type=int, default=48)
    ap.add_argument("--workers", type=int, default=2, help="dataloader_num_workers")
    ap.add_argument("--teardown", default="release", choices=["release", "barrier", "none"],
                    help="how to end: see the module docstring")
    ap.add_argument("--events", default=None)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    # TrainingArguments sets the process group up itself (gloo on CPU); build it first so we can log "start".
    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        logging_steps=args.eval_steps,
        dataloader_num_workers=args.workers,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
    )
    _ = targs.device  # initialises torch.distributed under torchrun
    rank = dist.get_rank() if dist.is_initialized() else 0
    log_event(args.events, rank=rank, step=0, event="start", pid=os.getpid(),
              distributed=dist.is_initialized(), world_size=dist.get_world_size() if dist.is_initialized() else 1)

    class Events(TrainerCallback):
        def on_evaluate(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            log_event(args.events, rank=rank, step=state.global_step, event="eval")

        def on_save(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            log_event(args.events, rank=rank, step=state.global_step, event="save")

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=args.seq_len,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = GPT2LMHeadModel(cfg)
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=TokenDataset(args.train_size, args.seq_len, cfg.vocab_size, seed=1),
        eval_dataset=TokenDataset(args.eval_size, args.seq_len, cfg.vocab_size, seed=2),
        callbacks=[Events()],
    )
    result = trainer.train()
    log_event(args.events, rank=rank, step=result.global_step, event="done", loss=result.training_loss)
    if args.teardown == "release":
        del trainer, model
        gc.collect()
    if dist.is_initialized() and args.teardown != "none":
        dist.barrier()
        dist.destroy_process_group()
    log_event(args.events, rank=rank, step=result.global_step, event="exit")


if __name__ == "__main__":
    main()
