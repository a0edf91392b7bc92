"""H5Source over gzip and shuffle+gzip HDF5: chunks read by byte offset and decoded by gpufeed.

Every filter combination h5py writes round-trips byte for byte: on the CPU (reader threads, zlib), through
the GPU decoder's own code with a CPU stand-in for nvCOMP (staging, alignment, pointers, adler32, unshuffle
and row placement run for real), and on the GPU with nvCOMP (``-m cuda``). Corrupted chunks raise an error
naming the file, the dataset and the chunk.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

h5py = pytest.importorskip("h5py")

from gpufeed.sources import H5Source, _gpu_inflate, _nvcomp  # noqa: E402
from gpufeed.sources.h5_chunks import CorruptChunkError, chunk_table, unshuffle  # noqa: E402
from gpufeed.testing import SourceContract  # noqa: E402

# (shape, chunks, dtype): 1-D and N-D, chunks that hold whole samples, that split them, that do not divide
# the dataset, element sizes 1, 2, 4 and 8.
CASES = [
    ((41,), (6,), "<i2"),
    ((50,), (50,), "<f8"),
    ((37, 3, 5), (4, 3, 5), "<f4"),
    ((37, 3, 5), (4, 2, 3), "<f8"),
    ((23, 7), (5, 7), "u1"),
    ((30, 4, 6), (7, 3, 4), "<u2"),
    ((19, 2, 3), (19, 1, 1), "<i8"),
    ((26, 9), (3, 9), "<c8"),
]
FILTERS = [  # what h5py writes: gzip alone (levels), and shuffle then gzip
    {"compression": "gzip", "compression_opts": 1},
    {"compression": "gzip", "compression_opts": 9},
    {"compression": "gzip", "shuffle": True},
    {"compression": "gzip", "compression_opts": 0, "shuffle": True},
]


def _array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 7, size=shape) + np.arange(np.prod(shape)).reshape(shape) % 13  # compressible
    return a.astype(dtype)


def _write(path, arrays: dict, **kw):
    with h5py.File(path, "w") as f:
        for name, (arr, chunks) in arrays.items():
            f.create_dataset(name, data=arr, chunks=chunks, **kw)


def _read(src, rows, device="cpu"):
    out = {n: torch.empty((len(rows), *f.shape), dtype=f.dtype, device=device) for n, f in src.fields.items()}
    src.read(rows, out)
    return {n: t.cpu() for n, t in out.items()}


def _same(t: torch.Tensor, want: np.ndarray) -> bool:
    got = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.array_equal(got, np.ascontiguousarray(want).reshape(-1).view(np.uint8))


def _row_sets(n):
    rng = np.random.default_rng(1)
    return [range(n), range(n // 3, n - 1), np.sort(rng.choice(n, n // 2, replace=False)),
            rng.permutation(n)[: max(1, n // 3)], np.array([n - 1, 0, n // 2, 0]), range(n - 1, n)]


class FakeNvcomp:
    """nvCOMP's three calls done with zlib on host memory: the GPU decoder's code runs on the CPU, with its
    real pointer arithmetic (the "device" addresses are host addresses here)."""

    alignments = (4, 1, 1)

    def temp_bytes(self, chunks, max_chunk_bytes, total_bytes, stream):
        return 0

    def decompress(self, comp_ptrs, comp_bytes, buffer_bytes, actual_bytes, k, temp, temp_bytes, out_ptrs,
                   statuses, stream):
        def arr(addr, ctype):
            return np.ctypeslib.as_array((ctype * k).from_address(addr))

        cp, cb, bb = arr(comp_ptrs, ctypes.c_int64), arr(comp_bytes, ctypes.c_int64), arr(buffer_bytes,
                                                                                            ctypes.c_int64)
        ab, op, sts = arr(actual_bytes, ctypes.c_int64), arr(out_ptrs, ctypes.c_int64), arr(statuses,
                                                                                          ctypes.c_int32)
        for i in range(k):
            try:
                raw = ctypes.string_at(int(cp[i]), int(cb[i]))
                data = zlib.decompressobj(-15).decompress(raw, int(bb[i]))  # raw deflate, as nvCOMP
                sts[i] = 0
            except zlib.error:
                data, sts[i] = b"", 12  # nvcompErrorCannotDecompress
            ctypes.memmove(int(op[i]), data, len(data))
            ab[i] = len(data)


def _fake_gpu_read(path, name, rows, nv=None):
    """Rows of dataset ``name`` through _gpu_inflate.inflate_rows with the CPU stand-in; returns the bytes."""
    with h5py.File(path, "r") as f:
        table = chunk_table(f[name], str(path))
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        rows = np.asarray(rows, dtype=np.int64)
        out = torch.full((len(rows), *table.sample_byte_shape()), 0xA5, dtype=torch.uint8)
        pending = _gpu_inflate.inflate_rows(nv or FakeNvcomp(), table, fd, rows, np.arange(len(rows)), out, 0)
        pending.check()
        return out
    finally:
        os.close(fd)


# -- CPU: reader threads with zlib ------------------------------------------------------------------------


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: "+".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("shape,chunks,dtype", CASES)
def test_every_filter_combination_round_trips_on_the_cpu(tmp_path, shape, chunks, dtype, filters):
    a = _array(shape, dtype)
    _write(tmp_path / "z.h5", {"x": (a, chunks)}, **filters)
    src = H5Source(tmp_path / "z.h5", fields=["x"], decode="cpu")
    assert src.paths_taken["x"] == "gzip-cpu" and src.reads_to == "host"
    for rows in _row_sets(shape[0]):
        assert _same(_read(src, rows)["x"], a[np.asarray(list(rows) if isinstance(rows, range) else rows)])
    src.close()


@pytest.mark.parametrize("filters", FILTERS[1:3], ids=["gzip9", "shuffle+gzip"])
@pytest.mark.parametrize("shape,chunks,dtype", CASES)
def test_the_gpu_decoder_code_round_trips_with_a_cpu_stand_in_for_nvcomp(tmp_path, shape, chunks, dtype,
                                                                         filters):
    a = _array(shape, dtype, seed=2)
    _write(tmp_path / "z.h5", {"x": (a, chunks)}, **filters)
    for rows in _row_sets(shape[0]):
        idx = np.asarray(list(rows) if isinstance(rows, range) else rows)
        got = _fake_gpu_read(tmp_path / "z.h5", "x", idx)
        assert np.array_equal(got.numpy().reshape(-1), np.ascontiguousarray(a[idx]).view(np.uint8).ravel())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_datasets_round_trip(tmp_path_factory, data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    shape = (data.draw(st.integers(1, 40)), *shape[1:])
    chunks = tuple(data.draw(st.integers(1, s)) for s in shape)
    dtype = data.draw(st.sampled_from(["u1", "<i2", "<f4", "<f8"]))
    shuffle = data.draw(st.booleans())
    level = data.draw(st.integers(0, 9))
    a = _array(shape, dtype, seed=data.draw(st.integers(0, 99)))
    path = tmp_path_factory.mktemp("h") / "z.h5"
    _write(path, {"x": (a, chunks)}, compression="gzip", compression_opts=level, shuffle=shuffle)
    rows = np.array(data.draw(st.lists(st.integers(0, shape[0] - 1), min_size=1, max_size=60)), np.int64)
    with H5Source(path, fields=["x"], decode="cpu") as src:
        assert _same(_read(src, rows)["x"], a[rows])
    assert np.array_equal(_fake_gpu_read(path, "x", rows).numpy().reshape(-1),
                          np.ascontiguousarray(a[rows]).reshape(-1).view(np.uint8))


class TestGzipThreads(SourceContract):
    """The whole contract over gzip and shuffle+gzip fields decoded by reader threads (threads, pickling,
    a forked child)."""

    def make_source(self, tmp_path):
        data = {"x": _array((45, 3, 5), "<f4"), "y": _array((45,), "<i8", 1), "w": _array((45, 4), "u1", 2)}
        with h5py.File(tmp_path / "z.h5", "w") as f:
            f.create_dataset("x", data=data["x"], chunks=(4, 2, 3), compression="gzip", shuffle=True)
            f.create_dataset("y", data=data["y"], chunks=(7,), compression="gzip", compression_opts=9)
            f.create_dataset("w", data=data["w"])  # contiguous beside them
        src = H5Source(tmp_path / "z.h5", fields=["x", "y", "w"], decode="cpu")
        assert dict(src.paths_taken) == {"x": "gzip-cpu", "y": "gzip-cpu", "w": "contiguous"}
        return src, data


class TestGzipAcrossFiles(SourceContract):
    """A field gzip in one file, contiguous in a second and lzf (h5py) in a third."""

    def make_source(self, tmp_path):
        a = _array((50, 6), "<f4", 5)
        kws = [{"chunks": (4, 3), "compression": "gzip", "shuffle": True}, {}, {"chunks": (5, 6),
                                                                                  "compression": "lzf"}]
        paths = []
        for i, ((lo, hi), kw) in enumerate(zip([(0, 21), (21, 30), (30, 50)], kws, strict=True)):
            paths.append(tmp_path / f"p{i}.h5")
            with h5py.File(paths[-1], "w") as f:
                f.create_dataset("x", data=a[lo:hi], **kw)
        src = H5Source(paths, fields=["x"], decode="cpu")
        assert src.paths_taken["x"] == "mixed"
        return src, {"x": a}


def test_filters_gpufeed_does_not_decode_keep_h5py_and_say_so(tmp_path):
    a = _array((30, 4), "<f4")
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("lzf", data=a, chunks=(4, 4), compression="lzf")
        f.create_dataset("fletcher", data=a, chunks=(4, 4), compression="gzip", fletcher32=True)
        f.create_dataset("shuffle_only", data=a, chunks=(4, 4), shuffle=True)
        f.create_dataset("scaleoffset", data=a.astype("<i4"), chunks=(4, 4), scaleoffset=0)
    src = H5Source(tmp_path / "f.h5", decode="cpu")
    assert set(src.paths_taken.values()) == {"h5py"}
    text = src.describe()
    assert "h5py: filters lzf: gpufeed decodes gzip and shuffle+gzip only" in text
    assert "deflate+fletcher32" in text and "filters shuffle:" in text
    got = _read(src, np.array([29, 0, 13]))
    assert _same(got["lzf"], a[[29, 0, 13]]) and _same(got["shuffle_only"], a[[29, 0, 13]])


def test_describe_names_the_filters_the_ratio_and_where_chunks_decode(tmp_path):
    _write(tmp_path / "z.h5", {"x": (_array((40, 8), "<f4"), (10, 8))}, compression="gzip", shuffle=True)
    text = H5Source(tmp_path / "z.h5", decode="cpu").describe()
    assert "gzip-cpu: shuffle+gzip (deflate level 4), 4 chunks of (10, 8), compression ratio" in text
    assert "decoded by reader threads with zlib" in text


# -- corrupted chunks -------------------------------------------------------------------------------------


def _corrupt(path, name, chunk, how):
    with h5py.File(path, "r") as f:
        info = f[name].id.get_chunk_info(chunk)
    with open(path, "r+b") as fh:
        if how == "header":
            fh.seek(info.byte_offset)
            fh.write(b"\x00\x00")
        elif how == "trailer":  # the adler32: the data decodes, its checksum does not match
            fh.seek(info.byte_offset + info.size - 2)
            fh.write(b"\x00\x00")
        else:  # the middle of the deflate data
            fh.seek(info.byte_offset + info.size // 2)
            fh.write(b"\xff" * 8)
    return info


@pytest.mark.parametrize("how", ["header", "middle", "trailer"])
def test_a_corrupted_chunk_raises_naming_the_file_the_dataset_and_the_chunk(tmp_path, how):
    a = _array((40, 3, 5), "<f4")
    path = tmp_path / "z.h5"
    _write(path, {"grp/x": (a, (4, 3, 5))}, compression="gzip", shuffle=True)
    info = _corrupt(path, "grp/x", 3, how)
    src = H5Source(path, fields=["grp/x"], decode="cpu")
    pattern = (rf"{path}: dataset '/grp/x': chunk 3 \(starting at element \(12, 0, 0\), {info.size} bytes "
               rf"at byte offset {info.byte_offset}\) is corrupt")
    with pytest.raises(CorruptChunkError, match=pattern) as err:
        _read(src, range(10, 16))
    assert isinstance(err.value, OSError)
    assert _same(_read(src, range(0, 12))["grp/x"], a[:12])  # the other chunks still read
    with pytest.raises(CorruptChunkError, match=pattern):
        _fake_gpu_read(path, "grp/x", np.arange(10, 16))


def test_gpu_checks_name_the_chunk_for_a_bad_status_or_size(tmp_path):
    a = _array((40, 6), "<i2")
    _write(tmp_path / "z.h5", {"x": (a, (5, 6))}, compression="gzip")

    class BadStatus(FakeNvcomp):
        def decompress(self, *args):
            super().decompress(*args)
            np.ctypeslib.as_array((ctypes.c_int32 * args[4]).from_address(args[8]))[1] = 12

    class ShortChunk(FakeNvcomp):
        def decompress(self, *args):
            super().decompress(*args)
            np.ctypeslib.as_array((ctypes.c_int64 * args[4]).from_address(args[3]))[0] = 7

    with pytest.raises(CorruptChunkError, match=r"dataset '/x': chunk 3 .*nvCOMP could not decode it"):
        _fake_gpu_read(tmp_path / "z.h5", "x", np.arange(10, 25), BadStatus())
    short = r"dataset '/x': chunk 2 .*decodes to 7 bytes, a chunk holds 60"
    with pytest.raises(CorruptChunkError, match=short):
        _fake_gpu_read(tmp_path / "z.h5", "x", np.arange(10, 25), ShortChunk())


# -- where chunks are decoded -----------------------------------------------------------------------------


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(_gpu_inflate, "_WARNED", False)


def test_missing_nvcomp_falls_back_to_threads_with_one_warning(tmp_path, monkeypatch, fresh_warning):
    _write(tmp_path / "z.h5", {"x": (_array((20, 4), "<f4"), (5, 4))}, compression="gzip")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def missing():
        raise ImportError("decoding gzip HDF5 chunks on the GPU needs nvidia.libnvcomp; install it with: "
                          "pip install 'gpufeed[nvcomp]'")

    monkeypatch.setattr(_nvcomp, "load", missing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = H5Source(tmp_path / "z.h5", decode="auto")  # the reader threads, nvCOMP or not: no warning
    assert auto.paths_taken["x"] == "gzip-cpu"
    with pytest.warns(RuntimeWarning, match=r"decoded by reader threads.*gpufeed\[nvcomp\]"):
        src = H5Source(tmp_path / "z.h5", decode="gpu")
    assert src.paths_taken["x"] == "gzip-cpu" and src.reads_to == "host" and src.fork_safe
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        H5Source(tmp_path / "z.h5", decode="gpu")  # one warning a process, never an error


def test_decode_gpu_without_cuda_warns_and_decodes_on_the_cpu(tmp_path, monkeypatch, fresh_warning):
    _write(tmp_path / "z.h5", {"x": (_array((20, 4), "<f4"), (5, 4))}, compression="gzip")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="decode='gpu' but CUDA is not available"):
        src = H5Source(tmp_path / "z.h5", decode="gpu")
    assert src.reads_to == "host"


def test_decode_cpu_and_datasets_without_gzip_never_warn(tmp_path, fresh_warning):
    _write(tmp_path / "z.h5", {"x": (_array((20, 4), "<f4"), (5, 4))}, compression="gzip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert H5Source(tmp_path / "z.h5", decode="cpu").reads_to == "host"
    with pytest.raises(ValueError, match="decode must be 'auto', 'gpu' or 'cpu', got 'fast'"):
        H5Source(tmp_path / "z.h5", decode="fast")


def test_decode_gpu_without_a_field_gpufeed_decodes_raises(tmp_path, fresh_warning):
    """decode='gpu' applies to gzip fields only: where no field is one (uncompressed, another filter that
    h5py reads, or use_offsets=False), it raises instead of doing nothing, with or without CUDA."""
    _write(tmp_path / "plain.h5", {"x": (_array((20, 4), "<f4"), (5, 4))})
    _write(tmp_path / "z.h5", {"x": (_array((20, 4), "<f4"), (5, 4))}, compression="gzip")
    lzf = tmp_path / "lzf.h5"
    _write(lzf, {"x": (_array((20, 4), "<f4"), (5, 4))}, compression="lzf")
    for path, kwargs, how in ((tmp_path / "plain.h5", {}, "describe() says how each is read"),
                              (lzf, {}, "describe() says how each is read"),
                              (tmp_path / "z.h5", {"use_offsets": False},
                               "use_offsets=False reads every field through h5py")):
        with pytest.raises(ValueError) as err:
            H5Source(path, decode="gpu", **kwargs)
        assert str(err.value) == ("H5Source: decode='gpu' applies to gzip-compressed fields, and no field "
                                  f"here is decoded by gpufeed ({how}); leave decode at 'auto'")
        assert len(H5Source(path, **kwargs)) == 20  # as the message says


def test_a_missing_nvcomp_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(_nvcomp, "_LOADED", None)
    monkeypatch.setitem(sys.modules, "nvidia.libnvcomp", None)
    with pytest.raises(ImportError, match=r"pip install 'gpufeed\[nvcomp\]'"):
        _nvcomp.load()


def test_nvcomp_loads_without_a_gpu_when_installed():
    pytest.importorskip("nvidia.libnvcomp")
    nv = _nvcomp.load()
    assert all(a >= 1 for a in nv.alignments)


def test_adler32_on_torch_matches_zlib():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(3, 70001), dtype=np.uint8)
    a, b = _gpu_inflate._adler32(torch.from_numpy(rows))
    for i in range(3):
        want = zlib.adler32(rows[i].tobytes())
        assert (int(a[i]), int(b[i])) == (want & 0xFFFF, want >> 16)


# -- on the GPU with nvCOMP (-m cuda) ---------------------------------------------------------------------


@pytest.fixture
def nvcomp_gpu():
    pytest.importorskip("nvidia.libnvcomp")
    assert torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: "+".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("shape,chunks,dtype", CASES)
def test_every_filter_combination_round_trips_on_the_gpu(tmp_path, nvcomp_gpu, shape, chunks, dtype, filters):
    a = _array(shape, dtype)
    _write(tmp_path / "z.h5", {"x": (a, chunks)}, **filters)
    src = H5Source(tmp_path / "z.h5", fields=["x"], decode="gpu")
    assert src.paths_taken["x"] == "gzip-gpu" and src.reads_to == "device" and not src.fork_safe
    for rows in _row_sets(shape[0]):
        idx = np.asarray(list(rows) if isinstance(rows, range) else rows)
        assert _same(_read(src, rows, "cuda")["x"], a[idx])
        assert _same(_read(src, rows, "cpu")["x"], a[idx])  # host out: the CPU decodes
    src.close()


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["header", "middle", "trailer"])
def test_a_corrupted_chunk_raises_on_the_gpu(tmp_path, nvcomp_gpu, how):
    a = _array((40, 3, 5), "<f4")
    path = tmp_path / "z.h5"
    _write(path, {"x": (a, (4, 3, 5))}, compression="gzip", shuffle=True)
    _corrupt(path, "x", 3, how)
    src = H5Source(path, fields=["x"], decode="gpu")
    with pytest.raises(CorruptChunkError, match=rf"{path}: dataset '/x': chunk 3 \(starting at element"):
        _read(src, range(10, 16), "cuda")
    assert _same(_read(src, range(0, 12), "cuda")["x"], a[:12])  # the device is still usable


@pytest.mark.cuda
class TestGzipGpu(SourceContract):
    """The whole contract over gzip fields decoded on the GPU, beside a contiguous and an lzf field that
    the device read stages through pinned memory."""

    def make_source(self, tmp_path):
        pytest.importorskip("nvidia.libnvcomp")
        data = {"x": _array((45, 3, 5), "<f4"), "y": _array((45,), "<i8", 1), "w": _array((45, 4), "u1", 2),
                "z": _array((45, 2), "<f8", 3)}
        with h5py.File(tmp_path / "z.h5", "w") as f:
            f.create_dataset("x", data=data["x"], chunks=(4, 2, 3), compression="gzip", shuffle=True)
            f.create_dataset("y", data=data["y"], chunks=(7,), compression="gzip", compression_opts=9)
            f.create_dataset("w", data=data["w"])
            f.create_dataset("z", data=data["z"], chunks=(6, 2), compression="lzf")
        src = H5Source(tmp_path / "z.h5", decode="gpu")
        assert dict(src.paths_taken) == {"x": "gzip-gpu", "y": "gzip-gpu", "w": "contiguous", "z": "h5py"}
        return src, data


@pytest.mark.cuda
@pytest.mark.parametrize("num_threads", [1, 4])
def test_a_prefetcher_delivers_gpu_decoded_batches_exactly_reading_ahead(tmp_path, nvcomp_gpu, num_threads):
    """A SourceLoader reads a source decoding on the GPU up to ``num_threads`` batches at once, a batch per
    read: every shuffled batch arrives exact and once, epoch after epoch, and a corrupt chunk raises at its
    own batch."""
    from gpufeed import CudaPrefetcher, SourceLoader

    a = _array((600, 3, 8), "<i2")
    path = tmp_path / "z.h5"
    _write(path, {"x": (a, (16, 3, 8))}, compression="gzip", shuffle=True)
    src = H5Source(path, decode="gpu")
    assert src.paths_taken["x"] == "gzip-gpu" and src.reads_to == "device"
    loader = SourceLoader(src, batch_size=40, shuffle=True, seed=3, num_threads=num_threads)
    with CudaPrefetcher(loader, depth=2) as pf:
        for epoch in range(2):
            got = [b["x"].cpu() for b in pf]
            plan = loader.plan(epoch)
            assert len(got) == len(plan)
            for rows, x in zip(plan, got, strict=True):
                assert _same(x, a[np.asarray(rows)])
    _corrupt(path, "x", 20, "middle")  # rows 320-335: in batch 8 of the sequential plan
    src = H5Source(path, decode="gpu")
    seen = []
    pf = CudaPrefetcher(SourceLoader(src, batch_size=40, num_threads=num_threads))
    with pf, pytest.raises(CorruptChunkError, match=rf"{path}: dataset '/x': chunk 20 "):
        for b in pf:
            seen.append(int(b["x"][0, 0, 0]))
    assert len(seen) == 8


@pytest.mark.cuda
def test_the_gpu_read_waits_for_the_callers_stream(tmp_path, nvcomp_gpu):
    """A read on its own stream starts after the caller's queued work on ``out`` (here a fill)."""
    a = _array((400, 256), "<f4")
    _write(tmp_path / "z.h5", {"x": (a, (50, 256))}, compression="gzip", shuffle=True)
    src = H5Source(tmp_path / "z.h5", decode="gpu")
    out = torch.empty((400, 256), dtype=torch.float32, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the current stream busy, then a fill the read must follow
    out.fill_(-1.0)
    src.read(range(400), {"x": out})
    torch.cuda.synchronize()
    assert _same(out.cpu(), a)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_unshuffle_puts_every_byte_plane_back(itemsize):
    elements = np.random.default_rng(itemsize).integers(0, 256, size=(1000, itemsize), dtype=np.uint8)
    planes = np.ascontiguousarray(elements.T).reshape(-1)  # what the shuffle filter stores
    assert np.array_equal(unshuffle(planes, itemsize), elements.reshape(-1))
