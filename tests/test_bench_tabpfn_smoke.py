"""The nanoTabPFN scenario benchmark runs on the CPU (--smoke) and writes complete, verified rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("h5py")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tabpfn.py"
RAN = ("ideal", "original", "gpufeed_dataloader", "gpufeed_h5source", "gpufeed_raw")


def test_bench_tabpfn_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_tabpfn", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_tabpfn"] = bench  # dataclasses and DataLoader workers resolve it through sys.modules
    spec.loader.exec_module(bench)
    data = tmp_path / "data"
    args = ["--smoke", "--out", str(tmp_path), "--data-dir", str(data)]
    assert bench.main(args) == 0

    doc = json.loads((tmp_path / "tabpfn-cpu.json").read_text())
    assert "| method |" in (tmp_path / "tabpfn-cpu.md").read_text()
    assert {"card", "torch", "config", "rows", "targets", "article"} <= doc.keys()
    assert doc["card"] == "cpu" and doc["smoke"] is True
    cfg = doc["config"]
    assert cfg["batch_size"] == 6 and {"samples", "rows", "features", "steps", "warmup"} <= cfg.keys()
    rows = {r["method"]: r for r in doc["rows"]}
    assert list(rows) == list(bench.METHODS)
    for name in RAN:
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["verified"] is True, f"{name} delivered bytes that differ from the file"
        assert row["seconds"] > 0 and row["GBps"] > 0
        assert row["s_per_step"] == pytest.approx(row["seconds"] / cfg["steps"])
        assert row["over_ideal"] == pytest.approx(row["seconds"] / rows["ideal"]["seconds"])
        assert ("stall_fraction" in row and row["stall_fraction"] is not None) == name.startswith("gpufeed_")
    assert rows["ideal"]["over_ideal"] == pytest.approx(1.0)
    assert rows["gpufeed_raw"]["convert_s"] >= 0
    assert rows["gpufeed_gds"]["status"] == "skipped" and "CUDA" in rows["gpufeed_gds"]["skipped"]
    # every method trained the same model from the same seed on the same first batch
    assert doc["first_loss_equal"] is True
    assert [t["target"].split(":")[0] for t in doc["targets"]] == [n for n in RAN if n.startswith("gpufeed_")]

    # a second run reuses the file and the conversion
    assert bench.main([*args, "--methods", "ideal,gpufeed_raw"]) == 0
    doc = json.loads((tmp_path / "tabpfn-cpu.json").read_text())
    assert doc["data"]["h5_cached"] is True and doc["data"]["convert_cached"] is True
    assert [r["method"] for r in doc["rows"]] == ["ideal", "gpufeed_raw"]
