"""``gpu-watchdog demo``: a real hang on a CPU job, found and recovered.
"""
