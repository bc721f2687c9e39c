#!/bin/sh
# gpu-watchdog Slurm prolog: register the job with the node daemon.
# Install: Prolog=/etc/slurm/gpu-watchdog-prolog.sh in slurm.conf (runs as root on each node).
# It registers the job's processes (scontrol listpids) or, before any task exists, its cgroup
# (re-read by the daemon every tick), with the restart hook named in GPU_WATCHDOG_RESTART_HOOK
# (default "slurm-requeue": define [hooks.slurm-requeue] type = "slurm-requeue" in the daemon config).
# It always exits 0: a watchdog that is down must never drain the node or fail the job.
# slurmd runs a Prolog/Epilog with no PATH and only a fixed set of SLURM_* variables.
PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"; export PATH
GW="${GPU_WATCHDOG:-gpu-watchdog}"
HOOK="${GPU_WATCHDOG_RESTART_HOOK:-slurm-requeue}"
CGROUP_ROOT="${GPU_WATCHDOG_CGROUP_ROOT:-/sys/fs/cgroup}"
[ -n "$SLURM_JOB_ID" ] || exit 0
set --
for pid in $(scontrol listpids "$SLURM_JOB_ID" 2>/dev/null | awk 'NR > 1 && $1 ~ /^[0-9]+$/ && $1 > 1 { print $1 }'); do
    set -- "$@" --pid "$pid"
done
cg="system.slice/slurmstepd.scope/job_$SLURM_JOB_ID"
if [ -d "$CGROUP_ROOT/$cg" ]; then
    set -- "$@" --cgroup "$cg"
fi
[ "$#" -gt 0 ] || { echo "gpu-watchdog prolog: job $SLURM_JOB_ID: no processes or cgroup yet" >&2; exit 0; }
opt=""
[ "${GPU_WATCHDOG_CHECKPOINT:-0}" = "1" ] && opt="--checkpoint"
"$GW" hook job-start --job-id "$SLURM_JOB_ID" --restart-hook "$HOOK" $opt "$@" \
    || echo "gpu-watchdog prolog: job $SLURM_JOB_ID not registered (daemon unreachable?)" >&2
exit 0
