#!/bin/sh
# gpu-watchdog Slurm epilog: the job ended on this node; forget its registration.
# Install: Epilog=/etc/slurm/gpu-watchdog-epilog.sh in slurm.conf. Always exits 0.
# slurmd runs a Prolog/Epilog with no PATH and only a fixed set of SLURM_* variables.
PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"; export PATH
GW="${GPU_WATCHDOG:-gpu-watchdog}"
[ -n "$SLURM_JOB_ID" ] || exit 0
"$GW" hook job-end --job-id "$SLURM_JOB_ID" >/dev/null 2>&1 \
    || echo "gpu-watchdog epilog: job $SLURM_JOB_ID: daemon unreachable or job not registered" >&2
exit 0
