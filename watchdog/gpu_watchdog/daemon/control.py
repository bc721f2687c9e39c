"""The daemon's control API: newline-delimited JSON over a unix stream socket, peers checked by SO_PEERCRED.

Socket: ``daemon.control_socket`` (default /run/gpu-watchdog/control.sock), mode 0660, group
``daemon.socket_group``. A peer is allowed when it is root (unless ``daemon.allow_root = false``, for
tests), its uid is in ``daemon.allowed_uids``, or its primary or supplementary group is in
``daemon.allowed_gids``; anyone else gets one refusal line and the connection is closed.

Requests (one JSON object per line; one JSON reply per line, always with ``ok``, and ``error`` when not ok):
- ``{"op": "job-start", "job_id", "pids": [..] | "cgroup": "…", "restart_hook": NAME|null,
  "checkpoint_opt_in": bool, "run": N|null}`` — the live pids are registered, those that exited are named in the
  reply's ``gone`` (refused only when none is live and no cgroup is given); a non-root peer may only register
  its own processes. ``run`` (Slurm: ``SLURM_RESTART_COUNT``) keys the job's control directory: a
  registration of the same run adds its pids to the job's (every srun task's TaskProlog registers), a new run
  replaces the registration and starts from a clean control directory. The reply names the run's
  ``control_dir`` and the job's fallback overlay (``level``, ``env``) for the TaskProlog to export.
- ``{"op": "job-end", "job_id"}``
- ``{"op": "preempt", "job_id", "timeout_s"}`` — ask the job to checkpoint now; waits (bounded by
  ``daemon.preempt_timeout_s``) for its acknowledgement.
- ``{"op": "restart", "job_id"}`` — checkpoint → stop → restart hook at the next fallback level.
- ``{"op": "status"}``, ``{"op": "incidents", "limit": N}``
A non-root peer may only end, preempt or restart jobs it registered.

One daemon per socket: ``start`` refuses (ServiceUnavailable, exit 69) when the socket already answers, and
removes only a stale one (nothing listening). The daemon never unlinks a socket it did not create (it compares
the file's device and inode with the one it bound); ``ensure`` (every tick and on SIGHUP) recreates a socket that
vanished and reports one that another process replaced.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpu_watchdog.config.schema import Config, DaemonSettings
from gpu_watchdog.daemon.cgroups import cgroup_pids, validate_cgroup
from gpu_watchdog.daemon.registry import live_pids
from gpu_watchdog.errors import ServiceUnavailable, UsageError, WatchdogError
from gpu_watchdog.model import RegisteredPid, Registration, validate_job_id


class Daemon(Protocol):
    """What the control API asks of the daemon (daemon.service.Daemon)."""

    cfg: Config
    settings: DaemonSettings
    state_dir: Path

    def registrations(self) -> dict[str, Registration]: ...
    def register(self, reg: Registration) -> None: ...
    def start_reply(self, job_id: str) -> dict[str, Any]: ...
    def unregister(self, job_id: str) -> bool: ...
    def manual_restart(self, job_id: str) -> bool: ...
    def preempt(self, job_id: str, timeout_s: float) -> dict[str, Any]: ...
    def status_report(self) -> dict[str, Any]: ...
    def recent_incidents(self, limit: int) -> list[dict[str, Any]]: ...

log = logging.getLogger("gpu_watchdog.daemon.control")
OPS = ("job-start", "job-end", "preempt", "restart", "status", "incidents")
MAX_PIDS = 4096


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(conn: socket.socket) -> PeerCred:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def _supplementary_gids(cred: PeerCred) -> set[int]:
    """The peer's supplementary groups from /proc, only if that pid still has the peer's uid."""
    try:
        text = Path(f"/proc/{cred.pid}/status").read_text()
    except OSError:
        return set()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        if int(fields.get("Uid", "").split()[0]) != cred.uid:
            return set()
        return {int(g) for g in fields.get("Groups", "").split()}
    except (ValueError, IndexError):
        return set()


def check_peer(cred: PeerCred, settings: DaemonSettings, supplementary: set[int] | None = None) -> str | None:
    """None when the peer may use the API, else why not."""
    if cred.uid == 0 and settings.allow_root:
        return None
    if cred.uid in settings.allowed_uids and cred.uid != 0:
        return None
    groups = {cred.gid} | (supplementary if supplementary is not None else _supplementary_gids(cred))
    if groups & set(settings.allowed_gids):
        return None
    return f"uid {cred.uid} gid {cred.gid} is not allowed (daemon.allowed_uids / daemon.allowed_gids)"


def socket_gid(settings: DaemonSettings) -> int | None:
    """The gid of ``daemon.socket_group``; None when it is empty or no such group exists (the socket keeps the
    daemon's group)."""
    if not settings.socket_group:
        return None
    try:
        return grp.getgrnam(settings.socket_group).gr_gid
    except KeyError:
        return None


class ControlServer:
    def __init__(self, settings: DaemonSettings, daemon: Daemon) -> None:
        self.settings = settings
        self.daemon = daemon
        self.path = Path(settings.control_socket)
        self._sock: socket.socket | None = None
        self._pending: socket.socket | None = None  # a recreated socket, for the accept thread to switch to
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file this server bound
        self._replaced_logged = False
        self._ensure_lock = threading.Lock()  # the tick and SIGHUP may both call ensure()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self._sock = self._bind()
        self._thread = threading.Thread(target=self._accept_loop, name="control", daemon=True)
        self._thread.start()

    def _bind(self) -> socket.socket:
        """Bind and listen on the socket path: refused when a daemon answers there; a stale socket is removed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        refuse_if_served(self.path)
        try:
            os.unlink(self.path)  # a stale socket from a killed daemon (refuse_if_served: nothing listens)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # never briefly reachable by others: created 0600, then widened to 0660
        try:
            sock.bind(str(self.path))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        st = os.lstat(self.path)
        self._identity = (st.st_dev, st.st_ino)
        gid = socket_gid(self.settings)
        if gid is not None:
            os.chown(self.path, -1, gid)
        elif self.settings.socket_group:
            log.warning("daemon.socket_group %r does not exist: socket keeps the daemon's group",
                        self.settings.socket_group)
        os.chmod(self.path, 0o660)
        sock.listen(32)
        sock.settimeout(0.5)
        return sock

    def ours(self) -> bool:
        """Whether the socket file at the path is the one this server bound (not a vanished or replaced one)."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def ensure(self) -> str | None:
        """Called every tick and on SIGHUP: None while the control API is reachable, else why not. A socket file
        that vanished is recreated (and logged); one replaced by another process is left alone (never unlinked)."""
        with self._ensure_lock:
            return self._ensure()

    def _ensure(self) -> str | None:
        if self._sock is None:
            return "the control API is not started"
        if self.ours():
            self._replaced_logged = False
            return None
        if os.path.lexists(self.path):
            why = (f"{self.path} is no longer this daemon's socket (replaced by another process): the control API "
                   "is unreachable; this daemon does not remove it")
            if not self._replaced_logged:
                log.error("control: %s", why)
                self._replaced_logged = True
            return why
        try:
            sock = self._bind()
        except (OSError, WatchdogError) as e:
            why = f"the control socket {self.path} vanished and cannot be recreated: {e}"
            log.error("control: %s", why)
            return why
        self._pending = sock  # the accept thread switches over and closes the old socket itself
        log.warning("control: the socket %s had vanished (deleted?): recreated", self.path)
        return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        for sock in (self._sock, self._pending):
            if sock is not None:
                sock.close()
        if self.ours():  # never another daemon's socket, nor a file put there after ours vanished
            try:
                self.path.unlink()
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            if self._pending is not None:  # ensure() recreated the socket: switch over, close the old one here
                old, self._sock, self._pending = self._sock, self._pending, None
                if old is not None:
                    old.close()
            assert self._sock is not None
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                cred = peer_cred(conn)
            except OSError as e:
                log.warning("control: cannot read peer credentials: %s", e)
                return
            why = check_peer(cred, self.settings)
            if why is not None:
                log.warning("control: refused pid %d: %s", cred.pid, why)
                _send(conn, {"ok": False, "error": f"permission denied: {why}"})
                return
            conn.settimeout(self.settings.peer_timeout_s)  # a stuck peer holds a thread, never the loop
            buf = b""
            limit = self.settings.max_request_bytes
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        _send(conn, self.handle_line(line, cred))
                if len(buf) > limit:
                    _send(conn, {"ok": False, "error": f"request longer than {limit} bytes"})
                    return

    def handle_line(self, line: bytes, cred: PeerCred) -> dict[str, Any]:
        try:
            req = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return {"ok": False, "error": "request is not valid JSON"}
        if not isinstance(req, dict):
            return {"ok": False, "error": "request must be a JSON object"}
        try:
            return handle_request(self.daemon, req, cred)
        except WatchdogError as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:  # a bug must not kill the connection thread silently
            log.exception("control: request failed")
            return {"ok": False, "error": f"internal error: {e}"}


def _send(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass


def _job_id(req: dict[str, Any]) -> str:
    job_id = req.get("job_id")
    if not isinstance(job_id, str):
        raise UsageError("job_id must be a string")
    return validate_job_id(job_id)


def _owned(daemon: Daemon, job_id: str, cred: PeerCred) -> Registration:
    reg = daemon.registrations().get(job_id)
    if reg is None:
        raise UsageError(f"job {job_id!r} is not registered")
    if cred.uid != 0 and reg.registered_by_uid != cred.uid:
        raise UsageError(f"job {job_id!r} was registered by another user")
    return reg


def handle_request(daemon: Daemon, req: dict[str, Any], cred: PeerCred) -> dict[str, Any]:
    """Validate and execute one request; UsageError → a refusal naming the field."""

    op = req.get("op")
    if op not in OPS:
        raise UsageError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if op == "status":
        return {"ok": True, **daemon.status_report()}
    if op == "incidents":
        limit = req.get("limit", 20)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= 1000:
            raise UsageError("limit must be an integer in 1..1000")
        return {"ok": True, "incidents": daemon.recent_incidents(limit)}
    job_id = _job_id(req)
    if op == "job-start":
        return _job_start(daemon, req, job_id, cred)
    _owned(daemon, job_id, cred)
    if op == "job-end":
        daemon.unregister(job_id)
        return {"ok": True, "job_id": job_id}
    if op == "restart":
        accepted = daemon.manual_restart(job_id)
        return {"ok": accepted, "job_id": job_id,
                **({} if accepted else {"error": "a recovery of this job is already running"})}
    # preempt
    timeout = req.get("timeout_s", daemon.settings.preempt_timeout_s)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise UsageError("timeout_s must be a number > 0")
    return daemon.preempt(job_id, min(float(timeout), daemon.settings.preempt_timeout_s))


@dataclass(frozen=True)
class JobStart:
    """A ``job-start`` request, its fields checked (``parse_job_start``); what the daemon then checks needs the
    machine (live pids, the cgroup) and its config (the hook names)."""

    pids: tuple[int, ...] = ()
    cgroup: str | None = None
    restart_hook: str | None = None
    checkpoint_opt_in: bool = False
    run: int | None = None


def parse_job_start(req: dict[str, Any], hooks: Collection[str]) -> JobStart:
    """The request's fields, each of its type, the hook one of ``hooks`` (the daemon's config); UsageError names the
    first that is wrong or unknown."""
    unknown = set(req) - {"op", "job_id", "pids", "cgroup", "restart_hook", "checkpoint_opt_in", "run"}
    if unknown:
        raise UsageError(f"unknown field {sorted(unknown)[0]!r}")
    hook = req.get("restart_hook")
    if hook is not None and (not isinstance(hook, str) or hook not in hooks):
        raise UsageError(f"unknown restart_hook {hook!r}: hooks are defined in the daemon's config only "
                         f"(known: {', '.join(sorted(hooks)) or 'none'})")
    opt_in = req.get("checkpoint_opt_in", False)
    if not isinstance(opt_in, bool):
        raise UsageError("checkpoint_opt_in must be true or false")
    run = req.get("run")
    if run is not None and (isinstance(run, bool) or not isinstance(run, int) or run < 0):
        raise UsageError("run must be an integer >= 0 or null")
    pids = req.get("pids", [])
    if not isinstance(pids, list) or len(pids) > MAX_PIDS:
        raise UsageError(f"pids must be a list of at most {MAX_PIDS} pids")
    return JobStart(tuple(pids), req.get("cgroup"), hook, opt_in, run)


def _job_start(daemon: Daemon, req: dict[str, Any], job_id: str, cred: PeerCred) -> dict[str, Any]:
    start = parse_job_start(req, daemon.cfg.hooks)
    procs, gone, cgroup = _live_processes(start)
    old = daemon.registrations().get(job_id)
    if cred.uid != 0:
        _refuse_others(procs, old, job_id, cred)
    if old is not None and old.run == start.run and old.registered_by_uid == cred.uid:
        # Another task of the same run (srun step): its pids join the job's; a dead one stays harmless (the
        # registry checks every pid's create time).
        mine = {p.pid for p in procs}
        procs = [p for p in old.pids if p.pid not in mine] + procs
        cgroup = cgroup or old.cgroup
    daemon.register(Registration(job_id, tuple(procs), cgroup, start.restart_hook, start.checkpoint_opt_in,
                                 cred.uid, start.run))
    log.info("control: job %s (run %s) registered by uid %d: pids %s, hook %s%s", job_id, start.run, cred.uid,
             [p.pid for p in procs], start.restart_hook, f"; exited before registration: {gone}" if gone else "")
    return {"ok": True, "job_id": job_id, "pids": [p.pid for p in procs], "gone": gone, "run": start.run,
            **daemon.start_reply(job_id)}


def _live_processes(start: JobStart) -> tuple[list[RegisteredPid], list[int], str | None]:
    """The request's live processes (its pids and its cgroup's), the pids already gone, and the cgroup."""
    pids = list(start.pids)
    if start.cgroup is not None:  # the cgroup is re-read every tick: it may still be empty (Slurm prolog)
        if not validate_cgroup(start.cgroup).is_dir():
            raise UsageError(f"cgroup {start.cgroup!r} does not exist")
        pids += cgroup_pids(start.cgroup)
    elif not pids:
        raise UsageError("job-start needs pids or a cgroup")
    procs, gone = live_pids(pids)
    if not procs and start.cgroup is None:
        raise UsageError(f"none of the pids {', '.join(map(str, gone))} is a live process")
    return procs, gone, start.cgroup


def _refuse_others(procs: list[RegisteredPid], old: Registration | None, job_id: str, cred: PeerCred) -> None:
    """A non-root registrant may register only its own processes, and never join another user's job."""
    for p in procs:
        if p.uid != cred.uid:
            raise UsageError(f"pid {p.pid} belongs to uid {p.uid}, not to you (uid {cred.uid})")
    if old is not None and old.registered_by_uid != cred.uid:
        raise UsageError(f"job {job_id!r} is registered by another user")


def refuse_if_served(path: str | Path) -> None:
    """ServiceUnavailable (exit 69) when a daemon answers on ``path``; returns when nothing is there or the socket
    is stale (connection refused: nothing listens). Anything else that is there is refused too: never replaced."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ServiceUnavailable(f"{path} exists and is not a socket: refusing to replace it")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(2.0)
    try:
        s.connect(str(path))
        pid = peer_cred(s).pid
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: a killed daemon's socket
    except OSError as e:
        raise ServiceUnavailable(f"cannot tell whether a daemon serves {path} ({e.strerror or e}): refusing to "
                                 "replace it") from None
    finally:
        s.close()
    raise ServiceUnavailable(f"another gpu-watchdog daemon (pid {pid}) already serves the control socket {path}: "
                             "not starting a second one (stop it first, or set daemon.control_socket)")


# -- client ------------------------------------------------------------------------------------------
def request(path: str, req: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """Send one request to the daemon and return its reply (ServiceUnavailable, exit 69, when it cannot be
    reached)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    except OSError as e:
        raise ServiceUnavailable(f"cannot reach the daemon at {path}: {e.strerror or e}") from None
    finally:
        s.close()
    try:
        reply = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        raise WatchdogError(f"the daemon at {path} sent no valid reply") from None
    return reply if isinstance(reply, dict) else {"ok": False, "error": "bad reply"}
