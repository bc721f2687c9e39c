"""A real multi-node Slurm on one machine: each compute node a set of Linux namespaces, for end-to-end tests of
per-node agents (one per node, each seeing only its node's processes) and of jobs that span nodes.

    with SlurmNodes(tmp_dir, nodes=2, task_prolog=...) as cluster:
        agent = cluster.spawn("gwn1", [gw, "run", ...], log=tmp_dir / "agent-gwn1.log")
        job_id = cluster.sbatch(script_path, "-N", "2", env=job_env)
        cluster.wait_state(job_id, {"COMPLETED"}, timeout=120)

Why namespaces: a node is what its processes see. Each node ("gwn1", "gwn2", ...) is a long-lived init process
(``_INIT``: PID 1 of the node, it reaps orphans and exits on SIGTERM, and when it dies the kernel kills every
process of the node) started by ``unshare --net --uts --pid --mount --fork --mount-proc``: its own hostname,
its own /proc (a monitoring agent in the node sees only the node's processes), its own network stack. Inside
its mount namespace the node bind-mounts ``node_local`` (one path, the same string on every node) onto a
directory of its own (``node_dir(name)`` from the host), and /etc/hosts onto the cluster's hosts file; everything
else (the cluster root, /tmp, the repository, the venv) is the one shared file system, as on a cluster with NFS.

The controller ("gwctl") is such a namespace too: slurmctld and munged run in it, and it holds the bridge that
every node's veth pair joins (``eth0`` in the node, named after the node on the bridge side). Nothing is added to
the host's network namespace; the test process runs its clients there with ``nsenter --net`` (``run``,
``sbatch``). The addresses are 10.213.<index>.0/24 (controller .1, nodes .11, .12, ...), the index held by a lock
file per live cluster (the namespaces are private anyway; distinct subnets keep two clusters' logs apart). Each
daemon having a network namespace of its own, the ports are Slurm's defaults. munged's socket is a path under
the root, which every node reaches through the file system.

``stop()`` kills the inits (nodes, then the controller): the kernel ends every process in them, the network
namespaces go with their last process and the veth pairs and the bridge with them. The unshare processes die
with the test process (PR_SET_PDEATHSIG) and take their inits along (``--kill-child``), so a killed test run
leaves nothing either. Needs root, Slurm, munge and util-linux/iproute2: ``slurm_nodes_missing_reason()``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from slurm_cluster import SlurmBase, _which, slurm_missing_reason

TOOLS = ("unshare", "nsenter", "ip", "mount", "srun", "sinfo")
CONTROLLER = "gwctl"
IFACE = "eth0"  # the same name in every node: GLOO_SOCKET_IFNAME and friends can be one setting
CTLD_PORT, SLURMD_PORT = 6817, 6818
LOCK_DIR = Path("/tmp/gw-slurm-nodes")
_PR_SET_PDEATHSIG = 1

# PID 1 of a node: hostname and bind mounts (argv: name, then src dst pairs), "ready" on stdout, then reap
# orphans until SIGTERM. PID 1 of a namespace gets only the signals it has a handler for, hence the handlers;
# they are blocked and taken with sigtimedwait, so none is lost between a reap and the wait.
_INIT = r"""
import os, signal, socket, subprocess, sys
name, *binds = sys.argv[1:]
socket.sethostname(name)
for src, dst in zip(binds[::2], binds[1::2]):
    subprocess.run(["mount", "--bind", src, dst], check=True)
sigs = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
for s in sigs:
    signal.signal(s, lambda *a: None)
signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
print("ready", flush=True)
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    got = signal.sigtimedwait(sigs, 5.0)
    if got is not None and got.si_signo != signal.SIGCHLD:
        os._exit(0)
"""

# Runs argv inside a node (argv: init pid, cwd, then the command): joins the init's namespaces, starts the
# command as its child (in the node's PID namespace) and stands for it: signals are passed on, its exit status is
# ours, and if we are killed it is too (PR_SET_PDEATHSIG). So Popen.terminate()/kill()/wait() act on the command.
_ENTER = r"""
import ctypes, os, signal, subprocess, sys
pid, cwd, *argv = sys.argv[1:]
libc = ctypes.CDLL(None, use_errno=True)
fds = [os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY) for ns in ("net", "uts", "pid", "mnt")]
for fd in fds:  # mnt last: /proc/{pid} is the host's view
    if libc.setns(fd, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into node init {pid}: {os.strerror(err)}")
    os.close(fd)
os.chdir(cwd)
try:
    child = subprocess.Popen(argv, preexec_fn=lambda: libc.prctl(1, signal.SIGKILL))
except OSError as e:
    print(f"cannot run {argv[0]}: {e}", file=sys.stderr)
    sys.exit(127)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, lambda n, f: child.send_signal(n))
rc = child.wait()
if rc < 0:
    signal.signal(-rc, signal.SIG_DFL)
    os.kill(os.getpid(), -rc)
