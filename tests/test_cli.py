"""The gpufeed command line: bench, doctor, inspect, convert; output format, files written, errors."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from gpufeed import _cli_bench, _cli_doctor, _cli_util
from gpufeed._cli_util import format_bytes, parse_size, table
from gpufeed.cli import main

h5py = pytest.importorskip("h5py")

CPU_ONLY = not torch.cuda.is_available()
SIZE = "8MiB"
ROW = 1024 * 4 + 8


# -- helpers -------------------------------------------------------------------------------------------


def _table_rows(text: str, header: str) -> dict[str, str]:
    """Rows of the table that starts with ``header``, keyed by their first cell, up to a blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith("fastest:"):
            break
        rows[re.split(r"\s{2,}", line.strip())[0]] = line
    return rows


# -- top level -----------------------------------------------------------------------------------------


def test_console_script_help_lists_every_command():
    script = Path(sysconfig.get_path("scripts")) / "gpufeed"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "gpufeed.cli"]
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: gpufeed")
    for command in ("bench", "doctor", "inspect", "convert"):
        assert re.search(rf"^\s+{command}\s", proc.stdout, re.M), proc.stdout


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    assert "usage: gpufeed" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert re.fullmatch(r"gpufeed \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


# -- helpers of the CLI --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "nbytes"), [
    ("8MiB", 8 << 20), ("2GiB", 2 << 30), ("2 gib", 2 << 30), ("500MB", 500_000_000), ("1e9", 10**9),
    ("4k", 4096), ("0.5G", 1 << 29), ("123", 123), ("123B", 123),
])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "abc", "2XB", "-1MiB", "MiB"])
def test_parse_size_rejects_garbage_naming_it(text):
    with pytest.raises(ValueError, match=re.escape(f"not a size: {text!r}")):
        parse_size(text)


def test_format_bytes_and_table():
    assert [format_bytes(n) for n in (100, 4096, 256 << 20, 3 << 29, 4 << 30)] == [
        "100 B", "4 KiB", "256 MiB", "1.5 GiB", "4 GiB"]
    assert table(["name", "n"], [["a", 1], ["bbb", 22]], "lr").splitlines() == [
        "name   n", "a      1", "bbb   22"]


# -- bench ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_cpu(tmp_path_factory):
    """Run ``gpufeed bench`` once, small, on the CPU; return (exit code, stdout, stderr, out folder)."""
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "gpufeed.cli", "bench", "--size", SIZE, "--device", "cpu", "--out", str(out),
         "--workers", "1", "--batch-size", "512", "--min-seconds", "0.1", "--repeat", "3"],
        capture_output=True, text=True, timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr, out


