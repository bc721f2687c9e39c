"""A real 4-rank gloo job with a 2x2 TP x DP layout (``dist.new_group``) that hangs in a SUB-group, for tests.

    TORCH_FR_BUFFER_SIZE=200 TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/trace_ TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/tmp/fr/pipe_ \
        torchrun --standalone --nproc-per-node 4 tests/jobs/groups.py --scenario missing --rank-at 1

Groups: TP = {0,1}, {2,3}; DP = {0,2}, {1,3}. Each step: an all_reduce in the rank's TP group, then one in its DP
group. At step ``--step-at`` rank ``--rank-at`` (the fault) does, by ``--scenario``:
  healthy   nothing: ``--steps`` steps, then every rank waits (idle, nothing in flight) to be dumped and killed
  slow      waits ``--pause-s`` seconds (a long data load) before its TP all_reduce, then goes on (slow, not hung)
  missing   never enters its TP all_reduce (sleeps forever); its peers block, and ranks behind them block too
  chain     never enters its DP all_reduce: its DP peer blocks there, and through it the TP peers of both
  mismatch  calls all_gather instead of its TP all_reduce, at the same sequence id as its TP peer. Gloo aborts
            the job when the byte counts on the wire disagree (a size mismatch: ``gloo::EnforceNotMet``), so the
            gather is sized to match the all_reduce's first ring exchange: the gatherer completes and goes on, its
            peer waits in the all_reduce for an exchange that never comes
  p2p       sends a tensor to its TP peer, which never receives it (the peer goes on to its TP all_reduce and
            waits there for the sender). Gloo records no send/recv in the Flight Recorder (torch 2.13): the dumps
            show the sender missing from the TP all_reduce, blocked on nobody
Every rank serves Flight Recorder dumps on a FIFO (train.py's ``--fr-pipe`` helper) and logs JSON events
("start" with its pid, "step", "hang_onset") to ``--events``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from job_events import compute, log_event  # beside this script
from train import start_fr_pipe  # beside this script


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
    t = torch.ones(128)
    for step in range(1, args.steps + 1):
        at = step == args.step_at
        compute(args.step_s)
        if at and fault and args.scenario != "healthy":
            log_event(args.events, rank=rank, step=step, event="hang_onset")
            if args.scenario == "p2p":
                dist.send(torch.ones(8), dst=tp_peer, group=tp)  # its peer never receives it
            if args.scenario == "missing":
                while True:
                    time.sleep(3600)
            if args.scenario == "slow":
                time.sleep(args.pause_s)  # a long data load: slow, not hung (and its FR helper thread can run)
            if args.scenario == "mismatch":  # 2 x 64 floats: the 256-byte chunks of a 128-float ring all_reduce
                dist.all_gather([torch.ones(64), torch.ones(64)], torch.ones(64), group=tp)
        if not (at and fault and args.scenario == "mismatch"):
            dist.all_reduce(t, group=tp)
        if at and fault and args.scenario == "chain":
            while True:
                time.sleep(3600)
        dist.all_reduce(t, group=dp)
        log_event(args.events, rank=rank, step=step, event="step")
    log_event(args.events, rank=rank, step=args.steps, event="done")
    while True:  # stay alive, nothing in flight, until the test has dumped and killed the job
        time.sleep(3600)


if __name__ == "__main__":
    main()
