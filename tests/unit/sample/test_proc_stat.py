"""The one /proc/PID/stat reader: a fake proc root (the root is passed in), the real /proc, what vanished."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from gpu_watchdog.sample import proc_stat


def _stat(pid: int, comm: str, state: str, ppid: int, sid: int, start: int, exit_code: int | None) -> str:
    fields = [state, str(ppid), str(pid), str(sid)] + ["0"] * 15 + [str(start)] + ["0"] * 29
    if exit_code is not None:
        fields.append(str(exit_code))
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def test_fields_are_counted_from_the_last_parenthesis(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text(_stat(42, "a) (b c", "Z", 7, 40, 123456, 256))
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text(_stat(43, "old kernel", "S", 1, 43, 99, None))
    (tmp_path / "44").mkdir()
    (tmp_path / "44" / "stat").write_text("44 (cut short) R 1")
    (tmp_path / "self").mkdir()
    st = proc_stat.read_stat(42, root=str(tmp_path))
    assert st == proc_stat.ProcStat(42, "Z", 7, 40, 123456.0, 256)
    assert proc_stat.read_stat(43, root=str(tmp_path)).exit_code is None  # before Linux 3.5: no field 52
    assert proc_stat.read_stat(44, root=str(tmp_path)) is None
    assert proc_stat.read_stat(45, root=str(tmp_path)) is None  # gone
    assert set(proc_stat.scan(str(tmp_path))) == {42, 43}
    assert proc_stat.scan(str(tmp_path / "missing")) == {}


def test_the_real_proc_this_process_its_threads_and_a_zombie() -> None:
    me = proc_stat.read_stat(os.getpid())
    assert me is not None and me.ppid == os.getppid() and me.sid == os.getsid(0) and me.state == "R"
    assert proc_stat.read_stat(os.getpid(), threading.get_native_id()).state == "R"
    assert os.getpid() in proc_stat.threads(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    while (st := proc_stat.read_stat(child.pid)) is not None and st.state != "Z":
        pass
    assert st is not None and st.exit_code == 3 << 8  # waitpid form, until it is reaped
    child.wait()
    assert proc_stat.read_stat(child.pid) is None and proc_stat.threads(child.pid) == []
    assert os.getpid() in proc_stat.scan()
