#!/bin/sh
# gpu-watchdog Slurm epilog: the job ended on this node; forget its registration.
# Install: Epilog=/etc/slurm/gpu-watchdog-epilog.sh in slurm.conf. Always exits 0.
# slurmd runs a Prolog/Epilog with no PATH and only a fixed set of SLURM_* variables, and discards its output:
# a wrapper sets GPU_WATCHDOG (the program) and, for a daemon on a non-default socket, GPU_WATCHDOG_SOCKET
# (without --config, `hook` uses the built-in default socket, not /etc/gpu-watchdog/config.toml's). A failed
# de-registration goes to syslog (logger, tag gpu-watchdog-epilog) and to GPU_WATCHDOG_EPILOG_LOG when set.
PATH="${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}"; export PATH
GW="${GPU_WATCHDOG:-gpu-watchdog}"
[ -n "$SLURM_JOB_ID" ] || exit 0
if ! out=$("$GW" hook job-end --job-id "$SLURM_JOB_ID" 2>&1); then
    msg="job $SLURM_JOB_ID: not de-registered: $(printf '%s' "$out" | tail -n 1)"
    command -v logger >/dev/null 2>&1 && logger -t gpu-watchdog-epilog -p daemon.warning -- "$msg"
    [ -n "$GPU_WATCHDOG_EPILOG_LOG" ] && printf '%s %s\n' "$(date '+%Y-%m-%dT%H:%M:%S')" "$msg" \
        >> "$GPU_WATCHDOG_EPILOG_LOG" 2>/dev/null
    echo "gpu-watchdog epilog: $msg" >&2
fi
exit 0
