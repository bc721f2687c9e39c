"""The job side: the optional in-job client (step heartbeats, checkpoint on request, Flight Recorder
dumps) and the file protocol it shares with the agent. ``from gpu_watchdog.job import Client`` is the
public import path."""

from gpu_watchdog.job.client import Client

__all__ = ["Client"]
