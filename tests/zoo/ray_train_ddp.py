"""A Ray Train job the way its users write it: ``TorchTrainer`` runs ``train_func`` on ``--nproc`` workers, which
wraps the model with ``ray.train.torch.prepare_model`` (DDP on gloo) and trains with ``loss.backward()``. Ray Train
sets each worker's rank in code (``os.environ``) and runs ``train_func`` on a thread of the worker. Run as
``python ray_train_ddp.py --nproc N`` (a local ``ray.init()`` cluster, the driver's child). Variants: zoo_common;
rank 0 saves the zoo's atomic checkpoint, a restarted driver resumes from it."""

from __future__ import annotations

import argparse
import os

import ray_common
import zoo_common as zc


def train_func(config: dict) -> None:
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    args = argparse.Namespace(**config)
    rank = ray.train.get_context().get_world_rank()
    # What reached this worker of the launcher's fallback settings (tests/e2e/test_ray.py).
    zc.event(args, "nccl_env", env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    torch.manual_seed(0)
    model = prepare_model(zc.small_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    zc.train_loop(args, rank, zc.plain_step(model, opt), checkpoint=(model.module, opt), straggler=False)


def main() -> None:
    args = zc.parse_args(__doc__, nproc=True)
    ray_common.start_ray(num_cpus=args.nproc + 1)
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(train_func, train_loop_config=vars(args),
                           scaling_config=ScalingConfig(num_workers=args.nproc, use_gpu=False),
                           run_config=RunConfig(storage_path=f"{args.workdir}/ray-results"))
    trainer.fit()


if __name__ == "__main__":
    main()
