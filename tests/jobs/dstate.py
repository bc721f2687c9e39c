"""Sit in uninterruptible sleep (state D), as a rank does on a hard NFS mount whose server went away: dsleep.c
beside this module, built with cc into the caller's work dir. Used by train.py and the zoo's programs."""

from __future__ import annotations

import ctypes
import os
import subprocess


def uninterruptible_sleep(seconds: float, workdir: str) -> None:
    """Build dsleep.c and sit in state D for ``seconds`` (only a fatal signal ends it sooner)."""
    lib = os.path.join(workdir, f"dsleep-{os.getpid()}.so")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dsleep.c")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", lib, src], check=True)
    ctypes.CDLL(lib).uninterruptible_sleep(ctypes.c_uint(int(seconds)))
