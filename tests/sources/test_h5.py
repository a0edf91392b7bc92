"""H5Source: contiguous, chunked, gzip, multi-file; each layout runs the SourceContract."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

h5py = pytest.importorskip("h5py")

from gpufeed.sources import FileChangedError, H5Source  # noqa: E402
from gpufeed.testing import SourceContract  # noqa: E402


def _data(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.integers(0, 256, size=(n, 3, 5), dtype=np.uint8),
        "y": rng.integers(-1000, 1000, size=n).astype(np.int64),
        "w": rng.standard_normal((n, 4)).astype(np.float32),
    }


def _write(path, data, **kw) -> None:
    with h5py.File(path, "w") as f:
        for name, arr in data.items():
            f.create_dataset(name, data=arr, **kw.get(name, kw.get("all", {})))


class TestH5Contiguous(SourceContract):
    def make_source(self, tmp_path):
        data = _data(45)
        _write(tmp_path / "a.h5", data)
        src = H5Source(tmp_path / "a.h5", fields=["x", "y", "w"])
        assert dict(src.paths_taken) == {"x": "contiguous", "y": "contiguous", "w": "contiguous"}
        return src, data


class TestH5Chunked(SourceContract):
    """Uncompressed chunks along samples only, count not a multiple of the chunk: read by byte offset."""

    def make_source(self, tmp_path):
        data = _data(47)
        _write(tmp_path / "c.h5", data, x={"chunks": (5, 3, 5)}, y={"chunks": (8,)}, w={"chunks": (3, 4)})
        src = H5Source(tmp_path / "c.h5", fields=["x", "y", "w"])
        assert set(src.paths_taken.values()) == {"chunked"}
        return src, data


class TestH5Gzip(SourceContract):
    def make_source(self, tmp_path):
        data = _data(41)
        _write(tmp_path / "z.h5", data, all={"chunks": True, "compression": "gzip", "shuffle": True})
        src = H5Source(tmp_path / "z.h5", fields=["x", "y", "w"])
        assert set(src.paths_taken.values()) in ({"gzip-cpu"}, {"gzip-gpu"})  # chunks decoded by gpufeed
        return src, data


class TestH5MultiFileMixed(SourceContract):
    """Three files of unequal length, each field contiguous in one, chunked in another, gzip in the third."""

    def make_source(self, tmp_path):
        data = _data(50, seed=3)
        bounds = [(0, 17), (17, 21), (21, 50)]
        layouts = [{}, {"all": {"chunks": True}}, {"all": {"chunks": True, "compression": "gzip"}}]
        paths = []
        for i, ((a, b), kw) in enumerate(zip(bounds, layouts, strict=True)):
            paths.append(tmp_path / f"part{i}.h5")
            _write(paths[-1], {k: v[a:b] for k, v in data.items()}, **kw)
        src = H5Source(paths, fields={"x": "x", "y": "/y", "w": "w"})
        assert set(src.paths_taken.values()) == {"mixed"}
        return src, data


class TestH5ChunksSplitSamples(SourceContract):
    def make_source(self, tmp_path):
        data = {"x": _data(30)["x"]}
        _write(tmp_path / "s.h5", data, x={"chunks": (4, 1, 5)})
        src = H5Source(tmp_path / "s.h5", fields=["x"])
        assert src.paths_taken["x"] == "h5py"
        assert "split a sample" in src.describe()
        return src, data


class TestH5BigEndian(SourceContract):
    """Big-endian on disk: h5py converts into native-order output."""

    def make_source(self, tmp_path):
        w = _data(25)["w"]
        with h5py.File(tmp_path / "be.h5", "w") as f:
            f.create_dataset("w", data=w.astype(">f4"))
        src = H5Source(tmp_path / "be.h5", fields=["w"])
        assert src.paths_taken["w"] == "h5py" and "big-endian" in src.describe()
        return src, {"w": w}


class TestH5NestedGroupsAllFields(SourceContract):
    """fields=None takes every dataset; names inside groups become the field names."""

    def make_source(self, tmp_path):
        data = _data(22)
        with h5py.File(tmp_path / "g.h5", "w") as f:
            f.create_dataset("inputs/x", data=data["x"])
            f.create_dataset("y", data=data["y"])
        src = H5Source(tmp_path / "g.h5")
        return src, {"inputs/x": data["x"], "y": data["y"]}


class TestH5ForcedH5py(SourceContract):
    def make_source(self, tmp_path):
        data = _data(26)
        _write(tmp_path / "a.h5", data)
        src = H5Source(tmp_path / "a.h5", fields=["x", "y", "w"], use_offsets=False)
        assert set(src.paths_taken.values()) == {"h5py"}
        return src, data


class TestH5MixedGather(SourceContract):
    """mmap_gather over a contiguous, a chunked and an lzf field: the lzf field keeps h5py."""

    def make_source(self, tmp_path):
        data = _data(61)
        _write(tmp_path / "a.h5", data, y={"chunks": (8,)}, w={"chunks": (8, 4), "compression": "lzf"})
        src = H5Source(tmp_path / "a.h5", fields=["x", "y", "w"], mmap_gather=True)
        assert dict(src.paths_taken) == {"x": "contiguous", "y": "chunked", "w": "h5py"}
        return src, data


def test_mmap_gather_gathers_shuffled_rows_of_fields_read_by_offset(tmp_path, monkeypatch):
    import gpufeed.sources._host_source as host

    data = _data(300)
    _write(tmp_path / "a.h5", data, w={"chunks": (8, 4), "compression": "lzf"})
    calls = []
    real = host.gather_rows
    monkeypatch.setattr(host, "gather_rows", lambda *a: (calls.append(a[3]), real(*a)))
    rows = np.sort(np.random.default_rng(0).choice(300, 50, replace=False))
    for gather, want in ((False, []), (True, [15, 8])):  # row bytes of x and y; w (lzf) keeps h5py
        src = H5Source(tmp_path / "a.h5", fields=["x", "y", "w"], mmap_gather=gather)
        out = {n: torch.empty(50, *a.shape[1:], dtype=torch.from_numpy(a).dtype) for n, a in data.items()}
        src.read(rows, out)
        assert src.mmap_gather is gather and calls == want
        assert all(np.array_equal(out[n].numpy(), a[rows]) for n, a in data.items())


def test_mmap_gather_with_nothing_read_by_offset_raises(tmp_path):
    _write(tmp_path / "a.h5", _data(10))
    with pytest.raises(ValueError, match=r"mmap_gather=True applies to fields read by byte offset"):
        H5Source(tmp_path / "a.h5", use_offsets=False, mmap_gather=True)


def test_describe_names_each_path_and_reason(tmp_path):
    data = _data(20)
    _write(tmp_path / "a.h5", {"x": data["x"]})
    _write(tmp_path / "b.h5", {"x": data["x"]}, x={"chunks": (4, 3, 5), "compression": "gzip"})
    src = H5Source([tmp_path / "a.h5", tmp_path / "b.h5"], fields=["x"])
    text = src.describe()
    assert "a.h5: contiguous" in text and "b.h5: gzip-" in text and "gzip (deflate level 4)" in text
    assert "40 samples" in text and "mixed" in repr(src)


def test_chunks_written_in_order_merge_into_few_extents(tmp_path):
    x = np.arange(1000, dtype=np.float32).reshape(250, 4)
    _write(tmp_path / "c.h5", {"x": x}, x={"chunks": (10, 4)})
    src = H5Source(tmp_path / "c.h5", fields=["x"])
    assert src.paths_taken["x"] == "chunked"
    assert len(src._layouts["x"].extents) < 25  # 25 chunks, mostly adjacent on disk
    out = {"x": torch.empty(250, 4)}
    src.read(range(250), out)
    assert np.array_equal(out["x"].numpy(), x)


def test_unwritten_storage_reads_the_fill_value_through_h5py(tmp_path):
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f.create_dataset("c", shape=(10,), dtype="f4", fillvalue=7.0)
        f.create_dataset("k", shape=(10,), dtype="f4", chunks=(4,), fillvalue=3.0)
        f["k"][0:4] = 1.0
    src = H5Source(tmp_path / "e.h5", fields=["c", "k"])
    assert dict(src.paths_taken) == {"c": "h5py", "k": "h5py"}
    out = {"c": torch.empty(10), "k": torch.empty(10)}
    src.read(range(10), out)
    assert out["c"].eq(7).all() and out["k"][:4].eq(1).all() and out["k"][4:].eq(3).all()


def test_no_hdf5_file_stays_open_after_construction(tmp_path):
    _write(tmp_path / "a.h5", _data(5))
    H5Source(tmp_path / "a.h5", fields=["x"])
    with h5py.File(tmp_path / "a.h5", "a") as f:  # would fail on a file locked for reading elsewhere
        f["x"][0] = 0


def test_a_file_cut_after_h5py_opened_it_is_an_error_not_zeros(tmp_path):
    """HDF5 reads past the end of an open file as zeros, without an error: rows of an lzf field (read by
    h5py) whose chunks were cut off must raise FileChangedError (an OSError) naming the file and its sizes,
    never come back wrong."""
    x = np.arange(200 * 1000, dtype=np.float32).reshape(200, 1000)
    path = tmp_path / "l.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(10, 1000), compression="lzf")
    src = H5Source(path, fields=["x"])
    out = {"x": torch.empty(10, 1000)}
    src.read(np.arange(10), out)  # h5py has the file open now
    assert torch.equal(out["x"], torch.from_numpy(x[:10]))
    size = path.stat().st_size
    os.truncate(path, size // 2)
    for start in (0, 100):  # a chunk before the cut, and one past it (h5py alone returned it wrong)
        with pytest.raises(FileChangedError, match=re.escape(f"{path} changed after the source was made: its "
                                                             f"size went from {size} to {size // 2} bytes")):
            src.read(np.arange(start, start + 10), out)
    src.close()
