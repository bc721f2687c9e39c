"""The tick both supervisors run: sample → attribute → heartbeats → detect → schedule stack dumps → check launch
settings → healthy-time fallback reset → metrics. ``launch`` runs it in its own loop, the daemon from
apscheduler; ``replay`` runs only the detector."""
