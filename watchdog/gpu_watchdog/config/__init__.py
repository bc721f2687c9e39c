"""One TOML config: the schema of every section, one loader, and ``config show``'s rendering.
"""
