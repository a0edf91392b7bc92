"""examples/accelerate_launch.py: one process, and two CPU processes as ``accelerate launch`` starts them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import launched

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "accelerate_launch.py"

pytest.importorskip("accelerate")


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def test_accelerate_launch_example_one_process():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--check", "--samples", "200"], capture_output=True,
                          text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0/1: 13 batches on cpu, exact" in proc.stdout
    assert "the ranks together cover the 200 samples" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "PASS"


def test_accelerate_launch_example_two_cpu_processes():
    # What `accelerate launch --num_processes 2` starts (torchrun's environment); on the CPU, accelerate
    # needs ACCELERATE_USE_CPU to join them with gloo.
    proc = launched([str(EXAMPLE), "--check", "--samples", "250"], timeout=120,
                    env=_env(ACCELERATE_USE_CPU="true"), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        # 16 batches of 16 (the last padded by accelerate's even_batches), half each, exact
        assert f"rank {rank}/2: 8 batches on cpu:0, exact" in proc.stdout
    assert "the ranks together cover the 250 samples" in proc.stdout
    assert [line for line in proc.stdout.splitlines() if line in ("PASS", "FAIL")] == ["PASS"]


def test_accelerate_launch_example_trains():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--samples", "128", "--epochs", "1"],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "epoch 0: loss " in proc.stdout
