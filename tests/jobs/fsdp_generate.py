"""The FSDP/ZeRO-3 ``generate()`` hang, for real: FSDP2 (``fully_shard``) on a tiny transformers causal LM, each
rank decodes a different number of tokens with ``synced_gpus=False``, then calls ``dist.barrier()``.

    torchrun --standalone --nproc-per-node 3 tests/jobs/fsdp_generate.py --events /tmp/ev.jsonl

Every forward step all-gathers each FSDP unit's parameters. Rank r decodes ``--base-tokens + --tokens-per-rank * r``
tokens, so the rank that finishes first (rank 0) enters barrier() while the others block in FSDP's all-gather
for their next decoding step: a collective mismatch (gloo: both sides wait forever, no timeout is hit before
``--pg-timeout-s``, default one day).

``--synced-gpus`` passes ``synced_gpus=True`` (the fix): every rank keeps running forward until all are done,
and the job exits 0.

Events (``--events FILE``, JSON lines {"rank", "step", "t", "event"}): "start" (with "pid") after
init_process_group, "generate_start", "hang_onset" when a rank has finished generate() (just before barrier),
"done" after the barrier (never reached without ``--synced-gpus``).
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from job_events import log_event  # beside this script


def build_model(arch: str) -> Any:
    """A tiny randomly initialised causal LM from a config (no weights are downloaded)."""
    torch.manual_seed(0)  # identical init on every rank
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        llama_cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return LlamaForCausalLM(llama_cfg)
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg)


def shard(model: Any) -> None:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # older torch
        from torch.distributed._composable.fsdp import fully_shard
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    ap.add_argument("--base-tokens", type=int, default=4)
    ap.add_argument("--tokens-per-rank", type=int, default=4, help="rank r decodes base + r * this many tokens")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--synced-gpus", action="store_true", help="the fix: generate(synced_gpus=True)")
    ap.add_argument("--pg-timeout-s", type=float, default=86400.0)
    ap.add_argument("--events", default=None)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank = dist.get_rank()
    log_event(args.events, rank=rank, step=0, event="start", pid=os.getpid())

    model = build_model(args.arch)
    model.eval()
    shard(model)

    new_tokens = args.base_tokens + args.tokens_per_rank * rank
    g = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(3, 128, (1, args.prompt_len), generator=g)
    log_event(args.events, rank=rank, step=0, event="generate_start", new_tokens=new_tokens)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             synced_gpus=args.synced_gpus)
    generated = out.shape[1] - args.prompt_len
    log_event(args.events, rank=rank, step=generated, event="hang_onset", generated=generated)
    dist.barrier()
    log_event(args.events, rank=rank, step=generated, event="done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
