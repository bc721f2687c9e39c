#!/bin/sh
# gpu-watchdog Slurm TaskProlog: register the task with the node daemon and hand it the job's fallback env.
# Install: TaskProlog=/etc/slurm/gpu-watchdog-task-prolog.sh in slurm.conf. slurmstepd runs it as the job's
# user, with the job's environment, just before each task starts (the batch script, every srun task); its
# parent ($PPID) is the task's own process, which then execs the task. Its stdout is Slurm's TaskProlog
# protocol: "export NAME=VALUE" sets the task's environment, "print TEXT" goes to the task's stdout.
# Per-job settings come from the job's environment (sbatch --export, or the submitting shell):
#   GPU_WATCHDOG_RESTART_HOOK  a [hooks.NAME] of the daemon's config (default slurm-requeue)
#   GPU_WATCHDOG_CHECKPOINT=1  the job opts in to the checkpoint signal
#   GPU_WATCHDOG=/path/to/gpu-watchdog  when it is not on the job's PATH
#   GPU_WATCHDOG_CONFIG  the daemon's config (default /etc/gpu-watchdog/config.toml, when readable): its socket,
#                        and for a multi-node job with fallback.shared_dir the job-wide settings of the run, which
#                        are exported even when this node's daemon is down (the other nodes run at that level)
# The run (SLURM_RESTART_COUNT) keys the job's control directory: a requeued run never sees the last one's
# requests. It always exits 0: a watchdog that is down must never fail the job.
GW="${GPU_WATCHDOG:-gpu-watchdog}"
[ -n "$SLURM_JOB_ID" ] || exit 0
set -- --restart-hook "${GPU_WATCHDOG_RESTART_HOOK:-slurm-requeue}" --run "${SLURM_RESTART_COUNT:-0}"
[ "${GPU_WATCHDOG_CHECKPOINT:-0}" = "1" ] && set -- "$@" --checkpoint
CFG="${GPU_WATCHDOG_CONFIG:-/etc/gpu-watchdog/config.toml}"
[ -r "$CFG" ] && set -- "$@" --config "$CFG"
if out=$("$GW" hook job-start --job-id "$SLURM_JOB_ID" --pid "$PPID" --export "$@" 2>&1); then
    printf '%s\n' "$out"
else
    echo "print gpu-watchdog task prolog: job $SLURM_JOB_ID not registered: $(printf '%s\n' "$out" | tail -n 1)"
    # a control dir srun copied from a registered batch shell names another node's directory
    echo "unset GPU_WATCHDOG_CONTROL_DIR"
fi
exit 0
