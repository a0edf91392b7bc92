"""benchmarks/bench_trainers.py --smoke: every trainer's rows run on the CPU and the results are complete."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # (bench_loops, for --loops)
    spec = importlib.util.spec_from_file_location("bench_trainers", ROOT / "benchmarks" / "bench_trainers.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_trainers"] = bench
    spec.loader.exec_module(bench)
    return bench


def test_bench_trainers_smoke(tmp_path):
    for name in ("accelerate", "lightning", "transformers", "timm"):
        pytest.importorskip(name)
    bench = _load()
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
        paired = row["vs_own_paired"]  # (the own row against itself: 1 in every round)
        assert 0 < paired["min"] <= paired["median"] <= paired["max"]
        assert row["method"] != "own" or paired["min"] == paired["max"] == 1.0


def test_bench_trainers_under_two_launched_processes(tmp_path):
    """Under ``accelerate launch`` (torchrun's environment; gloo on the CPU) each process times its own
    shard, and rank 0 writes every process's rows."""
    import os

    from conftest import launched

    pytest.importorskip("accelerate")
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = launched([str(ROOT / "benchmarks" / "bench_trainers.py"), "--smoke", "--trainers", "accelerate",
                     "--out", str(tmp_path)], timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "trainers-launch-2x-cpu.json").read_text())
    assert doc["processes"] == 2
    assert sorted((r["rank"], r["method"]) for r in doc["rows"]) == [
        (0, "gpufeed"), (0, "own"), (1, "gpufeed"), (1, "own")]
    assert all("error" not in r and r["steps_per_s"] > 0 for r in doc["rows"])


def test_bench_trainers_smoke_trains_the_loops_steps(tmp_path):
    """``--loops``: the loops benchmark's steps (models, batches, losses) in accelerate, Lightning (its
    ``train_dataloader`` and a ``LightningDataModule``), HF Trainer and a torchtitan-style loop, a row a
    (step, trainer, method); timm, which trains its own image loop, is left out."""
    for name in ("accelerate", "lightning", "transformers"):
        pytest.importorskip(name)
    bench = _load()
    assert bench.main(["--smoke", "--loops", "mlp,token", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "trainers-loops-cpu.json").read_text())
    rows = {(r["loop"], r["trainer"], r["method"]) for r in doc["rows"] if "error" not in r}
    trainers = ("accelerate", "lightning", "lightning_dm", "hf_trainer", "torchtitan")
    assert rows == {(step, t, m) for step in ("mlp", "token") for t in trainers for m in ("own", "gpufeed")}


def test_vs_own_paired_divides_each_round_by_the_own_row_of_that_round():
    bench = _load()
    def row(trainer, method, rounds):
        median = sorted(rounds)[len(rounds) // 2]
        return {"trainer": trainer, "loop": "l", "method": method, "steps_per_s": median, "min": min(rounds),
                "max": max(rounds), "rounds": rounds}

    rows = [row("t", "own", [10.0, 8.0, 12.0]), row("t", "gpufeed", [11.0, 12.0, 9.0]),
            {"trainer": "t", "loop": "l", "method": "gpufeed_uint8", "error": "RuntimeError: a | b"},
            row("u", "gpufeed", [3.0])]
    bench.add_vs_own(rows)
    assert rows[1]["vs_own"] == 1.1
    assert rows[1]["vs_own_paired"] == {"median": 1.1, "min": 0.75, "max": 1.5,
                                        "lo": 0.75, "hi": 1.5, "coverage": 0.75}  # (3 rounds: their range)
    assert "vs_own" not in rows[2] and "vs_own" not in rows[3]  # (an error; a trainer without its own row)
    md = bench.markdown({"card": "cpu", "torch": "x", "smoke": True, "rows": rows,
                         "config": {"workers": 0, "warmup": 1, "steps": 1, "rounds": 3, "loops": ["l"]}})
    table = [line for line in md.splitlines() if line.startswith("| l: ")]
    assert len({line.replace("\\|", "").count("|") for line in table}) == 1  # (every row, as many cells)
    assert "1.10x (0.75-1.50)" in table[1]