sys.exit(rc & 255)
"""


def slurm_nodes_missing_reason() -> str | None:
    """None when a multi-node cluster can be started here, else why not (CI must fail on it, not skip)."""
    why = slurm_missing_reason()
    if why:
        return why
    missing = [t for t in TOOLS if _which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (util-linux, iproute2, slurm-client)"
    try:  # a container without CAP_SYS_ADMIN has the tools but no namespaces
        r = subprocess.run([_which("unshare") or "unshare", "--net", "--uts", "--pid", "--mount", "--fork",
                            "--mount-proc", "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if r.returncode != 0:
        return f"cannot create namespaces here: {r.stderr.strip()}"
    return None


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class SlurmNodes(SlurmBase):
    """``nodes`` compute nodes gwn1..gwnN with ``cpus`` CPUs each, partition ``debug``; see the module docstring."""

    def __init__(self, root: Path, *, nodes: int = 2, cpus: int = 4, prolog: str | None = None,
                 epilog: str | None = None, task_prolog: str | None = None, extra_conf: str = "") -> None:
        super().__init__(root, cpus=cpus, prolog=prolog, epilog=epilog, task_prolog=task_prolog,
                         extra_conf=extra_conf)
        self.names = [f"gwn{i}" for i in range(1, nodes + 1)]
        self.node_local = self.root / "local"  # the common path; each node mounts its node_dir() on it
        self.hosts = self.root / "hosts"
        self.index = -1
        self._lock_fd: int | None = None
        self._inits: dict[str, tuple[subprocess.Popen[bytes], int]] = {}  # name -> (unshare, init's host pid)
        self._procs: list[subprocess.Popen[bytes]] = []  # daemons and spawn()ed commands, reaped by stop()
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    # -- addresses and paths -------------------------------------------------------------------------------
    def addr(self, name: str) -> str:
        """The private address of a node (or of the controller, ``CONTROLLER``)."""
        host = 1 if name == CONTROLLER else 10 + self.names.index(name) + 1
        return f"10.213.{self.index}.{host}"

    def node_dir(self, name: str) -> Path:
        """What ``node_local`` is inside node ``name``, as the host sees it."""
        return self.root / "nodes" / name

    def node_init_pid(self, name: str) -> int:
        """The host PID of the node's init (PID 1 inside): ``nsenter -t`` it, or kill it to lose the node."""
        return self._inits[name][1]

    def client_argv(self, argv: Iterable[str]) -> list[str]:
        return [_which("nsenter") or "nsenter", f"--net=/proc/{self.node_init_pid(CONTROLLER)}/ns/net", "--",
                *argv]

    # -- processes in a node ---------------------------------------------------------------------------------
    def _enter_argv(self, name: str, cwd: Path | str | None) -> list[str]:
        return [sys.executable, "-I", "-S", str(self.root / "bin" / "enter.py"), str(self.node_init_pid(name)),
                str(cwd or os.getcwd())]

    def spawn(self, name: str, argv: Iterable[str], *, env: Mapping[str, str] | None = None,
              log: Path | None = None, cwd: Path | str | None = None) -> subprocess.Popen[bytes]:
        """Start a long-running command inside node ``name`` (its network, hostname, PIDs and mounts), output to
        ``log`` (appended); ``env`` is the whole environment (default ``self.env``: SLURM_CONF, PATH). The Popen
        stands for the command: terminate/kill/send_signal/wait reach it; it dies with the node."""
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            p = subprocess.Popen(self._enter_argv(name, cwd) + list(argv), env=dict(env or self.env), stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        self._procs.append(p)
        return p

    def node_run(self, name: str, argv: Iterable[str], *, env: Mapping[str, str] | None = None,
                 cwd: Path | str | None = None, timeout: float = 60,
                 check: bool = False) -> subprocess.CompletedProcess[str]:
        """A one-off command inside node ``name``, its output captured."""
        return subprocess.run(self._enter_argv(name, cwd) + list(argv), env=dict(env or self.env),
                              capture_output=True, text=True, timeout=timeout, check=check,
                              stdin=subprocess.DEVNULL)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _take_index(self) -> None:
        LOCK_DIR.mkdir(exist_ok=True)
        for i in range(256):
            fd = os.open(LOCK_DIR / f"{i}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.index, self._lock_fd = i, fd
            return
        raise RuntimeError(f"no free cluster index under {LOCK_DIR}")

    def _write_files(self) -> None:
        self._make_dirs()
        self.node_local.mkdir(exist_ok=True)
        for n in self.names:
            self.node_dir(n).mkdir(parents=True, exist_ok=True)
        hosts = ["127.0.0.1 localhost", "::1 localhost", f"{self.addr(CONTROLLER)} {CONTROLLER}",
                 *(f"{self.addr(n)} {n}" for n in self.names)]
        self.hosts.write_text("\n".join(hosts) + "\n")
        (self.root / "bin").mkdir(exist_ok=True)  # files, not `python -c`: ps in a node shows a short PID 1
        (self.root / "bin" / "node_init.py").write_text(_INIT)
        (self.root / "bin" / "enter.py").write_text(_ENTER)
        self._write_conf(ctld=f"{CONTROLLER}({self.addr(CONTROLLER)})", ctld_port=CTLD_PORT,
                         slurmd_port=SLURMD_PORT, nodes={n: self.addr(n) for n in self.names}, per_node="%n")

    def _start_inits(self, deadline: float) -> None:
        unshare = _which("unshare") or "unshare"
        for name in [CONTROLLER, *self.names]:
            binds = [str(self.hosts), "/etc/hosts"]
            if name != CONTROLLER:
                binds += [str(self.node_dir(name)), str(self.node_local)]
            err = open(self.root / "log" / f"init-{name}.out", "ab")
            p = subprocess.Popen(
                [unshare, "--net", "--uts", "--pid", "--mount", "--fork", "--mount-proc", "--kill-child=SIGKILL",
                 sys.executable, "-I", "-S", str(self.root / "bin" / "node_init.py"), name, *binds],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent)
            err.close()
            self._inits[name] = (p, -1)  # the init's PID once it is ready; stop() kills unshare until then
        for name, (p, _) in self._inits.items():  # all start side by side: one wait, not one per node
            assert p.stdout is not None
            ready = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
            line = p.stdout.readline() if ready else b""
            p.stdout.close()
            child = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split() if line else []
            if not child:
                raise RuntimeError(f"node {name} did not start ({line!r}):\n{self.logs()}")
            self._inits[name] = (p, int(child[0]))

    def _ip(self, name: str, commands: list[str]) -> None:
        r = subprocess.run([_which("nsenter") or "nsenter", f"--net=/proc/{self.node_init_pid(name)}/ns/net", "--",
                            _which("ip") or "ip", "-batch", "-"], input="\n".join(commands) + "\n",
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"ip in {name} failed: {r.stderr.strip()}")

    def _network(self) -> None:
        ctl = ["link set lo up", "link add br0 type bridge", f"addr add {self.addr(CONTROLLER)}/24 dev br0",
               "link set br0 up"]
        for n in self.names:
            ctl += [f"link add {n} type veth peer name {IFACE} netns {self.node_init_pid(n)}",
                    f"link set {n} master br0", f"link set {n} up"]
        self._ip(CONTROLLER, ctl)
        for n in self.names:
            self._ip(n, ["link set lo up", f"addr add {self.addr(n)}/24 dev {IFACE}", f"link set {IFACE} up"])

    def _daemon(self, name: str, argv: list[str], what: str) -> None:
        self._daemons[what] = self.spawn(name, argv, log=self.root / "log" / f"{what}.out", cwd=self.root)

    def _dead(self) -> str | None:
        """What died of the cluster (an init, a daemon), if anything."""
        for what, p in [*((f"node {n}'s init", p) for n, (p, _) in self._inits.items()), *self._daemons.items()]:
            if p.poll() is not None:
                return f"{what} exited {p.returncode}"
        return None

    def start(self, timeout: float = 60) -> SlurmNodes:
        """Up to every node IDLE, or raise with the logs (and nothing left running). Call it from a thread that
        outlives the cluster (the main one): the namespaces die with the thread that started them."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        try:
            self._take_index()
            self._write_files()
            self._start_inits(deadline)
            self._network()
            self.munge_socket.unlink(missing_ok=True)  # a root used before: wait for this munged's socket
            self._daemon(CONTROLLER, self.munged_argv("-F"), "munged")
            while not self.munge_socket.exists():
                if self._dead() or time.monotonic() > deadline:
                    raise RuntimeError(f"munged did not start ({self._dead()}):\n{self.logs()}")
                time.sleep(0.02)
            self._daemon(CONTROLLER, [_which("slurmctld") or "slurmctld", "-D", "-i"], "slurmctld")
            for n in self.names:
                self._daemon(n, [_which("slurmd") or "slurmd", "-D", "-N", n], f"slurmd-{n}")
            self._wait_idle(self.names, deadline, self._dead)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Kill every node and the controller (all their processes with them) and free the index; idempotent."""
        for name in [*self.names, CONTROLLER]:  # nodes first: no slurmd outlives its controller
            if name in self._inits:
                p, pid = self._inits[name]
                if p.poll() is None:  # an init not ready yet: unshare's death kills it (--kill-child)
                    try:
                        os.kill(*((pid, signal.SIGTERM) if pid > 0 else (p.pid, signal.SIGKILL)))
                    except ProcessLookupError:
                        pass
        for name, (p, pid) in list(self._inits.items()):
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:  # an init that ignores SIGTERM: SIGKILL always ends a namespace
                for target in (pid, p.pid):
                    if target > 0:
                        try:
                            os.kill(target, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                p.wait(5)
            del self._inits[name]
        for p in self._procs:  # their commands died with the namespaces; reap the enter shims
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._procs.clear()
        self._daemons.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
