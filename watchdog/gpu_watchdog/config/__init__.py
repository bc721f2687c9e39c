"""One TOML config: ``schema`` (the dataclasses and defaults), ``load`` (the one loader), ``templates`` (argv
template checks), ``render`` (``config show``). No module here imports one that imports it back.
"""