def test_bench_cpu_writes_json_with_every_method(bench_cpu):
    rc, stdout, stderr, out = bench_cpu
    assert rc == 0, stderr + stdout
    doc = json.loads((out / "bench.json").read_text())
    assert set(doc) == {"gpufeed", "torch", "python", "device", "device_name", "cuda", "note", "read_path",
                        "config", "methods", "verdict"}
    assert doc["device"] == "cpu" and doc["cuda"] is False
    assert doc["note"] == " ".join(_cli_bench.CPU_NOTE)
    assert doc["read_path"] == {"native": _cli_util.native_reader()[0], "description": _cli_bench.read_path()}
    rows = (8 << 20) // ROW
    assert doc["config"] == {
        "size_bytes": rows * ROW, "rows": rows, "row_bytes": ROW, "batch_size": 512,
        "batches": -(-rows // 512), "workers": 1, "depth": 2, "rounds": 3, "min_seconds": 0.1,
        "cpu_count": os.cpu_count(),
    }
    assert [m["key"] for m in doc["methods"]] == list(_cli_bench.METHOD_KEYS)
    ok_keys = {"key", "name", "status", "reason", "seconds", "bytes", "batches", "epochs", "GBps",
               "wait_fraction", "speedup", "verified", "extra"}
    by_key = {m["key"]: m for m in doc["methods"]}
    for key in ("naive", "dataloader", "gpufeed_loader", "gpufeed_h5"):
        m = by_key[key]
        assert set(m) == ok_keys, key
        assert m["status"] == "ok" and m["verified"] is True, m
        # a run repeats whole epochs until it has lasted --min-seconds
        assert m["epochs"] >= 1 and m["seconds"] >= 0.1
        assert m["bytes"] == m["epochs"] * rows * ROW and m["batches"] == m["epochs"] * -(-rows // 512)
        assert m["GBps"] > 0 and 0 <= m["wait_fraction"] <= 1
        assert m["speedup"] == pytest.approx(m["GBps"] / by_key["naive"]["GBps"])
        runs = m["extra"]["runs_GBps"]
        assert len(runs) == 3 and m["extra"]["range_GBps"] == [min(runs), max(runs)]
    assert by_key["naive"]["speedup"] == 1.0
    assert by_key["dataloader"]["name"] == "DataLoader (1 workers) + .to()"
    assert by_key["gpufeed_loader"]["name"] == "gpufeed(DataLoader, 1 workers)"
    h5 = by_key["gpufeed_h5"]
    assert h5["extra"]["paths_taken"] == {"x": "contiguous", "y": "contiguous"}
    assert h5["extra"]["stats"]["batches"] == h5["epochs"] * -(-rows // 512)  # one prefetcher, every epoch
    assert doc["verdict"][0].startswith("verdict: ")
    if CPU_ONLY:
        gds = by_key["gpufeed_gds"]
        assert set(gds) == {"key", "name", "status", "reason", "extra"}
        assert gds["status"] == "skipped"
        assert gds["reason"] == "needs CUDA (GPUDirect Storage reads into GPU memory)"


def test_bench_cpu_prints_progress_table_and_files(bench_cpu):
    _, stdout, _, out = bench_cpu
    lines = stdout.splitlines()
    rows = (8 << 20) // ROW
    assert lines[0].startswith(
        f"gpufeed bench: 8 MiB synthetic HDF5 (x float32 [{rows}, 1024], y int64 [{rows}]), "
        "batch 512 rows (2 MiB), 4 batches, device cpu")
    assert lines[1] == f"  read path: {_cli_bench.read_path()}"  # which reader ran, as gpufeed doctor says
    assert lines[2] == ("  timing: 3 interleaved round(s), each method repeating epochs for >= 0.1 s a "
                        "round; shown: the median round and the range")
    if CPU_ONLY:  # what a CPU run can and cannot show, said before any figure
        assert lines[3:6] == [
            "  no GPU: this run measures reading and batching on the CPU only (every batch lands in host "
            "memory);",
            "  copies to the device, pinned memory and overlap with GPU compute are not measured, and they "
            "are",
            "  where gpufeed's speed-up lies. Run it on a GPU machine for what gpufeed is built for.",
        ]
    progress = [line for line in lines if re.match(r"  \[\d/5\] ", line)]
    assert [p.split("] ")[1][:34].rstrip() for p in progress] == [
        "naive h5py + .to()", "DataLoader (1 workers) + .to()", "gpufeed(DataLoader, 1 workers)",
        "gpufeed H5Source", "gpufeed GDSSource" if CPU_ONLY else progress[4].split("] ")[1][:34].rstrip()]
    for p in progress[:4]:
        assert re.search(r"\d+\.\d\d GB/s  wait +\d+\.\d%  +\d+\.\d\d s +\d+ epochs$", p), p
    header = next(line for line in lines if line.startswith("method "))
    assert header.split() == ["method", "GB/s", "range", "wait", "%", "vs", "naive", "time", "s", "epochs",
                              "note"]
    rows = _table_rows(stdout, "method ")
    figures = r"\s+\d+\.\d\d\s+\d+\.\d\d-\d+\.\d\d\s+\d+\.\d%\s+\d+\.\d\dx\s+\d+\.\d\d\s+\d+"
    assert re.fullmatch(r"naive h5py \+ \.to\(\)" + figures, rows["naive h5py + .to()"])
    assert rows["naive h5py + .to()"].split()[-3] == "1.00x"
    assert re.fullmatch("gpufeed H5Source" + figures, rows["gpufeed H5Source"])
    if CPU_ONLY:
        gds = rows["gpufeed GDSSource"]
        assert gds.split()[2:8] == ["-"] * 6
        assert gds.endswith("skipped: needs CUDA (GPUDirect Storage reads into GPU memory)")
    doc = json.loads((out / "bench.json").read_text())
    after = lines[lines.index(header) + len(doc["methods"]) + 1 :]
    assert after[:2] == list(_cli_bench.WAIT_NOTE)  # what wait % means, right under the table
    assert after[2 : 2 + len(doc["verdict"])] == doc["verdict"]
    if CPU_ONLY:
        assert after[2] == ("verdict: no GPU here: this measures the CPU path only; gpufeed's speed-up is on "
                            "a GPU, where it overlaps reading and copying with compute.")
    assert re.search(r"^  fastest: .+ at \d+\.\d\d GB/s", stdout, re.M)
    assert re.search(r"^  the rounds (agree|disagree): ", stdout, re.M)
    assert lines[-1] == f"wrote {out / 'bench.json'}, {out / 'bench.png'}"
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_bench_json_flag_prints_only_json_to_stdout(tmp_path, capsys):
    rc = main(["bench", "--min-seconds", "0", "--size", "2MiB", "--device", "cpu", "--out", str(tmp_path),
               "--json", "--no-chart",
               "--methods", "naive,gpufeed_h5", "--batch-size", "128"])
    assert rc == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert [m["key"] for m in doc["methods"]] == ["naive", "gpufeed_h5"]
    assert doc == json.loads((tmp_path / "bench.json").read_text())
    assert "[1/2] naive h5py + .to()" in cap.err and "[2/2] gpufeed H5Source" in cap.err
    assert "[2/2, run 5/5] gpufeed H5Source" in cap.err  # five interleaved rounds by default
    for m in doc["methods"]:  # the median of the five runs is the one reported, with their range
        runs = m["extra"]["runs_GBps"]
        assert len(runs) == 5 and round(m["GBps"], 3) == sorted(runs)[2]
        assert m["extra"]["range_GBps"] == [min(runs), max(runs)]
        assert m["epochs"] == 1  # --min-seconds 0: one epoch a run
    assert not (tmp_path / "bench.png").exists()


def test_bench_removes_its_data_unless_kept(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    args = ["bench", "--min-seconds", "0", "--size", "1MiB", "--device", "cpu", "--out", str(tmp_path / "o"),
            "--no-chart",
            "--methods", "naive", "--data-dir", str(data)]
    assert main(args) == 0
    assert list(data.iterdir()) == []
    assert main([*args, "--keep-data"]) == 0
    (kept,) = data.iterdir()
    assert (kept / "bench.h5").is_file()
    with h5py.File(kept / "bench.h5") as f:
        assert f["x"].shape == ((1 << 20) // ROW, 1024) and f["x"].dtype == np.float32
        assert f["x"].chunks is None and f["y"].chunks is None  # contiguous
        assert f["y"][:].tolist() == list(range((1 << 20) // ROW))
    assert f"kept the data set: {kept}" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--size", "lots"], "--size: not a size: 'lots'; write e.g. 256MiB, 2GiB, 500MB or 1e9"),
    (["--size", "1KiB"], "--size 1KiB is smaller than one row (4104 bytes); use e.g. 8MiB"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--depth", "0"], "--depth must be >= 1, got 0"),
    (["--repeat", "0"], "--repeat must be >= 1, got 0"),
    (["--min-seconds", "-1"], "--min-seconds must be >= 0, got -1.0"),
    (["--min-seconds", "nan"], "--min-seconds must be >= 0, got nan"),
    (["--methods", "naive,fast"],
     "--methods: unknown fast; choose from naive, dataloader, gpufeed_loader, gpufeed_h5, gpufeed_gds"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
])
def test_bench_bad_arguments(tmp_path, capsys, args, message):
    assert main(["bench", "--out", str(tmp_path), *args]) == 1
    assert capsys.readouterr().err.strip() == "gpufeed bench: error: " + message


@pytest.mark.skipif(not CPU_ONLY, reason="checks the message shown where CUDA is absent")
def test_bench_cuda_without_cuda_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--device", "cuda", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        "gpufeed bench: error: --device cuda: CUDA is not available here; use --device cpu")


def test_bench_reports_a_failing_method_and_exits_1(tmp_path, capsys, monkeypatch):
    def boom(cfg):
        raise RuntimeError("disk on fire")

    monkeypatch.setitem(_cli_bench._RUNNERS, "gpufeed_h5", boom)
    rc = main(["bench", "--min-seconds", "0", "--size", "1MiB", "--device", "cpu", "--out", str(tmp_path),
               "--no-chart",
               "--methods", "naive,gpufeed_h5"])
    assert rc == 1
    out = capsys.readouterr().out
    assert re.search(r"^gpufeed H5Source .* failed: RuntimeError: disk on fire$", out, re.M), out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["methods"][1] == {"key": "gpufeed_h5", "name": "gpufeed H5Source", "status": "failed",
                                 "reason": "RuntimeError: disk on fire", "extra": {}}


def test_bench_catches_a_method_that_loses_rows(tmp_path, capsys, monkeypatch):
    real = _cli_bench._RUNNERS["naive"]

    def lossy(cfg):
        meter, name, extra = real(cfg)
        meter.rows -= 1
        meter.ysum -= cfg.rows - 1  # the last row went missing
        return meter, name, extra

    monkeypatch.setitem(_cli_bench._RUNNERS, "naive", lossy)
    rc = main(["bench", "--min-seconds", "0", "--size", "1MiB", "--device", "cpu", "--out", str(tmp_path),
               "--no-chart",
               "--methods", "naive"])
    assert rc == 1
    (m,) = json.loads((tmp_path / "bench.json").read_text())["methods"]
    rows = (1 << 20) // ROW
    assert m["status"] == "failed"
    assert m["reason"] == (
        f"delivered {rows - 1} rows with sum(y) = {(rows - 1) * (rows - 2) // 2}; expected "
        f"{rows} rows with sum(y) = {rows * (rows - 1) // 2} (rows lost, repeated or corrupted)")


def test_bench_skips_sources_that_are_missing(tmp_path, capsys, monkeypatch):
    def missing(name):
        raise _cli_bench.Skip(f"gpufeed.sources.{name} does not exist in this version of gpufeed")

    monkeypatch.setattr(_cli_bench, "_import_source", missing)
    rc = main(["bench", "--min-seconds", "0", "--size", "1MiB", "--device", "cpu", "--out", str(tmp_path),
               "--no-chart",
               "--methods", "naive,gpufeed_h5"])
    assert rc == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["methods"][1]["status"] == "skipped"
    assert doc["methods"][1]["reason"] == "gpufeed.sources.H5Source does not exist in this version of gpufeed"


@pytest.mark.parametrize("native", [True, False])
def test_bench_header_names_the_read_path_doctor_reports(tmp_path, capsys, monkeypatch, native):
    from gpufeed.sources import _pread

    monkeypatch.delenv("GPUFEED_NATIVE_PREAD", raising=False)
    monkeypatch.setattr(_pread, "_NATIVE", (lambda *a: None) if native else None)
    assert main(["bench", "--min-seconds", "0", "--repeat", "1", "--size", "1MiB", "--device", "cpu",
                 "--out", str(tmp_path), "--no-chart", "--methods", "naive"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    if native:
        assert line == ("  read path: native C reader (_pread_many.so): gpufeed's sources read files in C, "
                        "the GIL released")
    else:
        assert line == ("  read path: Python os.preadv loop: the native C reader _pread_many.so is not in "
                        "use (the native reader was not built at install)")
    assert json.loads((tmp_path / "bench.json").read_text())["read_path"]["native"] is native
    assert _cli_doctor._page_cache_read(1 << 20)["shuffled_rows"] == ("native" if native else "python")


def test_bench_runs_epochs_until_min_seconds(tmp_path):
    assert main(["bench", "--min-seconds", "0.3", "--repeat", "1", "--size", "1MiB", "--device", "cpu",
                 "--out", str(tmp_path), "--no-chart", "--methods", "naive,gpufeed_h5",
                 "--batch-size", "64"]) == 0
    rows = (1 << 20) // ROW
    for m in json.loads((tmp_path / "bench.json").read_text())["methods"]:
        assert m["status"] == "ok" and m["verified"], m  # sum(y) checked over every epoch
        assert m["seconds"] >= 0.3 and m["epochs"] > 1
        assert m["bytes"] == m["epochs"] * rows * ROW


def _doc(cuda, rounds=3, **gbps):
    """A bench.json with the given methods' median GB/s (a range of +-5% unless given as a tuple)."""
    methods = []
    for key, v in gbps.items():
        med, lo, hi = v if isinstance(v, tuple) else (v, v * 0.95, v * 1.05)
        methods.append({"key": key, "name": dict(_cli_bench.METHODS)[key], "status": "ok", "GBps": med,
                        "speedup": med / gbps["naive"] if "naive" in gbps else None,
                        "extra": {"range_GBps": [lo, hi]}})
    return {"cuda": cuda, "config": {"rounds": rounds, "cpu_count": 2}, "methods": methods}


def test_bench_verdict_in_plain_words():
    v = _cli_bench.verdict
    assert v(_doc(False, naive=1.0, gpufeed_h5=1.05)) == [
        "verdict: no GPU here: this measures the CPU path only; gpufeed's speed-up is on a GPU, where it "
        "overlaps reading and copying with compute.",
        "  gpufeed's best here, gpufeed H5Source, is level with the naive loop (1.05x).",
        "  fastest: gpufeed H5Source at 1.05 GB/s, 1.1x the naive loop",
        "  the rounds agree: every method's fastest round within 1.11x of its slowest.",
    ]
    assert v(_doc(True, naive=3.0, dataloader=1.5, gpufeed_h5=24.0))[:2] == [
        "verdict: gpufeed's best here, gpufeed H5Source, delivered 8.0x the naive loop's rate.",
        "  fastest: gpufeed H5Source at 24.00 GB/s, 8.0x the naive loop",
    ]
    slower = v(_doc(False, naive=10.0, gpufeed_h5=(2.0, 1.0, 12.0)))
    assert slower[1:] == [
        "  gpufeed's best here, gpufeed H5Source, was slower than the naive loop (0.20x). On a CPU its "
        "reader threads share 2 cores with the loop and there is no device copy to hide behind.",
        "  fastest: naive h5py + .to() at 10.00 GB/s",
        "  the rounds disagree: gpufeed H5Source ran 1.00-12.00 GB/s (12.0x); the machine is busy or its "
        "state drifts: trust the medians less, or run again with a larger --min-seconds.",
    ]
    assert v(_doc(True, rounds=1, naive=1.0))[-1] == (
        "  one round only: no measure of how much the figures vary (use --repeat 3 or more).")
    assert v({"cuda": True, "config": {"rounds": 3}, "methods": []}) == [
        "verdict: no method ran here; the table's notes say why"]


def test_bench_dataset_opens_the_file_lazily_and_pickles_without_it(tmp_path):
    import pickle

    path = _cli_bench.write_dataset(str(tmp_path / "d.h5"), 10)
    ds = _cli_bench.H5Batches(path, rows=10, batch_size=4)
    assert len(ds) == 3
    assert ds._file is None
    assert ds[2]["y"].tolist() == [8, 9]
    assert ds._file is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._file is None and clone[0]["y"].tolist() == [0, 1, 2, 3]
    ds._file.close()
    clone._file.close()


# -- doctor --------------------------------------------------------------------------------------------


def test_doctor_reports_versions_bandwidth_and_advice(capsys):
    assert main(["doctor", "--probe-bytes", "4MiB"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "gpufeed doctor"
    import gpufeed

    assert f"  gpufeed            {gpufeed.__version__}" in lines
    assert any(line.startswith(f"  torch              {torch.__version__} (CUDA build: ") for line in lines)
    assert re.search(r"^  page-cache read    \d+\.\d GB/s one thread, \d+\.\d GB/s with \d+ threads "
                     r"\(4 MiB file in .+\)$", out, re.M), out
    assert f"  h5py               {h5py.__version__}  (HDF5 (H5Source, gpufeed bench))" in lines
    for module in ("kvikio", "nvtx", "torchdata", "matplotlib"):
        assert any(line.startswith(f"  {module:<18} ") for line in lines), module
    assert any(line.startswith("  GDS                would") for line in lines)
    threads = torch.get_num_threads()
    copy = f"torch's parallel copy, {threads} threads (torch.get_num_threads()); ToDevice: one"
    assert f"  staging copy       {copy}" in lines
    assert "advice:" in lines and lines[lines.index("advice:") + 1].startswith("  - ")
    if CPU_ONLY:
        assert "  CUDA               not available: device cpu" in lines
        assert "  H2D                n/a (no CUDA device)" in lines
        assert lines[lines.index("advice:") + 1].startswith("  - no CUDA device: gpufeed runs on the CPU")


def test_doctor_says_whether_the_gpu_s_idle_time_can_be_read():
    """On a CUDA machine: NVML's reading now, or that it cannot be read and what that costs (advice)."""
    r = _cli_doctor.collect(1 << 20)
    device = {"index": 0, "name": "H200", "count": 1, "memory_bytes": 1 << 30, "capability": "9.0"}
    r.update(cuda_available=True, device=device, h2d={"pinned_GBps": 50.0, "pageable_GBps": 40.0})
    for busy, row in ((0.42, "  GPU busy (NVML)    42% over the last 2 s; read once a second"),
                      (None, "  GPU busy (NVML)    not readable")):
        r["gpu_busy"] = busy
        text = _cli_doctor.render({**r, "advice": _cli_doctor.advice(r)})
        assert any(line.startswith(row) for line in text.splitlines()), text
        assert ("NVML's utilization cannot be read here" in text) is (busy is None)


def test_doctor_json(capsys):
    assert main(["doctor", "--json", "--probe-bytes", "2MiB"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"gpufeed", "python", "platform", "cpu_count", "torch", "torch_cuda", "cuda_available",
                        "device", "h2d", "gpu_busy", "page_cache_read", "staging_copy", "packages", "gds",
                        "env", "locked_memory_limit", "advice"}
    assert doc["staging_copy"] == {"threads": torch.get_num_threads()}
    assert set(doc["packages"]) == {"h5py", "kvikio", "nvtx", "torchdata", "matplotlib"}
    assert doc["packages"]["h5py"] == h5py.__version__
    assert doc["page_cache_read"]["bytes"] == 2 << 20 and doc["page_cache_read"]["threaded_GBps"] > 0
    assert set(doc["env"]) == {"GPUFEED_NVTX", "GPUFEED_TRACE", "GPUFEED_DEBUG", "GPUFEED_NATIVE_PREAD",
                               "KVIKIO_COMPAT_MODE", "KVIKIO_NTHREADS", "CUDA_VISIBLE_DEVICES"}
    assert doc["advice"]


def test_doctor_rejects_a_tiny_probe(capsys):
    assert main(["doctor", "--probe-bytes", "1KiB"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "gpufeed doctor: error: --probe-bytes must be at least 1MiB, got 1KiB"


def _fake_kvikio(monkeypatch, compat: bool, gds_driver: bool):
    """A stand-in for the kvikio 26.10 calls doctor makes.

    Those are ``kvikio.defaults.get``, ``kvikio.defaults.is_compat_mode_preferred`` and
    ``kvikio.cufile_driver.get("is_gds_available")``, as in kvikio 26.10's sources.
    """
    kvikio = types.ModuleType("kvikio")
    kvikio.__version__ = "26.10.00"
    defaults = types.ModuleType("kvikio.defaults")
    settings = {"compat_mode": "CompatMode.AUTO", "num_threads": 1}
    defaults.get = settings.__getitem__
    defaults.is_compat_mode_preferred = lambda: compat
    driver = types.ModuleType("kvikio.cufile_driver")
    driver.get = {"is_gds_available": gds_driver}.__getitem__
    kvikio.defaults, kvikio.cufile_driver = defaults, driver
    for name, mod in (("kvikio", kvikio), ("kvikio.defaults", defaults), ("kvikio.cufile_driver", driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(_cli_doctor, "version_of", lambda m: "26.10.0" if m == "kvikio" else None)


def test_doctor_gds_compat_mode(monkeypatch):
    _fake_kvikio(monkeypatch, compat=True, gds_driver=False)
    g = _cli_doctor._gds(cuda=True)
    assert (g["available"], g["mode"], g["gds_driver"], g["num_threads"]) == (True, "compat", False, 1)
    assert g["compat_mode_setting"] == "CompatMode.AUTO"
    assert g["reason"].startswith("compat mode: kvikio's threads pread into host memory")


def test_doctor_gds_driver_present(monkeypatch):
    _fake_kvikio(monkeypatch, compat=False, gds_driver=True)
    assert _cli_doctor._gds(cuda=True)["mode"] == "gds"
    g = _cli_doctor._gds(cuda=False)
    assert (g["available"], g["reason"]) == (False, "no CUDA device: GDSSource needs one")


def test_doctor_gds_without_kvikio(monkeypatch):
    monkeypatch.setattr(_cli_doctor, "version_of", lambda m: None)
    assert _cli_doctor._gds(cuda=True) == {
        "available": False, "mode": None, "reason": "kvikio is not installed (pip install 'gpufeed[gds]')"}


# -- inspect -------------------------------------------------------------------------------------------


@pytest.fixture
def mixed_h5(tmp_path):
    path = tmp_path / "mixed.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((100, 8), "f4")
        f["y"] = np.arange(100)
        f.create_dataset("chunked", data=np.zeros((100, 8), "f4"), chunks=(10, 8))
        f.create_dataset("split", data=np.zeros((100, 8), "f4"), chunks=(10, 4))
        zeros = np.zeros((100, 8), "f4")
        f.create_dataset("gz", data=zeros, chunks=(10, 8), compression="gzip", shuffle=True)
        f.create_dataset("lzf", data=np.zeros((100, 8), "f4"), chunks=(10, 8), compression="lzf")
        f.create_dataset("text", data=["a", "bb"], dtype=h5py.string_dtype())
        f.create_dataset("big", data=np.zeros((100,), ">f4"))
        f.create_dataset("scalar", data=3.0)
        f.create_dataset("unwritten", shape=(100, 3), dtype="f4")
        f.create_group("grp")["z"] = np.ones((100, 2), "u1")
    return path


#: gzip chunks are decoded on the GPU where CUDA and nvCOMP are, else by reader threads.
GZIP_ON_GPU = torch.cuda.is_available() and importlib.util.find_spec("nvidia.libnvcomp") is not None
EXPECTED_PATHS = {
    "/x": ("contiguous", "byte-offset pread (contiguous)"),
    "/y": ("contiguous", "byte-offset pread (contiguous)"),
    "/grp/z": ("contiguous", "byte-offset pread (contiguous)"),
    "/chunked": ("chunked (10, 8)", "chunk-index pread (uncompressed chunked)"),
    "/split": ("chunked (10, 4)", "h5py read_direct (chunks split a sample)"),
    "/gz": ("compressed(shuffle, gzip)", "chunk-index pread + GPU inflate (nvCOMP)" if GZIP_ON_GPU
            else "chunk-index pread + threaded inflate (zlib)"),
    "/lzf": ("compressed(lzf)", "h5py read_direct (lzf: gpufeed does not decode these filters)"),
    "/text": ("contiguous", "unsupported: vlen strings"),
    "/big": ("contiguous", "h5py read_direct (big-endian)"),
    "/scalar": ("contiguous", "unsupported: scalar (no sample axis)"),
    "/unwritten": ("contiguous (not allocated)", "h5py read_direct (not allocated)"),
}


def test_inspect_hdf5_names_the_read_path_of_every_dataset(mixed_h5, capsys):
    assert main(["inspect", str(mixed_h5)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert re.fullmatch(rf"{re.escape(str(mixed_h5))}: HDF5, 11 dataset\(s\), \d+(\.\d)? KiB", lines[0])
    assert re.fullmatch(r"dataset\s+shape\s+dtype\s+layout\s+read path", lines[1])
    rows = {line.split()[0]: re.split(r"\s{2,}", line.strip()) for line in lines[2:13]}
    assert set(rows) == set(EXPECTED_PATHS)
    for name, (layout, path) in EXPECTED_PATHS.items():
        assert rows[name][3:] == [layout, path], (name, rows[name])
    assert rows["/x"][:3] == ["/x", "(100, 8)", "float32"]
    assert rows["/text"][2] == "vlen str" and rows["/big"][2] == ">f4"
    assert lines[13] == "why (H5Source):"
    assert "  /x: contiguous (read by byte offset with os.preadv)" in lines
    assert any(line.startswith("  /text: H5Source: ") and "strings" in line for line in lines)
    assert lines[-1] == (f"use: H5Source({str(mixed_h5)!r}, fields=['big', 'chunked', 'grp/z', 'gz', 'lzf', "
                         "'split', 'unwritten', 'x', 'y'])")


def test_inspect_hdf5_json(mixed_h5, capsys):
    assert main(["inspect", "--json", str(mixed_h5)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "hdf5"
    got = {d["name"]: (d["layout"], d["read_path"]) for d in doc["datasets"]}
    assert got == EXPECTED_PATHS
    by_name = {d["name"]: d for d in doc["datasets"]}
    assert by_name["/gz"]["filters"] == ["shuffle", "gzip"]
    assert by_name["/text"]["supported"] is False and by_name["/x"]["decided_by"] == "H5Source"


def test_inspect_hdf5_without_sources_infers_from_metadata(mixed_h5, capsys, monkeypatch):
    from gpufeed import _cli_inspect

    monkeypatch.setattr(_cli_inspect, "_import_source", lambda name: None)
    assert main(["inspect", "--json", str(mixed_h5)]) == 0
    doc = json.loads(capsys.readouterr().out)
    from_metadata = {**EXPECTED_PATHS, "/gz": ("compressed(shuffle, gzip)",
                                               "chunk-index pread + gpufeed inflate (GPU or threads)")}
    assert {d["name"]: (d["layout"], d["read_path"]) for d in doc["datasets"]} == from_metadata
    assert main(["inspect", str(mixed_h5)]) == 0
    note = "note: read paths inferred from metadata; gpufeed.sources is not importable here"
    assert note in capsys.readouterr().out


def test_inspect_npy(tmp_path, capsys):
    path = tmp_path / "a.npy"
    np.save(path, np.zeros((10, 3), "f4"))
    assert main(["inspect", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: .npy (format 1.0), 248 B",
        "  shape        (10, 3)",
        "  dtype        float32",
        "  order        C",
        "  header size  128 bytes (data starts at byte 128)",
        "  data         120 bytes",
        "  read path    byte-offset pread (raw samples)",
        "  why          RawSource reads it by byte offset, after the header",
    ]


def test_inspect_npy_fortran_and_truncated(tmp_path, capsys):
    f_path = tmp_path / "f.npy"
    np.save(f_path, np.asfortranarray(np.zeros((10, 3), "f4")))
    assert main(["inspect", str(f_path)]) == 0
    out = capsys.readouterr().out
    assert "  order        F" in out
    assert ("  read path    unsupported: Fortran order (re-save with np.save(path, np.ascontiguousarray(a)))"
            in out)
    t_path = tmp_path / "t.npy"
    np.save(t_path, np.zeros((10, 3), "f4"))
    os.truncate(t_path, 200)
    assert main(["inspect", "--json", str(t_path)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] is False
    assert doc["read_path"] == "unsupported: truncated: the header says 120 data bytes, the file holds 72"


def test_inspect_manifest_valid_then_broken(mixed_h5, tmp_path, capsys):
    raw = tmp_path / "raw"
    assert main(["convert", str(mixed_h5), str(raw), "--fields", "x", "y"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(raw)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{raw / 'manifest.json'}: gpufeed manifest (gpufeed.raw v2), 2 field(s)"
    x_bin = json.loads((raw / "manifest.json").read_text())["fields"]["x"]["file"]  # x.gen-<id>.bin
    assert re.split(r"\s{2,}", lines[1]) == ["field", "samples", "shape", "dtype", "file", "bytes", "on disk"]
    assert re.split(r"\s+", lines[2]) == ["x", "100", "(8,)", "<f4", x_bin, "3200", "3200"]
    assert lines[-2] == ("valid: yes: every data file exists and has the size and sample count the manifest "
                         "records")
    assert lines[-1] == "read path: byte-offset pread (raw samples), by RawSource or GDSSource"
    os.truncate(raw / x_bin, 100)
    assert main(["inspect", str(raw / "manifest.json")]) == 1
    out = capsys.readouterr().out
    assert re.split(r"\s+", out.splitlines()[2]) == ["x", "100", "(8,)", "<f4", x_bin, "3200", "100"]
    assert re.search(rf"^valid: no: .*data file .*{x_bin} of field 'x' is 100 bytes", out, re.M), out
    assert out.splitlines()[-1] == "read path: unusable until fixed"


def test_inspect_bad_json_manifest(tmp_path, capsys):
    path = tmp_path / "manifest.json"
    path.write_text('{"format": 1')
    assert main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("valid: no: not valid JSON (")


@pytest.mark.parametrize(("content", "message"), [
    (None, "gpufeed inspect: error: no such file: {path}"),
    (b"hello world", "gpufeed inspect: error: cannot tell what {path} is: expected an HDF5 file, a .npy file "
                     "or a gpufeed manifest (manifest.json)"),
])
def test_inspect_bad_files(tmp_path, capsys, content, message):
    path = tmp_path / "thing.bin"
    if content is not None:
        path.write_bytes(content)
    assert main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err.strip() == message.format(path=path)


# -- convert -------------------------------------------------------------------------------------------


def test_convert_writes_raw_files_then_is_cached(mixed_h5, tmp_path, capsys):
    out = tmp_path / "raw"
    assert main(["convert", str(mixed_h5), str(out), "--fields", "x", "grp/z"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = f"{mixed_h5} -> {out / 'manifest.json'}: 2 field(s), 3.3 KiB, converted in "
    assert lines[0].startswith(head) and re.fullmatch(r"\d+\.\ds", lines[0][len(head):]), lines[0]
    x_line = r"  x: 100 samples of \(8,\) <f4 -> x\.gen-[0-9a-f]{12}\.bin"
    assert [ln for ln in lines if re.fullmatch(x_line, ln)]
    assert lines[-1] == f"read it with RawSource({str(out / 'manifest.json')!r}) or GDSSource(" \
                        f"{str(out / 'manifest.json')!r})"
    assert main(["convert", str(mixed_h5), str(out), "--fields", "x", "grp/z"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "2 field(s), 3.3 KiB, up to date (source unchanged), nothing rewritten")
    from gpufeed.sources import RawSource

    with RawSource(out / "manifest.json") as src:
        got = {"x": torch.empty(100, 8), "grp/z": torch.empty(100, 2, dtype=torch.uint8)}
        src.read(range(100), got)
    assert got["grp/z"].eq(1).all() and got["x"].eq(0).all()


def test_convert_errors(mixed_h5, tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope.h5"), str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.strip() == f"gpufeed convert: error: no such file: {tmp_path / 'nope.h5'}"
    assert main(["convert", str(mixed_h5), str(tmp_path / "o"), "--fields", "text"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpufeed convert: error: ") and "'text'" in err and "strings" in err


def test_convert_without_the_convert_module(mixed_h5, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gpufeed.convert", None)  # import fails like a missing module
    assert main(["convert", str(mixed_h5), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "gpufeed convert: error: gpufeed.convert.convert_h5_to_raw is not available in this install (")


def test_bench_trace_writes_a_perfetto_trace_per_gpufeed_method(tmp_path, capsys):
    rc = main(["bench", "--min-seconds", "0", "--size", "1MiB", "--device", "cpu", "--out", str(tmp_path),
               "--no-chart", "--trace",
               "--methods", "naive,gpufeed_h5", "--batch-size", "64", "--repeat", "1"])
    assert rc == 0
    trace = tmp_path / "trace-gpufeed_h5.json"
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'bench.json'}, {trace}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "trace-gpufeed_h5.json"]
    doc = json.loads(trace.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    batches = -(-((1 << 20) // ROW) // 64)
    assert len([e for e in spans if e["name"] == "wait"]) == batches + 1  # + the end of the epoch
    assert json.loads((tmp_path / "bench.json").read_text())["methods"][1]["extra"]["trace"] == str(trace)


def test_bench_trace_keeps_one_trace_per_run_and_points_at_the_reported_one(tmp_path, capsys):
    rc = main(["bench", "--min-seconds", "0", "--size", "1MiB", "--device", "cpu", "--out", str(tmp_path),
               "--no-chart", "--trace",
               "--methods", "gpufeed_h5", "--batch-size", "64", "--repeat", "3"])
    assert rc == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["bench.json"] + [f"trace-gpufeed_h5-run{r}.json" for r in (1, 2, 3)]
    m = json.loads((tmp_path / "bench.json").read_text())["methods"][0]
    trace = Path(m["extra"]["trace"])
    assert trace.parent == tmp_path and trace.name in names
    runs = m["extra"]["runs_GBps"]
    run = int(trace.stem.rsplit("run", 1)[1])
    assert runs[run - 1] == sorted(runs)[1] == round(m["GBps"], 3)  # the trace of the median run


def test_gpufeed_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPUFEED_DEBUG", "1")
    (tmp_path / "t.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"garbage" * 100)  # a broken HDF5 file
    with pytest.raises(Exception, match=r"cannot open .*t\.h5 as HDF5") as exc:
        main(["inspect", str(tmp_path / "t.h5")])
    assert isinstance(exc.value.__cause__, OSError)  # h5py's own error, chained
    monkeypatch.delenv("GPUFEED_DEBUG")
    assert main(["inspect", str(tmp_path / "t.h5")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gpufeed inspect: error: cannot open {tmp_path / 't.h5'} as HDF5 (")


def test_convert_lists_skipped_datasets_and_its_errors_name_the_flag(tmp_path, capsys):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"] = np.zeros((5, 2), np.float32)
        f["s"] = np.array(["a"] * 5, dtype=h5py.string_dtype())
    assert main(["convert", str(tmp_path / "in.h5"), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  x: 5 samples of \(2,\) <f4 -> x\.gen-[0-9a-f]{12}\.bin$", out, re.M)
    assert "  s: skipped (" in out and "  kept as metadata (source.metadata): s" in out
    assert "H5Source" not in out and "convert_h5_to_raw" not in out  # the CLI's words, not Python names
    assert main(["convert", str(tmp_path / "in.h5"), str(tmp_path / "bad"), "--fields", "x", "nope"]) == 1
    err = capsys.readouterr().err
    assert "has no dataset 'nope'" in err and "--fields" in err and "fields=" not in err
    assert "convert_h5_to_raw" not in err and "H5Source" not in err
    assert not (tmp_path / "bad").exists()
