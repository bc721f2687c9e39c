"""Stage 1, sample: what the node looks like now (NVML or /proc), Xid events, job identity of processes,
traces recorded and read back. The only stage that reads the GPUs.
"""
