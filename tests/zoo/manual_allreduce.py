"""No DDP: the loop averages gradients by hand, one ``dist.all_reduce`` per parameter after ``loss.backward()``,
and logs a loss averaged over the ranks every step (the way tutorials and research code often do it). Variants:
zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        world = dist.get_world_size()
        torch.manual_seed(0)
        model = zc.small_model()
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def train_step(step: int) -> None:
            x, y = zc.batch(16)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            if rank == 0 and step % 4 == 0:
                print(f"step {step} loss {logged.item() / world:.4f}", flush=True)

        zc.train_loop(args, rank, train_step)


if __name__ == "__main__":
    main()
