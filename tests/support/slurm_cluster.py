"""A real single-node Slurm (munged + slurmctld + slurmd) for tests, started as root without systemd.

    with SlurmCluster(tmp_dir, prolog=..., epilog=..., task_prolog=...) as cluster:
        job_id = cluster.sbatch(script_path)
        cluster.wait_state(job_id, {"COMPLETED"}, timeout=120)

Everything lives under one directory: munge key and socket, slurm.conf (``SLURM_CONF``), state and spool
dirs, logs. Daemons listen on 127.0.0.1 on free ports; the node is ``gwnode`` (``slurmd -N``).

Choices that hold on cgroup v1 and v2 alike: ``ProctrackType=proctrack/linuxproc`` (process-tree tracking,
no cgroup hierarchy or systemd scope needed), ``TaskPlugin=task/none``, no accounting. ``JobRequeue=1`` so a
batch job can be requeued; ``PrologFlags=Alloc`` so the prolog runs at allocation. The node's CPU count is
the config's (``SlurmdParameters=config_overrides``), whatever this machine has.

``slurm_missing_reason()`` says why a cluster cannot start here (not root, packages missing); in CI
(``CI=true``) a test must fail on it rather than skip.

``SlurmBase`` is what this cluster shares with the multi-node one of ``slurm_nodes.py`` (the same slurm.conf
choices, munge, logs and job helpers); a subclass says where the daemons run and how a client reaches them.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
NODE = "gwnode"
# What slurmctld 22.05 logs (at info) once per requeue it carries out for `scontrol requeue` (the RPC a hook uses)
REQUEUE_PATTERN = re.compile(r"\bRequeuing JobId=(\d+)\b")
_C = TypeVar("_C", bound="SlurmBase")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def slurm_missing_reason() -> str | None:
    """None when a cluster can be started here, else why not."""
    if os.geteuid() != 0:
        return "a real Slurm cluster needs root (munged, slurmd)"
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    return None


def require(why: str | None, what: str) -> None:
    """Skip the calling fixture's tests when ``why`` says a cluster cannot start here; in CI (``CI=true``) fail
    them instead: CI installs what they need, so a skip there would hide a broken install."""
    import pytest

    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} cannot run in CI: {why}")
        pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmBase:
    """Files, munged and job helpers shared by the clusters; a subclass writes its node lines and starts the
    daemons (``start``/``stop``), and may run client commands elsewhere (``client_argv``)."""

    def __init__(self, root: Path, *, cpus: int, prolog: str | None = None, epilog: str | None = None,
                 task_prolog: str | None = None, extra_conf: str = "") -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.prolog, self.epilog, self.task_prolog = prolog, epilog, task_prolog
        self.extra_conf = extra_conf
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.sock"
        self.startup_s = 0.0

    # -- environment for clients ---------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env["PATH"] = os.pathsep.join(dict.fromkeys(env.get("PATH", "").split(os.pathsep) + list(SBIN)))
        return env

    def client_argv(self, argv: Iterable[str]) -> list[str]:
        """How the test process runs a Slurm client command (sbatch, scontrol, ...) against this cluster."""
        return list(argv)

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.client_argv(argv), env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    # -- files -------------------------------------------------------------------------------------------
    def _make_dirs(self) -> None:
        for d in ("munge", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

    def munged_argv(self, *foreground: str) -> list[str]:
        """munged on this cluster's key, its socket under the root (``AuthInfo=socket=``): a socket on a path,
        so it serves every network namespace that sees the file system. ``"-F"`` keeps it in the foreground."""
        m = self.root / "munge"
        return [_which("munged") or "munged", *foreground, "--force", f"--key-file={m / 'munge.key'}",
                f"--socket={self.munge_socket}", f"--pid-file={m / 'munged.pid'}",
                f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"]

    def _write_conf(self, *, ctld: str, ctld_port: int, slurmd_port: int, nodes: Mapping[str, str],
                    per_node: str = "") -> None:
        """slurm.conf: ``ctld`` as SlurmctldHost (``name(addr)``), ``nodes`` name -> NodeAddr, all in partition
        ``debug``; ``per_node="%n"`` gives each slurmd a spool dir, pid file and log of its own."""
        slurmd = f"slurmd-{per_node}" if per_node else "slurmd"
        lines = [
            "ClusterName=gwtest",
            f"SlurmctldHost={ctld}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / per_node}",
            f"SlurmctldPidFile={self.root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'run' / slurmd}.pid",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / slurmd}.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/builtin", "SchedulerParameters=sched_interval=1",
            "MpiDefault=none", "ReturnToService=2",
            "JobRequeue=1", "PrologFlags=Alloc",
            "KillWait=5", "MinJobAge=600", "InactiveLimit=0", "Waittime=0",
            "MessageTimeout=20", "SlurmdTimeout=300",
            *(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} RealMemory=4000 State=UNKNOWN" for n, a in nodes.items()),
            f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        for key_, path in (("Prolog", self.prolog), ("Epilog", self.epilog), ("TaskProlog", self.task_prolog)):
            if path:
                lines.append(f"{key_}={path}")
        self.conf.write_text("\n".join(lines) + "\n" + self.extra_conf)
        (self.root / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")

    def _wait_idle(self, nodes: Iterable[str], deadline: float, alive: Callable[[], str | None]) -> None:
        """Until every node is IDLE; ``alive()`` names a daemon that died (then fail at once, with the logs)."""
        want = set(nodes)
        while True:
            r = self.run("scontrol", "-o", "show", "nodes", check=False, timeout=10)
            states = dict(re.findall(r"^NodeName=(\S+) .*?\bState=(\S+)", r.stdout, re.M))
            if r.returncode == 0 and all(states.get(n) == "IDLE" for n in want):
                return
            dead = alive()
            if dead:
                raise RuntimeError(f"{dead}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm nodes not idle in time ({states or r.stderr.strip()!r}):\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, n: int = 3000) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-n:]}")
        return "\n".join(out)

    def start(self, timeout: float = 60) -> SlurmBase:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- jobs ------------------------------------------------------------------------------------------
    def sbatch(self, script: Path, *args: str, env: Mapping[str, str] | None = None) -> str:
        full = self.env
        full.update(env or {})
        r = subprocess.run(self.client_argv(["sbatch", "--parsable", *args, str(script)]), env=full,
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed: {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, Restarts, ExitCode, Reason, Comment, ...)."""
        r = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        out: dict[str, str] = {}
        for tok in r.stdout.split():
            k, sep, v = tok.partition("=")
            if sep and k not in out:
                out[k] = v
        return out

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(states)} within {timeout} s: {info}\n{self.logs()}")
            time.sleep(0.3)

    def cancel(self, job_id: str) -> None:
        self.run("scancel", job_id, check=False)

    def requeue_count(self, job_id: str) -> int:
        """How many times slurmctld requeued the job, from its log (REQUEUE_PATTERN): the count that survives
        the job record (Restarts= is the job's, and a later requeue or purge changes it)."""
        text = (self.root / "log" / "slurmctld.log").read_text(errors="replace")
        return sum(1 for m in REQUEUE_PATTERN.finditer(text) if m.group(1) == str(job_id))


