"""The sources benchmark runs end to end on the CPU (--smoke) and writes complete, verified results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("h5py")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sources.py"


def test_bench_sources_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_sources", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_sources"] = bench  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(bench)
    data = tmp_path / "data"
    assert bench.main(["--smoke", "--out", str(tmp_path), "--data-dir", str(data)]) == 0

    doc = json.loads((tmp_path / "sources-cpu.json").read_text())
    assert (tmp_path / "sources-cpu.md").is_file()
    assert {"card", "torch", "rows", "targets", "gds", "cold_method"} <= doc.keys()
    assert doc["card"] == "cpu" and doc["smoke"] is True
    rows = {(r["workload"], r["cache"], r["method"]): r for r in doc["rows"]}
    for key in [
        ("raw", "warm", "pread16_ceiling"),
        ("raw", "warm", "numpy_memmap_to"),
        ("raw", "warm", "gpufeed_raw"),
        ("h5_contiguous", "warm", "gpufeed_h5"),
        ("h5_contiguous", "warm", "h5py_slice_to"),
        ("h5_contiguous", "warm", "h5py_read_direct_pinned"),
        ("h5_chunked", "warm", "gpufeed_h5"),
        ("h5_gzip", "warm", "h5py_slice_to"),
        ("h5_gzip", "warm", "gpufeed_h5_threads"),
        ("h5_gzip_shuffle", "warm", "h5py_slice_to"),
        ("h5_gzip_shuffle", "warm", "gpufeed_h5_threads"),
        ("shuffled_768B", "warm", "pread16_random"),
        ("shuffled_768B", "warm", "gpufeed_raw"),
        ("shuffled_768B", "warm", "gpufeed_h5"),
        ("shuffled_768B", "warm", "gpufeed_h5_chunked"),
        ("shuffled_256B", "warm", "gpufeed_raw"),
        ("shuffled_256B", "cold", "pread16_random"),
        ("shuffled_256B", "cold", "gpufeed_raw"),
        ("raw", "cold", "gpufeed_raw"),
    ]:
        row = rows[key]
        assert "error" not in row, row
        assert row["GBps"] > 0 and row["frac_of_ceiling"] > 0
        assert row["verified"] in (True, None), f"{key} delivered wrong bytes"
    assert rows[("h5_chunked", "warm", "gpufeed_h5")]["h5_path"] == "chunked"
    for w in ("h5_gzip", "h5_gzip_shuffle"):
        assert rows[(w, "warm", "gpufeed_h5_threads")]["h5_path"] == "gzip-cpu"
        assert rows[(w, "warm", "gpufeed_h5_threads")]["compression_ratio"] > 1.5
        assert "skipped" in rows[(w, "warm", "gpufeed_h5_gpu")]  # no CUDA here
    assert "skipped" in rows[("raw", "warm", "gpufeed_gds")]
    assert rows[("shuffled_256B", "warm", "gpufeed_raw")]["frac_of_random"] > 0
    assert rows[("shuffled_256B", "warm", "pread16_random")]["reader"] in ("native", "python")
    assert len(doc["targets"]) == len(bench.TARGETS)
