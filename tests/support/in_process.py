"""Running ``Launcher.run()`` inside the test process, as for a one-rank job."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


@contextmanager
def one_rank_launch() -> Iterator[None]:
    """The launched command inherits RANK/WORLD_SIZE/LOCAL_RANK (a one-rank job); the SIGINT/SIGTERM handlers
    ``Launcher.run`` installs and the environment are put back afterwards."""
    saved = {k: os.environ.get(k) for k in ONE_RANK}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    os.environ.update(ONE_RANK)
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
