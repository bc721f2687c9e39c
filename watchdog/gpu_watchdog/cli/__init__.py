"""The ``gpu-watchdog`` command line: argument parsing and dispatch.
"""
