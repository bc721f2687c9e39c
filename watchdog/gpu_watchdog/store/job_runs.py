"""Job-wide run records on a shared directory: one decision per (job, run), the same for every node.

A job that spans nodes has one agent per node and no coordinator. The agents coordinate through what the cluster
already has: a directory every node mounts at the same path (``fallback.shared_dir``). The record of run N+1 — the
fallback level and NCCL settings the job restarts with, who decided them, from which incident — is the file
``<shared_dir>/<job>/run-<N+1>.json``, created exclusively: the first agent to write it is the one that restarts
the job (first writer wins, like NVRx's round number in the rendezvous store); every other agent reads it and
stands down ("restarted by <node>"). A record is never rewritten, so a late agent can never act twice on one run
nor on a newer one. Every node's TaskProlog exports the record of the run it starts: one level, one set of NCCL
settings for every rank of a communicator.

Each agent also publishes its newest stack dump of a job (``<shared_dir>/<job>/stacks/<host>.json``): the acting
agent merges them with its own, so a culprit on another node — one its own agent only "waits" on, computing — is
named from any node. The agent on rank 0's node, the only one that watches NCCL RAS all the time, publishes what
NCCL's counts showed (``<job>/comm/<host>.json``); the other nodes read it instead of loading the job's RAS network.

The exclusive create is ``os.link`` of a complete temporary file (atomic on local file systems and NFSv3+, where
``O_EXCL`` on a plain open is not always honoured): no reader ever sees half a record.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from gpu_watchdog.atomic import write_atomic
from gpu_watchdog.config.schema import Config
from gpu_watchdog.model import COMM_STATES, CommProgress, StackEvidence, validate_job_id
from gpu_watchdog.sample.trace import stacks_from_record, stacks_record

_RUN_FILE = re.compile(r"^run-(\d+)\.json$")


class JobRuns:
    def __init__(self, shared_dir: str | Path, host: str = "") -> None:
        self.root = Path(shared_dir)
        self.host = re.sub(r"[^A-Za-z0-9._-]", "_", host or socket.gethostname())  # a file name

    @classmethod
    def from_config(cls, cfg: Config, host: str = "") -> JobRuns | None:
        """The job-wide records ``fallback.shared_dir`` names, as this node (``agent.hostname``) writes them; None
        without a shared directory."""
        shared = cfg.fallback.shared_dir
        return cls(shared, host or cfg.agent.hostname) if shared else None

    def job_dir(self, job_id: str) -> Path:
        return self.root / validate_job_id(job_id)

    def run_dir(self, job_id: str, run: int) -> Path:
        """Job-wide files of one run (NCCL debug logs, Flight Recorder dumps): the same path on every node."""
        return self.job_dir(job_id) / f"run-{int(run)}"

    def claim(self, job_id: str, run: int, record: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Decide run ``run`` of the job: (True, record) when this agent wrote it first, else (False, the record
        someone else wrote). OSError when the shared directory cannot be written (the caller decides)."""
        d = self.job_dir(job_id)
        d.mkdir(parents=True, exist_ok=True)
        final = d / f"run-{int(run)}.json"
        data = {**record, "job_id": job_id, "run": int(run), "decided_by": self.host, "decided_at": time.time()}
        tmp = d / f".run-{int(run)}.{self.host}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)
            won = True
        except FileExistsError:
            won = False
        finally:
            tmp.unlink(missing_ok=True)
        if won:
            return True, data
        theirs = self.get(job_id, run)
        return False, theirs if theirs is not None else {"run": int(run), "decided_by": "?"}

    def get(self, job_id: str, run: int) -> dict[str, Any] | None:
        try:
            data = json.loads((self.job_dir(job_id) / f"run-{int(run)}.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def current(self, job_id: str, run: int | None = None) -> dict[str, Any] | None:
        """The record that configures run ``run`` (the newest decided at or before it; with None the newest of
        all); None when no run of the job was ever decided."""
        try:
            runs = sorted((int(m.group(1)) for p in self.job_dir(job_id).iterdir()
                           if (m := _RUN_FILE.match(p.name))), reverse=True)
        except OSError:
            return None
        for n in runs:
            if run is None or n <= run:
                rec = self.get(job_id, n)
                if rec is not None:
                    return rec
        return None

    def restart_times(self, job_id: str) -> list[float]:
        """When each decided run of the job was decided (a restart; a decision to give up is none): the job-wide
        restart history every node's budget counts, oldest first."""
        try:
            names = [p.name for p in self.job_dir(job_id).iterdir()]
        except OSError:
            return []
        times = []
        for name in names:
            m = _RUN_FILE.match(name)
            rec = self.get(job_id, int(m.group(1))) if m else None
            if rec is not None and not rec.get("give_up") and isinstance(rec.get("decided_at"), (int, float)):
                times.append(float(rec["decided_at"]))
        return sorted(times)

    def _publish(self, job_id: str, kind: str, doc: Any) -> None:
        """This node's document of one kind for the job (``<job>/<kind>/<host>.json``, replaced atomically)."""
        d = self.job_dir(job_id) / kind
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / f"{self.host}.json", json.dumps(doc, sort_keys=True))

    def _peers(self, job_id: str, kind: str) -> dict[str, Any]:
        """The other nodes' documents of one kind for the job, by host (unreadable ones left out)."""
        out: dict[str, Any] = {}
        try:
            files = sorted((self.job_dir(job_id) / kind).glob("*.json"))
        except OSError:
            return out
        for f in files:
            if f.stem != self.host:
                try:
                    out[f.stem] = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
        return out

    def publish_stacks(self, ev: StackEvidence) -> None:
        """This node's newest dump of the job's ranks, for the other nodes' agents."""
        self._publish(ev.job_id, "stacks", stacks_record(ev))

    def peer_stacks(self, job_id: str, since: float) -> dict[str, StackEvidence]:
        """The other nodes' newest dumps of the job taken at or after ``since`` (unix seconds), by host."""
        out: dict[str, StackEvidence] = {}
        for host, doc in self._peers(job_id, "stacks").items():
            ev = stacks_from_record(doc)
            if ev is not None and ev.job_id == job_id and ev.t >= since:
                out[host] = ev
        return out

    def publish_settings(self, job_id: str, run: str, envs: dict[int, dict[str, str]]) -> None:
        """This node's ranks' launch settings for run ``run`` of the job ({rank: env})."""
        self._publish(job_id, f"settings-run-{int(run)}", {str(r): e for r, e in envs.items()})

    def peer_settings(self, job_id: str, run: str) -> dict[str, dict[int, dict[str, str]]]:
        """The other nodes' published settings for run ``run``: {host: {rank: env}}."""
        out: dict[str, dict[int, dict[str, str]]] = {}
        for host, doc in self._peers(job_id, f"settings-run-{int(run)}").items():
            try:
                out[host] = {int(r): {str(k): str(v) for k, v in e.items()} for r, e in doc.items()}
            except (ValueError, AttributeError):
                continue
        return out

    def publish_comm(self, progress: CommProgress) -> None:
        """What NCCL's counts showed this node's watcher last (the job's progress as NCCL RAS sees it)."""
        self._publish(progress.job_id, "comm", {"t": progress.t, "state": progress.state,
                                                "behind": list(progress.behind), "source": progress.source,
                                                "desync": progress.desync})

    def peer_comm(self, job_id: str, since: float) -> list[CommProgress]:
        """The other nodes' published observations of the job newer than ``since`` (unix seconds), oldest first;
        malformed documents are left out."""
        out = []
        for host, doc in self._peers(job_id, "comm").items():
            try:
                t, state = float(doc["t"]), str(doc["state"])
                behind = tuple(int(r) for r in doc.get("behind", ()))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            if state in COMM_STATES and t > since:
                out.append(CommProgress(job_id, t, state, behind, f"{doc.get('source') or 'NCCL RAS'} via {host}",
                                        bool(doc.get("desync"))))
        return sorted(out, key=lambda p: p.t)
