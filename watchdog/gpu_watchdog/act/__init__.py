"""Stage 5, act: the only code that touches jobs — checkpoint requests, the stop ladder, hooks, recovery and
GPU-fault handling.
"""
