import shutil
import subprocess
import sys

import pytest


def test_ruff_is_clean_on_the_package():
    pytest.importorskip("ruff")
    exe = shutil.which("ruff") or sys.executable
    cmd = [exe, "check", "src"] if exe != sys.executable else [exe, "-m", "ruff", "check", "src"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 0, out.stdout + out.stderr
