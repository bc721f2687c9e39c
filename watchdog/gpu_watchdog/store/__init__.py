"""Crash-safe state: incident directories, the daemon's SQLite store, the fallback overlay files.
"""
