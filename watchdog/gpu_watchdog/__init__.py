"""gpu-watchdog: find stalled collectives on a node, prove them with stacks, recover the job."""

__version__ = "0.1.0"
