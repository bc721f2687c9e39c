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
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
NODE = "gwnode"


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    def __init__(self, root: Path, *, cpus: int = 8, prolog: str | None = None, epilog: str | None = None,
                 task_prolog: str | None = None, extra_conf: str = "") -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.prolog, self.epilog, self.task_prolog = prolog, epilog, task_prolog
        self.extra_conf = extra_conf
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.sock"
        self._procs: list[subprocess.Popen[bytes]] = []
        self.startup_s = 0.0

    # -- environment for clients ---------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env["PATH"] = os.pathsep.join(dict.fromkeys(env.get("PATH", "").split(os.pathsep) + list(SBIN)))
        return env

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    # -- lifecycle -------------------------------------------------------------------------------------
    def _write_files(self) -> None:
        for d in ("munge", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.ctld_port, self.slurmd_port = _free_port(), _free_port()
        lines = [
            "ClusterName=gwtest",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
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
            f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        ]
        for key_, path in (("Prolog", self.prolog), ("Epilog", self.epilog), ("TaskProlog", self.task_prolog)):
            if path:
                lines.append(f"{key_}={path}")
        self.conf.write_text("\n".join(lines) + "\n" + self.extra_conf)
        (self.root / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        out = open(self.root / "log" / f"{name}.out", "ab")
        p = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self._procs.append(p)
        return p

    def start(self, timeout: float = 60) -> SlurmCluster:
        t0 = time.monotonic()
        self._write_files()
        m = self.root / "munge"
        subprocess.run([_which("munged") or "munged", "--force", f"--key-file={m / 'munge.key'}",
                        f"--socket={self.munge_socket}", f"--pid-file={m / 'munged.pid'}",
                        f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"],
                       check=True, capture_output=True, timeout=30)
        self._spawn([_which("slurmctld") or "slurmctld", "-D", "-i"], "slurmctld")
        self._spawn([_which("slurmd") or "slurmd", "-D", "-N", NODE], "slurmd")
        deadline = time.monotonic() + timeout
        while True:
            r = self.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=10) if _which("sinfo") else \
                self.run("scontrol", "show", "node", NODE, check=False, timeout=10)
            text = r.stdout.strip().lower()
            if r.returncode == 0 and text and ("idle" in text or "State=IDLE" in r.stdout):
                break
            for p in self._procs:
                if p.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"Slurm node not idle within {timeout} s ({text!r}):\n{self.logs()}")
            time.sleep(0.3)
        self.startup_s = time.monotonic() - t0
        return self

    def logs(self, n: int = 3000) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-n:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
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

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- jobs ------------------------------------------------------------------------------------------
    def sbatch(self, script: Path, *args: str, env: Mapping[str, str] | None = None) -> str:
        full = self.env
        full.update(env or {})
        r = subprocess.run(["sbatch", "--parsable", *args, str(script)], env=full, capture_output=True, text=True,
                           timeout=30)
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
