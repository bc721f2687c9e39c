"""A Ray Train job the way its users write it: ``TorchTrainer`` runs ``train_func`` on ``--nproc`` workers, which
wraps the model with ``ray.train.torch.prepare_model`` (DDP on gloo) and trains with ``loss.backward()``. Ray Train
sets each worker's rank in code (``os.environ``) and runs ``train_func`` on a thread of the worker. Run as
``python ray_train_ddp.py --nproc N`` (a local ``ray.init()`` cluster, the driver's child; ``RAY_ADDRESS``: a running
one). Variants: zoo_common; rank 0 saves the zoo's atomic checkpoint, a restarted driver or worker group resumes from
it. ``--max-failures N``: Ray Train's ``FailureConfig(max_failures=N)``; a fault then fires in the first worker group
only (a marker file in the work directory), as it fires in the first run only otherwise. ``--batch N``: samples per
step (16)."""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import ray_common
import zoo_common as zc


def train_func(config: dict) -> None:
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    args = argparse.Namespace(**config)
    rank = ray.train.get_context().get_world_rank()
    fired = Path(args.workdir) / "fault-fired"
    if args.max_failures:  # Ray Train restarts the worker group in the same run: the fault fires in the first only
        if fired.exists():
            args.hang_runs = 0
        elif rank == args.rank:
            fired.touch()
    # What reached this worker of the launcher's fallback settings (tests/e2e/test_ray.py).
    zc.event(args, "nccl_env", env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    torch.manual_seed(0)
    model = prepare_model(zc.small_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # --batch: samples per step (16); a larger batch makes the step compute-bound, as a real job's is
    batches = itertools.repeat(zc.batch(args.batch)) if args.batch != 16 else None
    zc.train_loop(args, rank, zc.plain_step(model, opt), checkpoint=(model.module, opt), straggler=False,
                  batches=batches)


def main() -> None:
    def more(p: argparse.ArgumentParser) -> None:
        p.add_argument("--max-failures", type=int, default=0, help="Ray Train's FailureConfig(max_failures)")
        p.add_argument("--batch", type=int, default=16, help="samples per step")

    args = zc.parse_args(__doc__, nproc=True, more=more)
    zc.event(args, "driver_start")
    ray_common.start_ray(num_cpus=args.nproc + 1)
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(train_func, train_loop_config=vars(args),
                           scaling_config=ScalingConfig(num_workers=args.nproc, use_gpu=False),
                           run_config=RunConfig(storage_path=f"{args.workdir}/ray-results",
                                                failure_config=FailureConfig(max_failures=args.max_failures)))
    trainer.fit()


if __name__ == "__main__":
    main()
