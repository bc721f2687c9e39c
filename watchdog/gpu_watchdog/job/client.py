"""The optional in-job client: step heartbeats, checkpoint on request, abort of a hung process group.

    from gpu_watchdog.job import Client
    client = Client.from_env()                     # a no-op client when not run under gpu-watchdog
    client.on_checkpoint(lambda step: save(model, optim, step))
    with client.training():
        for step in range(start, steps):
            train_step()
            client.step(step)                     # heartbeat; saves here when the agent asks

A Python signal handler cannot run while the main thread is blocked in a C++ collective (RESEARCH §2), so a
helper thread watches the control directory. On a request it lets the main thread save at its next step
boundary (the callback runs in the main thread, inside ``client.step``, while collectives still work: the one
path where a sharded FSDP/DCP save can work) and the process exits with EXIT_CHECKPOINTED (85). If that
boundary does not come within the request's ``boundary_s``, the helper thread dumps the Flight Recorder (when
enabled) and aborts the default process group. Measured on torch 2.13 CPU (gloo): ``_abort_process_group()``
returns at once, the main thread's pending ``all_reduce``/``recv`` does NOT raise (still blocked 15 s later), and
the default group is gone (``dist.get_rank()`` and every collective raise ValueError, ``dist.is_initialized()``
is False). RESEARCH §2 reports the call raising on other builds; when it does, ``training()`` saves in the main
thread. Either way, after a 2 s wait the helper thread itself calls the callback, then the process exits with
EXIT_ABORTED (86). So the callback must not use the process group: no collectives, no ``dist.get_rank()``
(capture the rank before training).

The callback is called with the last step completed *in this run* and must save the state *as of* that step:
the model is unchanged between ``client.step(n)`` and the optimizer step of n+1, where a hung gradient
all-reduce sits. When no step completed in this run (it hung again before its first ``client.step``), the
callback is not called at all: the state on disk is the one this run resumed from, and the acknowledgement says
``skipped``. A callback that raises is acknowledged ``failed``. torch is imported only when an abort is needed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gpu_watchdog.job.protocol import (
    CONTROL_DIR_ENV,
    EXIT_ABORTED,
    EXIT_CHECKPOINTED,
    ControlDir,
    read_json,
    write_json_atomic,
)

log = logging.getLogger("gpu_watchdog.job")
NO_STEP = "no step completed in this run (the state on disk is the one it resumed from)"


class _Exit(BaseException):
    """Unwinds the training loop after a requested checkpoint (BaseException: user code won't swallow it)."""


class Client:
    def __init__(self, control_dir: str | Path | None, rank: int, poll_s: float = 0.2) -> None:
        self.control_dir = Path(control_dir) if control_dir else None
        self.rank = rank
        self.poll_s = poll_s
        self.last_step: int | None = None
        self._callback: Callable[[int], None] | None = None
        self._request: dict | None = None
        self._boundary_reached = threading.Event()
        self._aborted = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()  # one save at a time: the main thread or the helper, never both
        self._saved = False
        self._thread: threading.Thread | None = None
        self._groups_reported = 0  # how many process groups the last groups-<rank>.json listed

    @classmethod
    def from_env(cls) -> Client:
        """The client of this rank; off (a no-op) when not run under gpu-watchdog, or when the control directory
        the environment names is not there (another node's, copied by srun from a registered batch shell): the
        job must never fail because its watchdog cannot be reached."""
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        path = os.environ.get(CONTROL_DIR_ENV)
        if path and not Path(path).is_dir():
            log.warning("gpu-watchdog client off: control directory %s is not on this node (%s from another "
                        "node, or this task is not registered)", path, CONTROL_DIR_ENV)
            path = None
        return cls(path, rank)

    def _lost(self, e: OSError) -> None:
        """The control directory went away (the agent's node-local state removed): the client turns itself off
        rather than fail the training step."""
        log.warning("gpu-watchdog client off: control directory %s: %s", self.control_dir, e)
        self.control_dir = None

    @property
    def enabled(self) -> bool:
        return self.control_dir is not None

    def on_checkpoint(self, fn: Callable[[int], None]) -> None:
        """Register the save callback (called with the last step completed in this run, never without one)
        and announce the opt-in to the agent."""
        self._callback = fn
        if not self.enabled or self._thread is not None:
            return
        assert self.control_dir is not None
        try:
            write_json_atomic(self.control_dir / f"client-{self.rank}.json",
                              {"pid": os.getpid(), "rank": self.rank, "t": time.time()})
        except OSError as e:
            self._lost(e)
            return
        self._thread = threading.Thread(target=self._watch, name="gpu-watchdog-client", daemon=True)
        self._thread.start()

    # -- main thread -------------------------------------------------------------------------------
    @property
    def checkpoint_requested(self) -> bool:
        """Whether the agent has asked this job to checkpoint (it saves at the next ``step``)."""
        return self._request is not None

    def step(self, n: int) -> None:
        """Report step ``n`` as completed; save and exit here when a checkpoint was requested."""
        self.last_step = n
        if self.control_dir is not None:
            path = self.control_dir / f"step-{self.rank}"
            tmp = path.with_name(f".step-{self.rank}.tmp")
            try:
                tmp.write_text(str(n))
                tmp.replace(path)
            except OSError as e:
                self._lost(e)
            self._report_groups()
        if self._request is not None and not self._aborted.is_set():
            self._boundary_reached.set()
            self._save_and_ack("saved")
            self._wait_for_peers()
            raise _Exit(EXIT_CHECKPOINTED)

    @contextlib.contextmanager
    def training(self) -> Iterator[Client]:
        """Wrap the training loop: turns a requested stop or an aborted collective into a clean exit."""
        try:
            yield self
            self._mark_done()
        except _Exit as e:
            raise SystemExit(e.args[0]) from None
        except Exception:
            if not self._aborted.is_set():
                raise
            self._save_and_ack("aborted_saved")  # the collective raised because we aborted it
            self._wait_for_peers()
            raise SystemExit(EXIT_ABORTED) from None

    def _report_groups(self) -> None:
        """Tell the agent every process group's timeout (the job's own deadline for a collective in it), again
        whenever the job made more groups. A count per step; the list only when it changed."""
        pg_names = _pg_names()
        if pg_names is None or len(pg_names) == self._groups_reported or self.control_dir is None:
            return
        try:
            write_json_atomic(self.control_dir / f"groups-{self.rank}.json",
                              {"rank": self.rank, "pid": os.getpid(), "t": time.time(),
                               "groups": process_groups(pg_names)})
        except OSError as e:
            self._lost(e)
            return
        self._groups_reported = len(pg_names)

    def _mark_done(self) -> None:
        """Tell the agent this rank's training loop ended without an exception: a death after this (PyTorch's
        teardown abort at interpreter exit) is not a crash mid-training and is never restarted."""
        if self.control_dir is None:
            return
        try:
            write_json_atomic(self.control_dir / f"done-{self.rank}.json",
                              {"rank": self.rank, "pid": os.getpid(), "step": self.last_step, "t": time.time()})
        except OSError as e:
            self._lost(e)

    # -- helper thread -----------------------------------------------------------------------------
    def _watch(self) -> None:
        assert self.control_dir is not None
        req_path = self.control_dir / "request.json"
        while not self._done.is_set():
            req = read_json(req_path)
            if req and isinstance(req.get("id"), str):
                self._request = req
                break
            time.sleep(self.poll_s)
        else:
            return
        boundary_s = float(self._request.get("boundary_s", 5.0))
        if self._boundary_reached.wait(boundary_s):
            return  # the main thread saves at its step boundary
        # Every rank's helper thread gets here at once: one line for the job (its lowest announced rank), not one
        # per rank.
        first = min(ControlDir(self.control_dir).clients(), default=self.rank) >= self.rank
        (log.warning if first else log.debug)("gpu-watchdog: no step boundary within %.1fs; aborting the process "
                                              "group", boundary_s)
        self._aborted.set()
        self._dump_flight_recorder()
        self._abort_process_group()
        # If the abort made the main thread's collective raise, training() saves there; otherwise (the main
        # thread is still blocked, or it is the hung rank doing something else) save from here and leave.
        time.sleep(2.0)
        self._save_and_ack("aborted_saved")
        self._wait_for_peers()
        os._exit(EXIT_ABORTED)

    def _dump_flight_recorder(self) -> None:
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        if not prefix:
            return
        try:
            from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]

            Path(f"{prefix}{self.rank}").write_bytes(_dump_fr_trace())
        except Exception as e:  # diagnostics only; the abort must still happen
            log.warning("gpu-watchdog: flight recorder dump failed: %s", e)

    def _abort_process_group(self) -> None:
        try:
            from torch.distributed import distributed_c10d

            distributed_c10d._abort_process_group()  # experimental API; see the module docstring
        except Exception as e:
            log.warning("gpu-watchdog: process group abort failed: %s", e)

    def _save_and_ack(self, outcome: str) -> None:
        with self._lock:
            if self._saved:
                return
            self._saved = True
            step, detail = self.last_step, ""
            if step is None:  # never write an older state (or None) over the checkpoint this run resumed from
                outcome, detail = "skipped", NO_STEP
                log.warning("gpu-watchdog: checkpoint skipped: %s", NO_STEP)
            elif self._callback is not None:
                try:
                    self._callback(step)
                except Exception as e:
                    log.error("gpu-watchdog: checkpoint callback failed: %s: %s", type(e).__name__, e)
                    outcome, detail = "failed", f"{type(e).__name__}: {e}"
            if self.control_dir is not None and self._request is not None:
                write_json_atomic(self.control_dir / f"ack-{self.rank}.json",
                                  {"id": self._request["id"], "rank": self.rank, "pid": os.getpid(),
                                   "outcome": outcome, "step": step, "t": time.time(),
                                   **({"detail": detail} if detail else {})})

    def _wait_for_peers(self) -> None:
        """Hold this rank's exit until every client announced on this node has acked the request (bounded by
        its ``grace_s``): the first rank to exit makes torchrun SIGTERM the others, which would cut short a
        peer's save still in progress — typically rank 0's, the only one that writes."""
        if self.control_dir is None or self._request is None:
            return
        ctl, rid = ControlDir(self.control_dir), str(self._request["id"])
        deadline = time.monotonic() + float(self._request.get("grace_s", 60.0))
        while time.monotonic() < deadline and not set(ctl.clients()) <= set(ctl.acks(rid)):
            time.sleep(self.poll_s)

    def close(self) -> None:
        self._done.set()


def _pg_names() -> dict | None:
    """torch.distributed's group → name map, when the job has initialised it (torch is never imported here)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return dict(dist.distributed_c10d._world.pg_names)
    except Exception:  # a torch without these internals: no report, never a failed step
        return None


def process_groups(pg_names: dict) -> list[dict]:
    """Each process group's name, description, global ranks, timeout (the longest of its backends') and address (the
    object's ``id``: what py-spy prints for a ``group`` argument, so that the agent can tell from a rank's frames which
    group it waits in)."""
    from torch.distributed import distributed_c10d as c10d

    out = []
    for pg, name in pg_names.items():
        timeouts = []
        for device in getattr(pg, "_device_types", ()):
            try:
                timeouts.append(pg._get_backend(device).options._timeout.total_seconds())
            except Exception:  # a backend without options (a fake or custom one): its timeout is not known
                continue
        out.append({"name": str(name), "desc": str(getattr(pg, "group_desc", "") or ""),
                    "ranks": sorted(int(r) for r in c10d._world.pg_group_ranks.get(pg, {})),
                    "timeout_s": max(timeouts) if timeouts else None, "address": id(pg)})
    return out
