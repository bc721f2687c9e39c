"""Stage 6, export: Prometheus metrics and their HTTP endpoint, systemd notifications, the loop's health.
"""
