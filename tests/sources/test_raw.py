"""RawSource: .npy, raw binary, several files, several fields; each case runs the SourceContract."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpufeed.sources import FileChangedError, RawSource
from gpufeed.testing import SourceContract


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 3, 4, 5), dtype=np.uint8)


class TestRawNpy(SourceContract):
    def make_source(self, tmp_path):
        x = _images(57)
        np.save(tmp_path / "x.npy", x)
        return RawSource(tmp_path / "x.npy"), {"x": x}


class TestRawNpyGather(SourceContract):
    def make_source(self, tmp_path):
        x = _images(57)
        np.save(tmp_path / "x.npy", x)
        return RawSource(tmp_path / "x.npy", mmap_gather=True), {"x": x}


class TestRawNpyScalars(SourceContract):
    def make_source(self, tmp_path):
        y = np.arange(33, dtype=np.int64) * 7 - 3
        np.save(tmp_path / "y.npy", y)
        return RawSource(tmp_path / "y.npy", name="y"), {"y": y}


class TestRawBinaryManyFiles(SourceContract):
    """Raw files with a header offset, concatenated, of unequal sizes (one empty)."""

    def make_source(self, tmp_path):
        x = np.random.default_rng(1).standard_normal((40, 6)).astype(np.float32)
        paths = []
        for i, (a, b) in enumerate([(0, 13), (13, 13), (13, 14), (14, 40)]):
            p = tmp_path / f"part{i}.bin"
            p.write_bytes(b"HEADER!!" + x[a:b].tobytes())
            paths.append(p)
        return RawSource(paths, dtype="float32", shape=(6,), offset=8), {"x": x}


class TestRawManyFieldsMixed(SourceContract):
    """An .npy field split over two files beside a raw bfloat16 field in one file."""

    def make_source(self, tmp_path):
        x = _images(30, seed=2)
        np.save(tmp_path / "a.npy", x[:11])
        np.save(tmp_path / "b.npy", x[11:])
        w = torch.randn(30, 2, dtype=torch.bfloat16)
        w_bits = w.view(torch.int16).numpy().view(np.uint16)
        (tmp_path / "w.bin").write_bytes(w_bits.tobytes())
        src = RawSource(
            fields={
                "x": [tmp_path / "a.npy", tmp_path / "b.npy"],
                "w": {"paths": tmp_path / "w.bin", "dtype": torch.bfloat16, "shape": 2},
            }
        )
        return src, {"x": x, "w": w_bits}


class TestRawNpyVersion2Header(SourceContract):
    def make_source(self, tmp_path):
        x = np.arange(120, dtype=np.float64).reshape(20, 6)
        with open(tmp_path / "v2.npy", "wb") as fh:
            np.lib.format.write_array(fh, x, version=(2, 0))
        return RawSource(tmp_path / "v2.npy"), {"x": x}


def test_fields_and_repr(tmp_path):
    np.save(tmp_path / "x.npy", _images(5))
    src = RawSource(tmp_path / "x.npy")
    assert src.reads_to == "host"
    assert src.fields["x"].shape == (3, 4, 5) and src.fields["x"].dtype == torch.uint8
    assert src.files == (str(tmp_path / "x.npy"),)
    assert "5 samples" in repr(src)
    with src:
        pass


def test_read_accepts_python_list_and_strided_range(tmp_path):
    x = _images(20)
    np.save(tmp_path / "x.npy", x)
    src = RawSource(tmp_path / "x.npy")
    out = {"x": torch.empty(3, 3, 4, 5, dtype=torch.uint8)}
    src.read(range(0, 6, 2), out)
    assert np.array_equal(out["x"].numpy(), x[[0, 2, 4]])
    src.read([5, 1, 2], out)
    assert np.array_equal(out["x"].numpy(), x[[5, 1, 2]])


def test_duplicate_rows_are_read_twice(tmp_path):
    x = _images(10)
    np.save(tmp_path / "x.npy", x)
    out = {"x": torch.empty(4, 3, 4, 5, dtype=torch.uint8)}
    RawSource(tmp_path / "x.npy").read(np.array([2, 2, 3, 3]), out)
    assert np.array_equal(out["x"].numpy(), x[[2, 2, 3, 3]])


def test_read_plan_one_read_per_run_and_file(tmp_path):
    from gpufeed.sources._runs import check_rows

    x = np.arange(10, dtype=np.int32)
    x.tofile(tmp_path / "x.bin")
    one = RawSource(tmp_path / "x.bin", dtype=np.int32)._layouts["x"]
    plan = one.byte_reads(check_rows(np.array([0, 1, 2, 3, 4, 7]), 10, "t"))
    assert plan == ([0, 0], [0, 28], [20, 4], [0, 20])
    # The same file twice: a run across the seam is split in two reads, one per extent.
    two = RawSource([tmp_path / "x.bin", tmp_path / "x.bin"], dtype=np.int32)._layouts["x"]
    assert two.byte_reads(check_rows(range(8, 12), 20, "t")) == ([0, 0], [32, 0], [8, 8], [0, 8])
    assert two.byte_reads(check_rows(np.array([1, 12]), 20, "t")) == ([0, 0], [4, 8], [4, 4], [0, 4])


def test_npy_dtype_and_shape_arguments_must_agree(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    assert len(RawSource(tmp_path / "x.npy", dtype="float32", shape=(2,))) == 4
    with pytest.raises(ValueError, match=r"dtype"):
        RawSource(tmp_path / "x.npy", dtype="float64")
    with pytest.raises(ValueError, match=r"shape"):
        RawSource(tmp_path / "x.npy", shape=(3,))


def test_paths_and_fields_are_exclusive(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"not both"):
        RawSource(tmp_path / "x.npy", fields={"x": tmp_path / "x.npy"})
    with pytest.raises(ValueError, match=r"paths"):
        RawSource()
    with pytest.raises(ValueError, match=r"keys"):
        RawSource(fields={"x": {"path": tmp_path / "x.npy"}})


def test_read_into_cuda_tensor_is_rejected_for_host_source(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    src = RawSource(tmp_path / "x.npy")
    out = {"x": torch.empty(4, 2, device="meta")}
    with pytest.raises(ValueError, match=r"host|cpu"):
        src.read(range(4), out)


def test_non_contiguous_out_is_rejected(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    src = RawSource(tmp_path / "x.npy")
    with pytest.raises(ValueError, match=r"contiguous"):
        src.read(range(4), {"x": torch.empty(2, 4).t()})


def _count_gathers(monkeypatch):
    """Rows per call of the memory-map gather, recorded as the reads go through it."""
    import gpufeed.sources._host_source as host

    calls = []
    real = host.gather_rows
    monkeypatch.setattr(host, "gather_rows", lambda *a: (calls.append(len(a[2])), real(*a)))
    return calls


def test_scattered_rows_are_gathered_from_a_memory_map(tmp_path, monkeypatch):
    x = np.arange(200 * 6, dtype=np.float32).reshape(200, 6)
    np.save(tmp_path / "a.npy", x[:90])
    np.save(tmp_path / "b.npy", x[90:])
    calls = _count_gathers(monkeypatch)
    src = RawSource([tmp_path / "a.npy", tmp_path / "b.npy"], mmap_gather=True)
    assert src.mmap_gather
    rows = np.sort(np.random.default_rng(0).choice(200, 40, replace=False))
    out = {"x": torch.empty(40, 6)}
    src.read(rows, out)
    assert calls == [40] and np.array_equal(out["x"].numpy(), x[rows])
    src.read(range(0, 40), out)  # one long run: pread, not the map
    assert calls == [40] and np.array_equal(out["x"].numpy(), x[:40])


def test_mmap_gather_false_maps_no_file(tmp_path, monkeypatch):
    x = np.arange(200 * 6, dtype=np.float32).reshape(200, 6)
    np.save(tmp_path / "a.npy", x)
    calls = _count_gathers(monkeypatch)
    rows = np.sort(np.random.default_rng(0).choice(200, 40, replace=False))
    out = {"x": torch.empty(40, 6)}
    src = RawSource(tmp_path / "a.npy", mmap_gather=False)
    src.read(rows, out)
    assert src.mmap_gather is False and src._maps is None
    assert calls == [] and np.array_equal(out["x"].numpy(), x[rows])


def test_without_the_native_gather_the_default_maps_no_file(tmp_path, monkeypatch):
    # index_select cannot survive a file cut under it (SIGBUS): only mmap_gather=True takes that risk.
    import gpufeed.sources._gather as gather

    monkeypatch.setattr(gather, "GATHER", None)
    np.save(tmp_path / "a.npy", np.zeros((4, 2), np.float32))
    assert RawSource(tmp_path / "a.npy")._maps is None
    assert RawSource(tmp_path / "a.npy", mmap_gather=True)._maps is not None


def test_the_environment_does_not_turn_the_gather_on(tmp_path):
    # The gather is an argument: no environment variable read at import changes a source's reads.
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    code = f"from gpufeed.sources import RawSource; print(RawSource({str(tmp_path / 'x.npy')!r}).mmap_gather)"
    env = {**os.environ, "GPUFEED_MMAP_GATHER": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "None"


def test_mmap_gather_takes_true_false_or_none(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"RawSource: mmap_gather must be True, False or None, got 'yes'"):
        RawSource(tmp_path / "x.npy", mmap_gather="yes")


def test_file_truncated_after_opening_raises_on_the_gather_path_too(tmp_path):
    x = np.zeros((100, 16), np.uint8)
    np.save(tmp_path / "x.npy", x)
    src = RawSource(tmp_path / "x.npy", mmap_gather=True)
    rows = np.arange(0, 100, 3)
    src.read(rows, {"x": torch.empty(len(rows), 16, dtype=torch.uint8)})  # maps the file
    os.truncate(tmp_path / "x.npy", os.path.getsize(tmp_path / "x.npy") - 40)
    with pytest.raises(FileChangedError, match=r"x.npy changed after the source was made: its size went"):
        src.read(rows, {"x": torch.empty(len(rows), 16, dtype=torch.uint8)})  # checked before the gather


def test_num_threads_is_checked_and_kept(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(10, dtype=np.int64))
    assert RawSource(tmp_path / "x.npy", num_threads=3).num_threads == 3
    assert RawSource(tmp_path / "x.npy").num_threads == min(8, os.cpu_count() or 1)
    for bad in (0, "4", 2.0, True):
        with pytest.raises(ValueError, match="RawSource: num_threads must be an int >= 1"):
            RawSource(tmp_path / "x.npy", num_threads=bad)


class _ThreadsSeen(torch.utils.data.Dataset):
    """Item i: the ``num_threads`` of each source, as a read in this (worker) process sees it."""

    def __init__(self, sources):
        self.sources = sources

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor([s.num_threads for s in self.sources])


def test_in_dataloader_workers_the_default_threads_share_the_cpus(tmp_path, monkeypatch):
    np.save(tmp_path / "x.npy", np.arange(10, dtype=np.int64))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # inherited by the forked workers
    sources = [RawSource(tmp_path / "x.npy"), RawSource(tmp_path / "x.npy", num_threads=3)]
    assert [s.num_threads for s in sources] == [8, 3]  # this process: up to 8 of the CPUs
    loader = torch.utils.data.DataLoader(_ThreadsSeen(sources), batch_size=None, num_workers=4,
                                         multiprocessing_context="fork")
    assert [t.tolist() for t in loader] == [[4, 3], [4, 3]]  # 16 CPUs among 4 workers; a given count kept
