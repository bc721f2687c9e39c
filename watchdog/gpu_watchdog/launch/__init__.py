"""``gpu-watchdog launch``: one job started, supervised and restarted by this process.
"""
