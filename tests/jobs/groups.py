"""A real 4-rank gloo job with a 2x2 TP x DP layout (``dist.new_group``) that hangs in a SUB-group, for tests.

    TORCH_FR_BUFFER_SIZE=200 TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/trace_ TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/tmp/fr/pipe_ \
        torchrun --standalone --nproc-per-node 4 tests/jobs/groups.py --scenario missing --rank-at 1

Groups: TP = {0,1}, {2,3}; DP = {0,2}, {1,3}. Each step: an all_reduce in the rank's TP group, then one in its DP
group. At step ``--step-at`` rank ``--rank-at`` (the fault) does, by ``--scenario``:
  healthy   nothing: ``--steps`` steps, then every rank waits (idle, nothing in flight) to be dumped and killed
  slow      waits ``--pause-s`` seconds (a long data load) before its TP all_reduce, then goes on (slow, not hung)
  missing   never enters its TP all_reduce (blocked for good); its peers block, and ranks behind them block too
  chain     never enters its DP all_reduce: its DP peer blocks there, and through it the TP peers of both
  mismatch  calls all_gather instead of its TP all_reduce, at the same sequence id as its TP peer (gloo aborts
            the job on a plain size mismatch, ``gloo::EnforceNotMet``; an op mismatch hangs instead)
  p2p       sends a tensor to its TP peer, which never receives it (the peer goes on to its TP all_reduce and
            waits there for the sender). Gloo records no send/recv in the Flight Recorder (torch 2.13): the dumps
            show the sender missing from the TP all_reduce, blocked on nobody
``--functional`` issues every collective through functional collectives and blocks in ``wait_tensor``: every rank
of a hung job then shows the same stack (as NCCL ranks all busy-wait in the same device sync), so only the Flight
Recorder can tell them apart. With it, the mismatching all_gather completes against the first exchange of its
peer's all_reduce and the gatherer runs on until its next TP all_reduce.
Every rank serves Flight Recorder dumps on a FIFO (train.py's ``--fr-pipe`` helper) and logs JSON events
("start" with its pid, "step", "hang_onset") to ``--events``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from job_events import compute, log_event  # beside this script
from train import start_fr_pipe  # beside this script


def all_reduce(group: dist.ProcessGroup, functional: bool) -> None:
    t = torch.ones(128)
    if functional:
        funcol.wait_tensor(funcol.all_reduce(t, "sum", group))
    else:
        dist.all_reduce(t, group=group)


def all_gather(group: dist.ProcessGroup, functional: bool) -> None:
    """2 x 64 floats: the byte count of a 128-float all_reduce's ring chunks (a size mismatch would abort gloo)."""
    t = torch.ones(64)
    if functional:
        funcol.wait_tensor(funcol.all_gather_tensor(t, 0, group))
    else:
        dist.all_gather([torch.empty(64), torch.empty(64)], t, group=group)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="healthy", choices=["healthy", "slow", "missing", "chain", "mismatch", "p2p"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--step-at", type=int, default=2)
    ap.add_argument("--rank-at", type=int, default=1)
    ap.add_argument("--pause-s", type=float, default=20.0)
    ap.add_argument("--step-s", type=float, default=0.0, help="compute time per step")
    ap.add_argument("--events", default=None)
    ap.add_argument("--workdir", default=".")
    ap.add_argument("--functional", action="store_true", help="functional collectives, blocking in wait_tensor")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "the 2x2 layout needs 4 ranks"
    fr_ready = start_fr_pipe(rank)
    # Every rank creates every group, in the same order (new_group is collective over the default group).
    tp_groups = [dist.new_group([0, 1], group_desc="tp"), dist.new_group([2, 3], group_desc="tp")]
    dp_groups = [dist.new_group([0, 2], group_desc="dp"), dist.new_group([1, 3], group_desc="dp")]
    tp, dp = tp_groups[rank // 2], dp_groups[rank % 2]
    tp_peer = rank ^ 1
    fr_ready.wait(120)  # a dump asked for during the steps comes at once, as NCCL's would
    log_event(args.events, rank=rank, step=0, event="start", pid=os.getpid())
    fault = rank == args.rank_at
    for step in range(1, args.steps + 1):
        at = step == args.step_at
        compute(args.step_s)
        if at and fault and args.scenario != "healthy":
            log_event(args.events, rank=rank, step=step, event="hang_onset")
            if args.scenario == "p2p":
                dist.send(torch.ones(8), dst=tp_peer, group=tp)  # its peer never receives it
            if args.scenario == "missing":
                threading.Event().wait()  # blocked for good, no timeout (a sleep would be a slow rank, not a hung one)
            if args.scenario == "slow":
                time.sleep(args.pause_s)  # a long data load: slow, not hung (and its FR helper thread can run)
            if args.scenario == "mismatch":
                all_gather(tp, args.functional)
        if not (at and fault and args.scenario == "mismatch"):
            all_reduce(tp, args.functional)
        if at and fault and args.scenario == "chain":
            threading.Event().wait()
        all_reduce(dp, args.functional)
        log_event(args.events, rank=rank, step=step, event="step")
    log_event(args.events, rank=rank, step=args.steps, event="done")
    while True:  # stay alive, nothing in flight, until the test has dumped and killed the job
        time.sleep(3600)


if __name__ == "__main__":
    main()
