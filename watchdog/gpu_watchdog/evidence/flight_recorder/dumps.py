"""PyTorch Flight Recorder (FR): find a job's trace settings, ask ranks to dump, read the dumps.

FR keeps a ring buffer of each rank's recent collectives (RESEARCH §2). What we rely on, checked on
torch 2.13 (CPU build, gloo):
  * ``TORCH_FR_BUFFER_SIZE`` (alias ``TORCH_NCCL_TRACE_BUFFER_SIZE``) > 0 turns recording on; gloo
    records from torch 2.8.
  * Dumps go to ``<TORCH_FR_DUMP_TEMP_FILE><rank>`` (alias ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``;
    default ``/tmp/nccl_trace_rank_``).
  * ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<prefix>`` makes each NCCL rank create the FIFO
    ``<prefix><rank>.pipe``; writing a byte to it asks for a dump. Gloo has no such pipe (the CPU
    build does not even contain the variable); an in-job helper can serve the same FIFO with
    ``torch._C._distributed_c10d._dump_fr_trace()`` (tests/jobs/train.py ``--fr-pipe`` does).
  * A dump is a pickle of plain dicts/lists/str/int (no class references): keys ``version``,
    ``pg_config``, ``pg_status`` ({pg: {last_enqueued_collective, last_started_collective,
    last_completed_collective}}), ``entries`` (each with ``collective_seq_id``, ``profiling_name``
    such as ``gloo:all_reduce``, ``process_group`` = (pg name, desc), ``frames``, ``input_sizes``…).
We unpickle with an unpickler that refuses every class, so a planted file in /tmp runs no code.

``recording_env`` is what ``launch`` and the TaskProlog add to every job (``[flight_recorder]``, docs/evidence.md
"Flight Recorder on every job": the cost measured); ``SuspectDumps`` asks a job's ranks for their dumps once per
suspect streak, so that the incident finds them written when the stall is confirmed.
The shipped ``torchfrtrace`` analyzer crashes on gloo dumps; nothing here uses it: ``flight_recorder.analysis`` reads
the dumps of every process group and names the culprit.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_watchdog.evidence.flight_recorder.analysis import RankTrace, rank_trace

DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch >= 2.8 reads the first, older the second
DUMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
PIPE_VAR = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
RUN_DIR_NAME = "flight-recorder"  # inside a run's control directory: where the agent's FR settings point the ranks


class FlightRecorderError(Exception):
    """A dump file that is missing or not a Flight Recorder dump; the message is one line."""


@dataclass(frozen=True)
class FrSettings:
    buffer_size: int  # entries per rank; > 0 means FR records
    dump_prefix: str  # rank r dumps to f"{dump_prefix}{r}"
    pipe_prefix: str | None = None  # rank r listens on f"{pipe_prefix}{r}.pipe" (NCCL, or an in-job helper)
    dump_on_timeout: bool = False  # TORCH_NCCL_DUMP_ON_TIMEOUT: NCCL dumps by itself on a timeout

    def dump_path(self, rank: int) -> Path:
        return Path(f"{self.dump_prefix}{rank}")

    def pipe_path(self, rank: int) -> Path | None:
        return Path(f"{self.pipe_prefix}{rank}.pipe") if self.pipe_prefix else None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip() != "":
            return v.strip()
    return None


def fr_settings(env: Mapping[str, str]) -> FrSettings | None:
    """The FR settings a rank runs with, from its environment; None when FR is off (no buffer, zero, or
    not a number — torch then records nothing either)."""
    raw = _first(env, "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    try:
        size = int(raw) if raw is not None else 0
    except ValueError:
        return None
    if size <= 0:
        return None
    prefix = _first(env, "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or DEFAULT_DUMP_PREFIX
    pipe = _first(env, "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    on_timeout = _first(env, "TORCH_NCCL_DUMP_ON_TIMEOUT") not in (None, "0", "false", "False")
    return FrSettings(size, prefix, pipe, on_timeout)


def recording_env(job_env: Mapping[str, str], buffer_size: int, directory: str | os.PathLike[str]) -> dict[str, str]:
    """The Flight Recorder settings to add to a job whose environment is ``job_env``: recording
    (``buffer_size`` entries, under both of torch's names), dumps to ``<directory>/rank-<r>`` and NCCL's dump FIFO
    ``<directory>/pipe-<r>.pipe``. Only variables the job leaves unset (or empty) are added: what the user set
    always wins, and a job that turned recording off (a buffer of 0) gets nothing.

    The paths are added only when ``directory`` is a directory this process (the job's user: ``launch``, or the
    TaskProlog) may write: ProcessGroupNCCL's heartbeat thread creates the FIFO with a TORCH_CHECK, and a failure
    there terminates the rank, so a pipe path that cannot be created must never reach a job."""
    if buffer_size <= 0:
        return {}
    set_buffer = _first(job_env, *BUFFER_VARS)
    if set_buffer is not None:
        try:
            if int(set_buffer) <= 0:
                return {}  # the job turned recording off
        except ValueError:
            return {}  # torch would read it as off too
    env = {} if set_buffer is not None else {name: str(buffer_size) for name in BUFFER_VARS}
    d = Path(directory)
    if not (d.is_dir() and os.access(d, os.W_OK | os.X_OK)):
        return env
    if _first(job_env, *DUMP_VARS) is None:
        env.update({name: str(d / "rank-") for name in DUMP_VARS})
    if _first(job_env, PIPE_VAR) is None:
        env[PIPE_VAR] = str(d / "pipe-")
    return env


def prepare_run_dir(control_dir: str | os.PathLike[str], uid: int | None = None) -> Path | None:
    """``<control_dir>/flight-recorder`` for a new run: created, emptied of the last run's dumps and FIFOs, and
    handed to ``uid`` (the job's user, who writes there) when given. None when it cannot be made: the job then
    gets no dump paths (``recording_env``)."""
    d = Path(control_dir) / RUN_DIR_NAME
    try:
        d.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(d):
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
        if uid:
            os.chown(d, uid, -1)
    except OSError:
        return None
    return d


class SuspectDumps:
    """Ask a job's ranks for Flight Recorder dumps once per suspect streak (keyed by the streak's onset), off the
    sampling path; the incident then accepts the dumps written since (``asked_at``) instead of asking and waiting
    at confirmation. Only jobs whose ranks expose a dump trigger (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``) are asked.
    Thread-safe: ``claim`` runs on the tick, ``ask`` on a worker, ``asked_at`` in an incident."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streak: dict[str, float] = {}  # job → onset of the streak already claimed
        self._asked: dict[str, tuple[float, float, tuple[str, ...]]] = {}  # job → (onset, asked at, FIFOs that took it)

    def claim(self, job_id: str, onset: float) -> bool:
        """True once per (job, onset): the caller then runs ``ask`` for this streak."""
        with self._lock:
            if self._streak.get(job_id) == onset:
                return False
            self._streak[job_id] = onset
            self._asked.pop(job_id, None)
            return True

    def ask(self, job_id: str, onset: float, rank_pids: Mapping[int, int],
            environ: Any = None) -> tuple[str, ...]:
        """Read the job's FR settings from one rank's environment and write a byte to each rank's dump FIFO.
        Returns the FIFOs that took it (none: no FR, no trigger, or the ranks do not serve the FIFO)."""
        env = (environ or rank_environ)(rank_pids)
        settings = fr_settings(env)
        if settings is None or settings.pipe_prefix is None:
            return ()
        asked_at = time.time()
        done = tuple(trigger_dumps(settings, sorted(rank_pids)))
        if done:
            with self._lock:
                if self._streak.get(job_id) == onset:  # not a streak that ended meanwhile
                    self._asked[job_id] = (onset, asked_at, done)
        return done

    def asked_at(self, job_id: str, onset: float | None = None) -> tuple[float, tuple[str, ...]] | None:
        """(when, which FIFOs) the dumps of the job's current streak (or of ``onset``'s) were asked for."""
        with self._lock:
            rec = self._asked.get(job_id)
        if rec is None or (onset is not None and rec[0] != onset):
            return None
        return rec[1], rec[2]

    def end(self, job_id: str) -> None:
        """The job runs again, was restarted or ended: its next streak asks again."""
        with self._lock:
            self._streak.pop(job_id, None)
            self._asked.pop(job_id, None)

    def jobs(self) -> set[str]:
        with self._lock:
            return set(self._streak)


def rank_environ(rank_pids: Mapping[int, int]) -> dict[str, str]:
    """The environment of the first of the job's ranks that can be read (FR settings are job-wide)."""
    import psutil

    for _, pid in sorted(rank_pids.items()):
        try:
            return dict(psutil.Process(pid).environ())
        except Exception:
            continue
    return {}


def trigger_dumps(settings: FrSettings, ranks: Iterable[int]) -> list[str]:
    """Write one byte to each rank's dump FIFO; return the FIFO paths that took it.

    Opened O_WRONLY|O_NONBLOCK: with no reader the open fails at once (ENXIO) instead of blocking the
    agent; a missing path or a non-FIFO file (never written into) is skipped; a full pipe (EAGAIN)
    means a request is already pending, which counts as triggered."""
    done: list[str] = []
    for rank in ranks:
        path = settings.pipe_path(rank)
        if path is None:
            break
        try:
            if not stat.S_ISFIFO(os.stat(path).st_mode):
                continue
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue  # ENOENT, ENXIO (no reader), EACCES: this rank cannot be asked
        try:
            os.write(fd, b"1")
            done.append(str(path))
        except OSError as e:
            if e.errno == errno.EAGAIN:
                done.append(str(path))
        finally:
            os.close(fd)
    return done


def unserved(settings: FrSettings, ranks: Iterable[int], since: float | None) -> bool:
    """A dump pipe is set (``[flight_recorder]`` sets one for every job) but no rank created its FIFO, none dumps on a
    timeout and none left a dump since ``since``: nothing can give a dump (a gloo job without an in-job helper, or
    ranks that never created a process group), so there is nothing to ask and nothing to report."""
    if not settings.pipe_prefix or settings.dump_on_timeout:
        return False
    for rank in ranks:
        try:
            if stat.S_ISFIFO(os.stat(f"{settings.pipe_prefix}{rank}.pipe").st_mode):
                return False
        except OSError:
            pass
        try:
            if since is None or settings.dump_path(rank).stat().st_mtime >= since:
                return False
        except OSError:
            pass
    return True


def _dump_files(settings: FrSettings) -> dict[int, Path]:
    """{rank: path} of every ``<prefix><digits>`` file present."""
    prefix = Path(settings.dump_prefix)
    parent, stem = prefix.parent, prefix.name
    if settings.dump_prefix.endswith(os.sep):
        parent, stem = prefix, ""
    found: dict[int, Path] = {}
    try:
        names = os.listdir(parent)
    except OSError:
        return found
    for name in names:
        tail = name[len(stem):]
        if name.startswith(stem) and tail.isdigit():
            found[int(tail)] = parent / name
    return found


def collect_dumps(
    settings: FrSettings, dest_dir: str | os.PathLike[str], *, ranks: Iterable[int] | None = None,
    newer_than: float | None = None,
) -> list[Path]:
    """Copy ``<prefix><rank>`` files into ``dest_dir`` as ``fr-rank-<rank>.pkl`` (temp + rename, so a
    reader never sees half a file); return the copies, by rank. ``newer_than`` (unix seconds) skips
    dumps left over from earlier runs."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    wanted = None if ranks is None else set(ranks)
    out: list[Path] = []
    for rank, src in sorted(_dump_files(settings).items()):
        if wanted is not None and rank not in wanted:
            continue
        try:
            if not src.is_file() or (newer_than is not None and src.stat().st_mtime < newer_than):
                continue
            target = dest / f"fr-rank-{rank}.pkl"
            tmp = target.with_suffix(".tmp")
            shutil.copy2(src, tmp)  # keeps the mtime: the dump time, against which waits are measured
            os.replace(tmp, target)
        except OSError:
            continue  # vanished or unreadable: the other ranks still count
        out.append(target)
    return out


class _PlainUnpickler(pickle.Unpickler):
    """FR dumps hold only builtin containers and scalars; refuse any class so no code can run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing class {module}.{name}")


def load_dump(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one FR dump: the pickle torch writes, or the JSON of ``_dump_nccl_trace_json``. Raises
    FlightRecorderError with one line naming the file on any problem."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise FlightRecorderError(f"{p}: cannot read Flight Recorder dump: {e.strerror}") from e
    try:
        obj = json.loads(data) if data[:1] == b"{" else _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # any unpickling failure means "not a dump"
        msg = str(e).splitlines()[0] if str(e) else ""
        raise FlightRecorderError(f"{p}: not a Flight Recorder dump ({type(e).__name__}: {msg})") from e
    if not isinstance(obj, dict) or not isinstance(obj.get("entries"), list):
        raise FlightRecorderError(f"{p}: not a Flight Recorder dump (no 'entries' list)")
    return obj


_DUMP_NAME = re.compile(r"^(?!.*\.(?:pipe|tmp)$).*?(\d+)(?:\.(?:pkl|pickle|json))?$")


def dump_rank(path: str | os.PathLike[str], dump: Mapping[str, Any] | None = None) -> int | None:
    """The global rank a dump belongs to: its ``rank`` field when it has one, else the trailing digits of its file
    name (``<TORCH_FR_DUMP_TEMP_FILE prefix><rank>``, any prefix; ``fr-rank-<rank>.pkl`` in an incident)."""
    if dump is not None:
        r = dump.get("rank")
        if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
            return r
    m = _DUMP_NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def dump_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The regular files of ``directory`` named like FR dumps (trailing rank digits; FIFOs and temp files skipped)."""
    d = Path(directory)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    out: list[Path] = []
    for n in names:
        p = d / n
        try:
            if _DUMP_NAME.match(n) and stat.S_ISREG(os.stat(p).st_mode):
                out.append(p)
        except OSError:
            continue
    return out


def dumped_since(settings: FrSettings, ranks: Iterable[int], t: float) -> bool:
    """Whether every one of ``ranks`` has a dump file written at or after ``t`` (unix seconds)."""
    for rank in ranks:
        try:
            if settings.dump_path(rank).stat().st_mtime < t:
                return False
        except OSError:
            return False
    return True


def load_traces(files: Iterable[str | os.PathLike[str]], since: float | None = None) -> list[RankTrace]:
    """The analysis' view of each readable dump file (its rank from the dump or its name, its mtime the dump time);
    a file written before ``since``, missing, half-written or foreign is left out: it tells nothing."""
    traces = []
    for f in files:
        try:
            mtime = os.stat(f).st_mtime
            if since is not None and mtime < since:
                continue
            doc = load_dump(f)
            rank = dump_rank(f, doc)
            if rank is not None:
                traces.append(rank_trace(doc, rank, mtime))
        except Exception:
            continue
    return traces
