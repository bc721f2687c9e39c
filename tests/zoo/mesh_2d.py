"""A 2-D DeviceMesh, data × tensor parallel on 4 ranks (``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",
"tp"))``), with gpu-watchdog's in-job client: each step all-reduces the row-parallel activations in the rank's TP
group and the gradients in its DP group. Its own ``desync`` variant: at ``--hang-step`` rank ``--rank`` runs a TP
all_gather its TP peer skips (a rank-dependent branch): the peer goes on into the TP all_reduce, the other TP pair's
ranks wait in their DP all_reduce. Other variants: zoo_common."""

from __future__ import annotations

import torch
import torch.distributed as dist
import zoo_common as zc
from gpu_watchdog.job import Client
from torch.distributed.device_mesh import init_device_mesh


def main() -> None:
    args = zc.parse_args(__doc__)
    client = Client.from_env()
    with zc.process_group() as rank:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
        torch.manual_seed(mesh.get_local_rank("tp"))
        shard = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(shard.parameters(), lr=0.01)
        tp_dp_step = zc.tp_dp_step(shard, opt, tp, dp)

        def train_step(step: int) -> None:
            if args.variant == "desync" and step == args.hang_step and rank == args.rank and zc.fault_armed(args):
                zc.event(args, "hang_onset", step=step)
                dist.all_gather_into_tensor(torch.zeros(8), torch.ones(4), group=tp)
            tp_dp_step(step)
            client.step(step)

        with client.training():
            zc.train_loop(args, rank, train_step, handled=("desync",))


if __name__ == "__main__":
    main()
