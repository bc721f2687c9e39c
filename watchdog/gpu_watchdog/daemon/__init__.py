"""``gpu-watchdog run``: the node daemon — registrations, the control socket, resuming after a restart.
"""
