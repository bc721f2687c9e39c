"""Mixture of experts, expert parallel (one expert per rank): each step every rank routes its 16 tokens top-1 to the
experts — unevenly, as a router does — tells each expert how many it sends (``all_to_all_single`` of the counts),
sends them with ``all_to_all_single`` and uneven split sizes, runs its own expert on what it received and sends the
outputs back the same way. Its own ``slow_expert`` variant (healthy): at ``--hang-step`` rank ``--rank``'s expert
computes for ``--pause-s`` seconds before the exchange (a hot expert), its peers waiting in the all_to_all. Other
variants: zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc


def main() -> None:
    args = zc.parse_args(__doc__)
    with zc.process_group() as rank:
        world = dist.get_world_size()
        torch.manual_seed(0)
        router = torch.nn.Linear(64, world)  # the same router on every rank
        torch.manual_seed(100 + rank)
        expert = zc.small_model()
        opt = torch.optim.SGD(expert.parameters(), lr=0.01)

        def train_step(step: int) -> None:
            torch.manual_seed(1000 * rank + step)
            x = torch.randn(16, 64)
            with torch.no_grad():
                dest = router(x).argmax(-1)
            x = x[dest.argsort(stable=True)]
            send = torch.bincount(dest, minlength=world)
            recv = torch.empty_like(send)
            if args.variant == "slow_expert" and step == args.hang_step and rank == args.rank:
                zc.event(args, "hang_onset", step=step)
                zc.evaluate(args.pause_s)
            dist.all_to_all_single(recv, send)
            tokens = torch.empty(int(recv.sum()), 64)
            dist.all_to_all_single(tokens, x, output_split_sizes=recv.tolist(), input_split_sizes=send.tolist())
            out = expert(tokens)
            if len(tokens):
                out.pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            back = torch.empty(16, 64)
            dist.all_to_all_single(back, out.detach(), output_split_sizes=send.tolist(),
                                   input_split_sizes=recv.tolist())

        zc.train_loop(args, rank, train_step, handled=("slow_expert",))


if __name__ == "__main__":
    main()
