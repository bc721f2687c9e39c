"""``gpu-watchdog doctor``: preflight checks, one line each with pass / warn / fail and the fix.

Catches, before a run is lost, what the field reports blamed hangs on: no NVML, py-spy unable to attach
(ptrace), a small /dev/shm (NCCL without P2P moves data through it), a kernel older than 5.5, an unwritable
state dir, a service without the capabilities it needs, and (``--p2p`` on a GPU box) a broken P2P path.
Exit status: 0 when nothing failed, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from gpu_watchdog.errors import BackendUnavailable

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
CAP_KILL = 5
CAP_SYS_PTRACE = 19
SHM_MIN_BYTES = 1 << 30
MIN_KERNEL = (5, 5)


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


NO_GPU_FIX = ('install the NVIDIA driver (nvidia-smi must work); on a node without GPUs set agent.backend = "proc" '
              'in the config (or pass --backend proc)')


def check_nvml(lib: Any = None, backend: str = "auto") -> Check:
    """NVML and its GPUs. With ``backend`` "proc" (a CPU node, configured so) NVML is not needed: its absence is
    shown as not present, not as a failure."""
    from gpu_watchdog.sample.nvml import NvmlReader

    reader = NvmlReader(lib)
    try:
        count = reader.start()
    except Exception as e:  # BackendUnavailable; pynvml missing its library raises at import on some versions
        detail = str(e) if isinstance(e, BackendUnavailable) else f"NVML cannot start: {e}"
        if backend == "proc":
            return Check("nvml", SKIP, f"not present (agent.backend = \"proc\" does not use it): {detail}")
        return Check("nvml", FAIL, detail, NO_GPU_FIX)
    finally:
        reader.shutdown()
    if count == 0:
        return Check("nvml", FAIL, "NVML works but sees no GPU", "check CUDA_VISIBLE_DEVICES / device cgroups")
    return Check("nvml", PASS, f"NVML (driver {reader.driver_version}) sees {count} GPU(s)")


def _caps(status_path: Path, field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s*([0-9a-f]+)$", status_path.read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1), 16) if m else None


def check_ptrace(py_spy: str | None, proc_root: Path = Path("/proc"), try_dump: bool = True) -> Check:
    from gpu_watchdog.evidence.stacks.dump import find_py_spy

    exe = find_py_spy(py_spy)
    if exe is None:
        return Check("py-spy", FAIL, "py-spy not found", "pip install py-spy (it is a gpu-watchdog dependency)")
    scope_path = proc_root / "sys/kernel/yama/ptrace_scope"
    try:
        scope: int | None = int(scope_path.read_text().strip())
    except (OSError, ValueError):
        scope = None  # no Yama LSM: classic ptrace rules
    eff = _caps(proc_root / "self/status", "CapEff") or 0
    has_cap = bool(eff >> CAP_SYS_PTRACE & 1)
    if scope == 3:
        return Check("py-spy", FAIL, "kernel.yama.ptrace_scope=3: ptrace is disabled until reboot",
                     "set kernel.yama.ptrace_scope to 0 or 1 at boot")
    if scope == 2 and not has_cap:
        return Check("py-spy", FAIL, "kernel.yama.ptrace_scope=2 and no CAP_SYS_PTRACE",
                     "run the agent as root with CAP_SYS_PTRACE (the systemd unit grants it)")
    if try_dump:
        outcome = _try_dump(exe)
        if outcome is not None:
            return outcome
    if scope == 1 and not has_cap:
        return Check("py-spy", WARN, f"{exe}: ptrace_scope=1 without CAP_SYS_PTRACE: only the agent's own "
                                     "children can be dumped (fine for launch, not for the daemon)",
                     "grant CAP_SYS_PTRACE or set kernel.yama.ptrace_scope=0")
    where = f"ptrace_scope={scope}" if scope is not None else "no Yama ptrace_scope"
    return Check("py-spy", PASS, f"{exe} attaches ({where}, CAP_SYS_PTRACE {'yes' if has_cap else 'no'})")


def _try_dump(exe: str) -> Check | None:
    """Dump a throwaway Python child for real: the only proof that attaching works here."""
    from gpu_watchdog.evidence.stacks.dump import dump_stacks

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        res = dump_stacks([child.pid], timeout_s=10.0, py_spy=exe)[0]
    finally:
        child.kill()
        child.wait()
    if res.ok:
        return None
    return Check("py-spy", FAIL, f"py-spy could not dump a test process: {res.detail}",
                 "run as root or grant CAP_SYS_PTRACE; in containers add --cap-add SYS_PTRACE")


def check_shm(path: str = "/dev/shm") -> Check:
    try:
        total = shutil.disk_usage(path).total
    except OSError:
        return Check("shm", FAIL, f"{path} is missing", "mount a tmpfs on /dev/shm (NCCL needs it)")
    if total < SHM_MIN_BYTES:
        return Check("shm", WARN, f"{path} is {total >> 20} MiB: NCCL_P2P_DISABLE=1 (fallback level 1) moves "
                                  "data through it and may fail", "docker run --shm-size=8g (or larger)")
    return Check("shm", PASS, f"{path} is {total >> 30} GiB")


def check_kernel(release: str | None = None) -> Check:
    release = release or platform.release()
    m = re.match(r"(\d+)\.(\d+)", release)
    if not m:
        return Check("kernel", WARN, f"cannot parse kernel release {release!r}")
    version = (int(m.group(1)), int(m.group(2)))
    if version < MIN_KERNEL:
        return Check("kernel", WARN, f"kernel {release} is older than 5.5: PyTorch warns that jobs may hang",
                     "upgrade the kernel to 5.5 or newer")
    return Check("kernel", PASS, f"kernel {release}")


def check_state_dir(path: Path) -> Check:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            pass
    except OSError as e:
        return Check("state-dir", FAIL, f"{path} is not writable: {e.strerror}",
                     "set agent.state_dir or --state-dir to a writable directory")
    return Check("state-dir", PASS, f"{path} is writable")


def check_capabilities(proc_root: Path = Path("/proc")) -> Check:
    bnd = _caps(proc_root / "self/status", "CapBnd")
    if bnd is None:
        return Check("capabilities", WARN, "cannot read the capability bounding set")
    missing = [name for name, bit in (("CAP_SYS_PTRACE", CAP_SYS_PTRACE), ("CAP_KILL", CAP_KILL))
               if not bnd >> bit & 1]
    if missing:
        return Check("capabilities", FAIL, f"the bounding set lacks {', '.join(missing)}: py-spy or the stop "
                                           "ladder will be refused",
                     "use systemd/gpu-watchdog.service's CapabilityBoundingSet")
    return Check("capabilities", PASS, "CAP_SYS_PTRACE and CAP_KILL are available")


# Run from a file, never ``python -c``: mp.spawn's children re-import __main__ to find ``work``, which a ``-c``
# script does not have ("Can't get attribute 'work' on <module '__main__' (built-in)>").
_P2P_SCRIPT = """
import os, sys, time, torch, torch.multiprocessing as mp, torch.distributed as dist
def work(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    t = torch.ones(1 << 24, device="cuda")
    for _ in range(5):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    n = torch.cuda.device_count()
    print(f"gpus={n}", flush=True)
    if n < 2:
        sys.exit(0)
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(work, args=(n, port), nprocs=n)
"""


def _run_group(argv: list[str], *, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` that kills the whole process group at the timeout: the spawned ranks of a hung
    all_reduce would otherwise outlive the check and keep their GPUs."""
    import signal

    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def check_p2p(timeout_s: float = 60.0, run: Callable[..., Any] = _run_group,
              script: str = _P2P_SCRIPT) -> list[Check]:
    """A short all_reduce across local GPUs with P2P on and off; a hang or failure with P2P on is the sign."""
    out = []
    with tempfile.TemporaryDirectory(prefix="gpu-watchdog-p2p-") as tmp:
        path = Path(tmp) / "p2p_check.py"
        path.write_text(script)
        for label, extra in (("p2p", {}), ("p2p-disabled", {"NCCL_P2P_DISABLE": "1"})):
            env = {**os.environ, **extra}
            t0 = time.monotonic()
            try:
                r = run([sys.executable, str(path)], env=env, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                out.append(Check(label, FAIL, f"all_reduce across local GPUs hung for {timeout_s:.0f}s",
                                 "use NCCL_P2P_DISABLE=1 on this box (fallback level 1)" if label == "p2p" else
                                 "NCCL is broken even without P2P: check the driver and NCCL_DEBUG=INFO"))
                continue
            gpus = re.search(r"^gpus=(\d+)$", r.stdout or "", re.M)
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or ["?"])[-1]
                out.append(Check(label, FAIL, f"all_reduce failed: {last}", "run with NCCL_DEBUG=INFO to see why"))
            elif gpus is not None and int(gpus.group(1)) < 2:
                out.append(Check(label, SKIP, f"torch sees {gpus.group(1)} GPU(s): no peer to test P2P with"))
            else:
                out.append(Check(label, PASS, f"all_reduce across local GPUs took {time.monotonic() - t0:.1f}s"))
    return out


def run_doctor(state_dir: Path, py_spy: str | None, p2p: bool, as_json: bool, out: TextIO = sys.stdout,
               backend: str = "auto") -> int:
    nvml = check_nvml(backend=backend)
    checks = [nvml, check_ptrace(py_spy), check_shm(), check_kernel(), check_state_dir(state_dir),
              check_capabilities()]
    if p2p:
        checks += check_p2p() if nvml.status == PASS else [
            Check("p2p", SKIP, "no GPU: the P2P check needs NVML and at least one GPU")]
    if as_json:
        json.dump([asdict(c) for c in checks], out, indent=1)
        out.write("\n")
    else:
        for c in checks:
            fix = f" — fix: {c.fix}" if c.fix and c.status in (WARN, FAIL) else ""
            out.write(f"{c.status.upper():<4}  {c.name:<13} {c.detail}{fix}\n")
    return 1 if any(c.status == FAIL for c in checks) else 0
