"""Plain DDP, written the way most users write it: a model wrapped in DistributedDataParallel, loss.backward(),
an optimizer step, a checkpoint every few steps on rank 0, and a background prefetch thread that reads the
next batch. Run under torchrun (gloo, CPU).

Variants (``--variant``; ``zoo_common.HEALTHY`` and ``zoo_common.FAULTS`` say which are healthy):
  healthy        train to the end
  poll           every rank waits for its next shard with ``while not os.path.exists(...): time.sleep(2)``;
                 the shard appears ``--pause-s`` seconds later (a healthy slow phase)
  slow_reader    every rank reads its next shard from a local data service that sends 1 KiB every 2 s
  slow_save      rank 0 writes its checkpoint slowly (1 MiB chunks with fsync, ``--pause-s`` seconds)
  eval           rank 0 evaluates for ``--pause-s`` seconds while its peers wait in a barrier
  straggler      rank 1 runs every step 2x slower than the others
  event_wait     rank 2's prefetch thread dies: its main thread blocks for good in threading.Event.wait()
  desync         rank 1 calls all_gather where the others call broadcast (a rank-dependent branch)
  busy           rank 2 spins in ``while True: pass`` (endless compute in user code)
  recv           rank 2 blocks for good in socket.recv() on a data service that never answers
  crash          rank 2 raises at the hang step
  sigstop        rank 2 stops itself with SIGSTOP
"""

from __future__ import annotations

import threading

import torch
import zoo_common as zc
from torch.nn.parallel import DistributedDataParallel as DDP


class Prefetcher:
    """A background thread that produces the next batch (as many training loops do)."""

    def __init__(self, make_batch, die_at: int | None, on_death=lambda step: None) -> None:
        self.make_batch, self.die_at, self.on_death = make_batch, die_at, on_death
        self.ready, self.want = threading.Event(), threading.Event()
        self.batch = None
        self.step = 0
        threading.Thread(target=self._run, daemon=True, name="prefetch").start()

    def _run(self) -> None:
        while True:
            self.want.wait()
            self.want.clear()
            if self.die_at is not None and self.step >= self.die_at:
                return  # the thread dies (an exception swallowed by a bare except in real code)
            self.batch = self.make_batch()
            self.ready.set()

    def next(self, step: int):
        if step == self.die_at:
            self.on_death(step)  # the batch it asks for never comes
        self.step = step
        self.want.set()
        self.ready.wait()
        self.ready.clear()
        return self.batch


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group(timeout_s=args.pg_timeout_s) as rank:
        torch.manual_seed(0)
        model = DDP(zc.small_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        dies = args.variant == "event_wait" and rank == args.rank and zc.fault_armed(args)
        die_at = args.hang_step if dies else None
        prefetch = Prefetcher(lambda: zc.batch(16), die_at, lambda step: zc.event(args, "hang_onset", step=step))

        def train_step(step: int) -> None:
            x, y = prefetch.next(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.variant == "desync" and step == args.hang_step and zc.fault_armed(args):
                zc.event(args, "hang_onset", step=step)
                zc.desync(args, rank)  # all_gather on rank --rank, broadcast on the others

        # event_wait and desync are injected above; poll, slow_reader, eval, busy, recv … by zoo_common
        zc.train_loop(args, rank, train_step, checkpoint=(model.module, opt), handled=("event_wait", "desync"))


if __name__ == "__main__":
    main()
