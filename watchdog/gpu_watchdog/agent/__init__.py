"""One agent, two hosts: what ``launch`` and the daemon share — the agent built in one place (backend, engine and
the act stage's complete context) and the dispatch of each finding to its host's handler.
"""
