"""The RLHF frameworks' shape (OpenRLHF, veRL): a driver creates ``--nproc`` ``@ray.remote`` actors, each forms the
process group itself (``init_process_group("gloo", rank=rank, …)`` in ``__init__``) and the driver calls their
``train`` method and waits with ``ray.get``. ``--style repr``: the actor's ``__repr__`` names its rank, as Ray's docs
advise for telling actors apart in logs; ``--style environ``: OpenRLHF's way, the rank only in ``os.environ`` and
``init_process_group`` from it (``env://``), no ``__repr__``; ``--style opaque``: the rank only in the actor's own
attribute, handed to ``init_process_group`` as an argument, and the actor's own training loop (no frame names a
rank): nothing outside the job can tell its number. Run as ``python ray_actor_group.py --nproc N`` (a local
``ray.init()`` cluster). Variants: zoo_common (``desync``: rank ``--rank`` calls all_gather where the others
broadcast; ``crash`` … ), plus ``killed``: actor ``--rank`` is SIGKILLed mid-step, as the OOM killer does — at
``--hang-step``, or with ``--kill-after-s S`` S seconds after its process group formed (early: before anything outside
may have learned its rank)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time

import ray_common
import zoo_common as zc


class Trainer:
    def __init__(self, index: int, world_size: int, port: int, config: dict) -> None:
        import torch
        import torch.distributed as dist

        self.rank = index  # (not called rank: py-spy's locals would name it while __init__ runs)
        self.args = argparse.Namespace(**config)
        if self.args.style == "environ":  # OpenRLHF's DistributedTorchRayActor: the rank in os.environ, env://
            os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(world_size),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
                                    world_size=world_size)
        if self.args.variant == "killed" and self.args.kill_after_s is not None and index == self.args.rank \
                and zc.fault_armed(self.args):
            threading.Thread(target=self._killed_after, args=(self.args.kill_after_s,), daemon=True).start()
        torch.manual_seed(0)
        self.model = zc.small_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def _killed_after(self, seconds: float) -> None:
        time.sleep(seconds)
        zc.event(self.args, "hang_onset", step=-1)
        os.kill(os.getpid(), signal.SIGKILL)

    def __repr__(self) -> str:
        return f"Trainer(rank={self.rank})" if self.args.style == "repr" else super().__repr__()

    def _step(self, step: int) -> None:
        import torch
        import torch.distributed as dist

        if self.args.variant == "killed" and self.args.kill_after_s is None and self.rank == self.args.rank \
                and step == self.args.hang_step and zc.fault_armed(self.args):
            zc.event(self.args, "hang_onset", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = zc.batch(16)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        for p in self.model.parameters():  # the gradient all-reduce a framework does by hand
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.opt.step()

    def train(self) -> None:
        if self.args.style != "opaque":
            zc.train_loop(self.args, self.rank, self._step, checkpoint=(self.model, self.opt), straggler=False)
            return
        zc.event(self.args, "start", step=0)  # a framework's own loop: the rank lives in self alone
        for step in range(self.args.steps):
            zc.slow_phase(self.args, step, self.rank)
            self._step(step)
            zc.step_done(self.args, step)
        zc.event(self.args, "done")


def _own_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--style", choices=("repr", "environ", "opaque"), default="repr",
                   help="repr: the rank handed to init_process_group and named by __repr__; environ: set in os.environ "
                        "only; opaque: in the actor's attribute only")
    p.add_argument("--kill-after-s", type=float, default=None,
                   help="killed: SIGKILL actor --rank this long after its process group formed (not at --hang-step)")


def main() -> None:
    args = zc.parse_args(__doc__, nproc=True, more=_own_args)
    ray_common.start_ray(num_cpus=args.nproc)
    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    actor = ray.remote(num_cpus=1)(Trainer)
    group = [actor.remote(r, args.nproc, port, vars(args)) for r in range(args.nproc)]
    ray.get([a.train.remote() for a in group])


if __name__ == "__main__":
    main()