class SlurmCluster(SlurmBase):
    def __init__(self, root: Path, *, cpus: int = 8, prolog: str | None = None, epilog: str | None = None,
                 task_prolog: str | None = None, extra_conf: str = "") -> None:
        super().__init__(root, cpus=cpus, prolog=prolog, epilog=epilog, task_prolog=task_prolog,
                         extra_conf=extra_conf)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- lifecycle -------------------------------------------------------------------------------------
    def _write_files(self) -> None:
        self._make_dirs()
        self.ctld_port, self.slurmd_port = _free_port(), _free_port()
        self._write_conf(ctld=f"{socket.gethostname()}(127.0.0.1)", ctld_port=self.ctld_port,
                         slurmd_port=self.slurmd_port, nodes={NODE: "127.0.0.1"})

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        out = open(self.root / "log" / f"{name}.out", "ab")
        p = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self._procs[name] = p
        return p

    def _dead(self) -> str | None:
        return next((f"{name} exited {p.returncode}" for name, p in self._procs.items() if p.poll() is not None), None)

    def start(self, timeout: float = 60) -> SlurmCluster:
        t0 = time.monotonic()
        try:
            self._write_files()
            subprocess.run(self.munged_argv(), check=True, capture_output=True, timeout=30)
            self._spawn([_which("slurmctld") or "slurmctld", "-D", "-i"], "slurmctld")
            self._spawn([_which("slurmd") or "slurmd", "-D", "-N", NODE], "slurmd")
            self._wait_idle([NODE], t0 + timeout, self._dead)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        for p in reversed(self._procs.values()):
            if p.poll() is None:
                p.terminate()
        for p in self._procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._procs.clear()
        pidfile = self.root / "munge" / "munged.pid"
        try:
            os.kill(int(pidfile.read_text().strip()), 15)
        except (OSError, ValueError):
            pass
