#!/bin/sh
# gpu-watchdog: ask a job to checkpoint now, wait (bounded) for its acknowledgement, then requeue it.
# For Slurm's --signal: bash runs a trap only between commands, so the trainer must run in the background:
#   #SBATCH --signal=B:USR1@120
#   torchrun ... train.py &
#   trainer=$!
#   trap 'gpu-watchdog-preempt.sh; exit $?' USR1
#   wait "$trainer"
# With the checkpoint acknowledged it runs `scontrol requeue $SLURM_JOB_ID` (unless
# GPU_WATCHDOG_PREEMPT_REQUEUE=0), so the job comes back and resumes instead of ending FAILED on its ranks'
# exit 85. Exit status: 0 checkpointed (and requeued), 1 the daemon refused or no acknowledgement came,
# 3 checkpointed but the requeue failed. A job with neither the in-job client nor GPU_WATCHDOG_CHECKPOINT=1 (and a
# handler for recovery.checkpoint_signal) cannot be asked: the daemon refuses, this exits 1, the trap's `exit 1`
# ends the batch script and the job ends FAILED when USR1 arrives — use the trap only in jobs that opted in.
# slurmd runs a Prolog/Epilog with no PATH and only a fixed set of SLURM_* variables.
PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"; export PATH
GW="${GPU_WATCHDOG:-gpu-watchdog}"
[ -n "$SLURM_JOB_ID" ] || exit 0
"$GW" hook preempt --job-id "$SLURM_JOB_ID" --timeout "${GPU_WATCHDOG_PREEMPT_TIMEOUT:-90}" || exit 1
[ "${GPU_WATCHDOG_PREEMPT_REQUEUE:-1}" = "1" ] || exit 0
scontrol requeue "$SLURM_JOB_ID" || exit 3
exit 0
