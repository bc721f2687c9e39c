"""``gpu-watchdog demo`` before it runs anything: without torch one line says what to install (exit 69), and
nothing is started or written."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from gpu_watchdog.errors import EXIT_UNAVAILABLE

NO_TORCH = textwrap.dedent("""\
    import sys

    class NoTorch:  # as if the [job] extra (torch) were not installed
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoTorch)
    from gpu_watchdog.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


def test_demo_without_torch_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "demo", "--keep", str(tmp_path / "demo")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_UNAVAILABLE, r
    assert r.stderr.strip().splitlines() == [
        "gpu-watchdog: the demo runs a torch job: pip install 'gpu-watchdog[job]' (or torch) first"], r.stderr
    assert r.stdout == "" and not (tmp_path / "demo").exists()
