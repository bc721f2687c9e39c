"""The jobs registered with the daemon (scheduler prolog, preStop hook): which processes are whose, and which the
daemon may ever signal.

A job's processes are its registered pids (checked against the create time recorded at registration), their
descendants, the processes of its cgroup, and the ranks whose environment names the job — and, for a job
registered by a non-root user, only processes of that user. Never the daemon itself, and never a process of Ray
itself (sample.ray_node): a Ray node registered as the job (``ray start --block``'s pid) keeps its GCS, raylet and
agents; what the daemon stops is the job's workers and drivers.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import psutil

from gpu_watchdog.act.stopper import JobProcess
from gpu_watchdog.daemon.cgroups import cgroup_pids
from gpu_watchdog.errors import UsageError
from gpu_watchdog.model import NodeSample, RegisteredPid, Registration
from gpu_watchdog.sample import ray_node
from gpu_watchdog.sample.processes import process_table
from gpu_watchdog.store.db import Store

_TREE_FRESH_S = 0.25  # well under a tick: a process table read for the tick's first question serves its second


class Registry:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.RLock()
        self._jobs: dict[str, Registration] = store.jobs()
        self._tree: tuple[float, dict[int, list[int]]] | None = None  # (monotonic, ppid → pids): _children
        # (the tree it was read from, the registrations, pid → job): owned_pids' answer for the tick's second question
        self._owned: tuple[object, dict[str, Registration], dict[int, str]] | None = None

    def registrations(self) -> dict[str, Registration]:
        with self._lock:
            return dict(self._jobs)

    def get(self, job_id: str) -> Registration | None:
        with self._lock:
            return self._jobs.get(job_id)

    def register(self, reg: Registration) -> None:
        with self._lock:
            reg = replace(reg, registered_at=time.time())
            self.store.put_job(reg)
            self._jobs[reg.job_id] = reg

    def unregister(self, job_id: str) -> bool:
        with self._lock:
            self._jobs.pop(job_id, None)
            return self.store.delete_job(job_id)

    def _children(self) -> dict[int, list[int]]:
        """ppid → pids from the tick's one read of the process table (a tick asks twice, for the pids to sample and to
        attribute them, and the scan reads the same table)."""
        if self._tree is not None and time.monotonic() - self._tree[0] <= _TREE_FRESH_S:
            return self._tree[1]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _start) in process_table(hand_over=True).items():
            children.setdefault(ppid, []).append(pid)
        self._tree = (time.monotonic(), children)
        return children

    def owned_pids(self) -> dict[int, str]:
        """pid → registered job, for live registered pids (create time checked), their descendants and the
        processes of the job's cgroup. A tick asks twice (the pids to sample, then to attribute them): the second
        answer is the first's while the process table read is fresh and the registrations unchanged (each answer
        checks every root's create time: a Ray node's daemon spent more on the second than on reading a rank)."""
        regs = self.registrations()
        tree, owned = self._tree, self._owned
        if tree is not None and owned is not None and owned[0] is tree and owned[1] == regs \
                and time.monotonic() - tree[0] <= _TREE_FRESH_S:
            return dict(owned[2])
        out: dict[int, str] = {}
        children: dict[int, list[int]] | None = None  # one read of the process table, only when a job has roots
        for job_id, reg in regs.items():
            roots = []
            for rp in reg.pids:
                try:
                    p = psutil.Process(rp.pid)
                    if p.create_time() == rp.create_time:
                        roots.append(p)
                except psutil.Error:
                    continue
            if reg.cgroup:
                for pid in cgroup_pids(reg.cgroup):
                    try:
                        roots.append(psutil.Process(pid))
                    except psutil.Error:
                        continue
            if roots and children is None:
                children = self._children()
            stack = [p.pid for p in roots]
            while stack:  # the roots and their descendants
                pid = stack.pop()
                if out.get(pid) != job_id:
                    out[pid] = job_id
                    stack.extend((children or {}).get(pid, ()))
        if children is not None:
            self._owned = (self._tree, regs, dict(out))
        return out

    def job_processes(self, job_id: str, sample: NodeSample | None) -> list[JobProcess]:
        """Every process the daemon may signal for this job (see the module docstring)."""
        reg = self.get(job_id)
        if reg is None:
            return []
        pids = {pid for pid, j in self.owned_pids().items() if j == job_id}
        if sample is not None:
            pids |= {p.pid for p in sample.processes if p.is_rank and p.job and p.job.job_id == job_id}
        owner = reg.registered_by_uid
        out = []
        for pid in sorted(pids):
            if pid == os.getpid():
                continue
            try:
                p = psutil.Process(pid)
                if owner != 0 and p.uids().real != owner:
                    continue
                if p.status() == psutil.STATUS_ZOMBIE or ray_node.is_service(p.cmdline()):
                    continue
                out.append(JobProcess(pid, p.create_time()))
            except psutil.Error:
                continue
        return out

    def attribute(self, sample: NodeSample) -> NodeSample:
        """Ranks under a registered job's pids belong to that job, whatever their environment says. A job registered
        by a non-root user may not adopt other users' processes that merely claim its id in their environment:
        those become a job of their own ("<id>@uid<uid>")."""
        owned = self.owned_pids()
        if not owned:
            return sample
        nonroot = {j: r.registered_by_uid for j, r in self.registrations().items() if r.registered_by_uid != 0}
        procs = []
        for p in sample.processes:
            if p.job is not None and p.pid in owned and p.job.job_id != owned[p.pid]:
                p = replace(p, job=replace(p.job, job_id=owned[p.pid]))
            elif p.job is not None and p.job.job_id in nonroot and p.pid not in owned:
                uid = _uid_of(p.pid)
                if uid != nonroot[p.job.job_id]:
                    p = replace(p, job=replace(p.job, job_id=f"{p.job.job_id}@uid{uid}"))
            procs.append(p)
        return replace(sample, processes=tuple(procs))


def _uid_of(pid: int) -> int:
    try:
        return int(psutil.Process(pid).uids().real)
    except psutil.Error:
        return -1


def live_pids(pids: list[int]) -> tuple[list[RegisteredPid], list[int]]:
    """(the live, non-zombie processes, the pids that have exited). A pid that is no pid, or one the daemon may not
    read, is a UsageError naming it."""
    out, gone = [], []
    for pid in pids:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise UsageError(f"not a pid: {pid!r}")
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                gone.append(pid)
                continue
            out.append(RegisteredPid(pid, p.create_time(), p.uids().real))
        except psutil.NoSuchProcess:
            gone.append(pid)
        except psutil.AccessDenied:
            raise UsageError(f"pid {pid}: access denied") from None
    return out, gone


def validate_pids_live(pids: list[int]) -> tuple[RegisteredPid, ...]:
    """``live_pids`` for callers that need every pid alive: UsageError names the first that is not."""
    live, gone = live_pids(pids)
    if gone:
        raise UsageError(f"pid {gone[0]} is not a live process")
    return tuple(live)
