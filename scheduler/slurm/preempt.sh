#!/bin/sh
# gpu-watchdog: ask a job to checkpoint now and wait (bounded) for its acknowledgement.
# Use from a job script trapping Slurm's --signal (e.g. #SBATCH --signal=B:USR1@120):
#   trap 'gpu-watchdog-preempt.sh' USR1
# slurmd runs a Prolog/Epilog with no PATH and only a fixed set of SLURM_* variables.
PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"; export PATH
GW="${GPU_WATCHDOG:-gpu-watchdog}"
[ -n "$SLURM_JOB_ID" ] || exit 0
exec "$GW" hook preempt --job-id "$SLURM_JOB_ID" --timeout "${GPU_WATCHDOG_PREEMPT_TIMEOUT:-90}"
