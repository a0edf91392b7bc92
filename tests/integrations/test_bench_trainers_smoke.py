"""benchmarks/bench_trainers.py --smoke: every trainer's rows run on the CPU and the results are complete."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_trainers_smoke(tmp_path):
    for name in ("accelerate", "lightning", "transformers", "timm"):
        pytest.importorskip(name)
    spec = importlib.util.spec_from_file_location("bench_trainers", ROOT / "benchmarks" / "bench_trainers.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_trainers"] = bench
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "trainers-cpu.json").read_text())
    assert (tmp_path / "trainers-cpu.md").is_file()
    assert doc["card"] == "cpu" and doc["smoke"] is True
    rows = {(r["trainer"], r["method"]): r for r in doc["rows"]}
    assert set(rows) == {(t, m) for t, methods in bench.METHODS.items() for m in methods}
    for row in rows.values():
        assert "error" not in row, row
        assert {"trainer", "method", "steps_per_s", "min", "max"} <= row.keys()
        assert 0 < row["min"] <= row["steps_per_s"] <= row["max"]
