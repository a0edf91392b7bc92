"""Shuffled rows through ``pread_many``: the compiled library and the Python fallback, forced in turn, read
the same bytes and raise the same errors naming the file. The sources here are made with
``mmap_gather=False``: by default rows in the page cache are gathered from a memory map instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpufeed.sources import FileChangedError, H5Source, RawSource, _pread
from gpufeed.sources._files import FileDescriptors


@pytest.fixture(params=["native", "python"])
def backend(request, monkeypatch):
    """Force one way of reading; the native one counts its calls (each is a whole piece of reads)."""
    calls: list[int] = []
    if request.param == "native":
        real = _pread._NATIVE
        if real is None:
            pytest.skip("the native reader was not built here (pip install -e . builds it)")
        monkeypatch.setattr(_pread, "_NATIVE", lambda *a: (calls.append(a[5]), real(*a))[1])
    else:
        monkeypatch.setattr(_pread, "_NATIVE", None)
    return request.param, calls


def _read(src, rows, fields):
    out = {k: torch.empty((len(rows), *f.shape), dtype=f.dtype) for k, f in fields.items()}
    src.read(rows, out)
    return out


def test_shuffled_rows_are_exact(backend, tmp_path):
    """Several files, two fields of odd row sizes, sorted / unsorted / repeated rows."""
    name, calls = backend
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(300, 37), dtype=np.uint8)
    y = rng.standard_normal((300, 3)).astype(np.float32)
    np.save(tmp_path / "a.npy", x[:120])
    np.save(tmp_path / "b.npy", x[120:])
    np.save(tmp_path / "y.npy", y)
    src = RawSource(fields={"x": [tmp_path / "a.npy", tmp_path / "b.npy"], "y": tmp_path / "y.npy"},
                    mmap_gather=False)  # positional reads, not a gather from the page cache
    for rows in (np.sort(rng.choice(300, 90, replace=False)), rng.permutation(300)[:77],
                 np.array([5, 5, 119, 120, 121, 299, 0, 0]), np.arange(100, 140)):
        out = _read(src, rows, src.fields)
        assert np.array_equal(out["x"].numpy(), x[rows]) and np.array_equal(out["y"].numpy(), y[rows])
    assert (len(calls) == 8) if name == "native" else not calls  # one call per field per read


def test_shuffled_hdf5_rows_are_exact(backend, tmp_path):
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(200, 4, 5), dtype=np.uint8)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("contiguous", data=x)
        f.create_dataset("chunked", data=x, chunks=(16, 4, 5))
    src = H5Source(tmp_path / "d.h5", fields=["contiguous", "chunked"], mmap_gather=False)
    rows = np.sort(rng.choice(200, 60, replace=False))
    out = _read(src, rows, src.fields)
    for name in ("contiguous", "chunked"):
        assert np.array_equal(out[name].numpy(), x[rows]), name
    assert bool(backend[1]) == (backend[0] == "native")


def test_file_truncated_mid_read_names_it(backend, tmp_path):
    """The last row is cut 40 bytes short: its read comes back short, then at the end of the file. The
    source reports the cut as the file having changed (before reading: its first read opens the file and
    finds another size); below that check (identities off) the short read names the file and rows before
    the cut still read."""
    x = np.random.default_rng(2).integers(0, 256, size=(50, 100), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    src = RawSource(tmp_path / "x.npy", mmap_gather=False)
    header = os.path.getsize(tmp_path / "x.npy") - x.nbytes
    os.truncate(tmp_path / "x.npy", os.path.getsize(tmp_path / "x.npy") - 40)
    want = (f"short read from {tmp_path / 'x.npy'}: expected 100 bytes at offset {header + 49 * 100}, "
            "got 60; the file is shorter than when the source was opened")
    with pytest.raises(FileChangedError, match="changed after the source was made"):
        _read(src, np.array([3, 17, 49]), src.fields)
    src._fds.idents = None  # the reads themselves, without the source's check of its files
    with pytest.raises(OSError, match=re.escape(want)):
        _read(src, np.array([3, 17, 49]), src.fields)
    out = _read(src, np.array([3, 17, 48]), src.fields)  # rows before the cut still read
    assert np.array_equal(out["x"].numpy(), x[[3, 17, 48]])


def test_a_failed_read_raises_the_errno_and_the_path(backend, tmp_path):
    fds = FileDescriptors([str(tmp_path)])  # a directory opens, and pread on it fails with EISDIR
    buf = torch.empty(64, dtype=torch.uint8)
    args = (np.array([0, 8]), np.array([8, 8]), np.array([0, 8]), buf.data_ptr(), 64)
    with pytest.raises(IsADirectoryError, match=r"reading 8 bytes at offset 0") as info:
        _pread.pread_many(fds, [str(tmp_path)], 0, *args)
    assert info.value.filename == str(tmp_path)
    fds.close()


@pytest.mark.parametrize("ahead", [True, False])
def test_read_ahead_reads_the_same_bytes_cold_cached_or_past_the_end(backend, tmp_path, ahead):
    """The first pass of ``ahead`` (cached bytes copied without blocking, the rest advised) changes no byte
    and no error: reads dropped from the page cache, a read whose first page alone is cached (the first
    pass copies part of it), and a read past the end that fails at its own index."""
    if backend[0] != "native":
        pytest.skip("the Python loop has no read-ahead pass")
    data = np.random.default_rng(2).integers(0, 256, size=1 << 20, dtype=np.uint8)
    path = tmp_path / "d.bin"
    path.write_bytes(data.tobytes())
    fds = FileDescriptors([str(path)])
    fd = fds.get(0)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the cache
    try:
        os.preadv(fd, [bytearray(4096)], 8192, os.RWF_NOWAIT)
        pytest.skip("this file system keeps the pages (tmpfs?): nothing here is cold")
    except BlockingIOError:
        pass
    except (OSError, AttributeError):
        pytest.skip("no non-blocking buffered reads here")
    os.pread(fd, 4096, 4096)  # page 1 cached: the read at 6000 has its first 2192 bytes in the cache
    offsets = np.array([900_000, 6000, 5, 700_001, 12_288])
    sizes = np.array([5000, 4096, 1, 12_288, 4096])
    dst = np.cumsum(sizes) - sizes
    buf = torch.zeros(int(sizes.sum()), dtype=torch.uint8)
    _pread.pread_many(fds, [str(path)], 0, offsets, sizes, dst, buf.data_ptr(), buf.numel(), ahead=ahead)
    want = np.concatenate([data[o : o + n] for o, n in zip(offsets, sizes, strict=True)])
    assert np.array_equal(buf.numpy(), want)
    past = np.array([8192, (1 << 20) - 4096, 20_000])  # the second read runs 4096 bytes past the end
    with pytest.raises(OSError, match=re.escape(f"{path}")) as info:
        _pread.pread_many(fds, [str(path)], 0, past, np.array([8192, 8192, 8192]), np.array([0, 8192, 16384]),
                          buf.data_ptr(), buf.numel(), ahead=ahead)
    assert "offset 1044480" in str(info.value) and "got 4096" in str(info.value)
    fds.close()


def test_reads_outside_the_buffer_are_refused(backend, tmp_path):
    (tmp_path / "f").write_bytes(bytes(64))
    fds = FileDescriptors([str(tmp_path / "f")])
    buf = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside the 16-byte buffer"):
        _pread.pread_many(fds, ["f"], 0, np.array([0]), np.array([17]), np.array([0]), buf.data_ptr(), 16)
    fds.close()


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_reads_shared_among_threads_are_exact_and_fail_at_the_first_bad_read(threads, tmp_path, monkeypatch):
    """Reads cut at the edges of the threads' shares (a share of at least 1 byte here) land whole; a file
    that ends early raises for the first read it cuts, with the bytes of it that were there."""
    if _pread._NATIVE is None:
        pytest.skip("the native reader was not built here (pip install -e . builds it)")
    monkeypatch.setattr(_pread, "SHARE_BYTES", 1)
    data = np.random.default_rng(2).integers(0, 256, size=100_000, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    fds = FileDescriptors([str(tmp_path / "f")])
    sizes = np.array([40_000, 0, 7, 30_000, 1, 22_992], dtype=np.int64)
    offsets = np.array([50_000, 3, 99_000, 0, 99_999, 60_000], dtype=np.int64)
    dst = np.cumsum(sizes) - sizes
    buf = torch.zeros(int(sizes.sum()), dtype=torch.uint8)
    _pread.pread_many(fds, ["f"], 0, offsets, sizes, dst, buf.data_ptr(), buf.numel(), threads=threads)
    want = np.concatenate([data[o : o + n] for o, n in zip(offsets, sizes, strict=True)])
    assert np.array_equal(buf.numpy(), want)
    os.truncate(tmp_path / "f", 75_000)  # read 0 (50_000 + 40_000) ends 15_000 bytes early; read 5 too
    with pytest.raises(OSError, match=r"short read from f: expected 40000 bytes at offset 50000, got 25000;"):
        _pread.pread_many(fds, ["f"], 0, offsets, sizes, dst, buf.data_ptr(), buf.numel(), threads=threads)
    fds.close()


def test_a_forked_child_reads_with_threads_of_its_own(tmp_path):
    """The parent's reader threads do not exist in a forked child: the child's threaded reads are whole,
    and end (the timeout)."""
    if _pread._NATIVE is None:
        pytest.skip("the native reader was not built here (pip install -e . builds it)")
    code = """
import os, sys
import numpy as np  # (no torch: its own thread pool does not survive a fork)
from gpufeed.sources import _pread
from gpufeed.sources._files import FileDescriptors
_pread.SHARE_BYTES = 1
data = np.arange(1 << 16, dtype=np.uint8)
path = sys.argv[1]
data.tofile(path)
def read():
    fds = FileDescriptors([path])
    buf = np.zeros(len(data), dtype=np.uint8)
    _pread.pread_many(fds, [path], 0, np.array([0]), np.array([len(data)]), np.array([0]), buf.ctypes.data,
                      len(data), threads=8)
    fds.close()
    return bool((buf == data).all())
assert read()
pid = os.fork()
if pid == 0:
    os._exit(0 if read() else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), "parent", read())
"""
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], capture_output=True, text=True,
                         timeout=60)
    assert got.stdout.split() == ["child", "0", "parent", "True"], got.stderr


def test_reads_in_flight_at_a_fork_are_not_the_childs(tmp_path):
    """A forked child's copy of reads its parent started raises at once instead of waiting on threads it
    does not have, and lets them go without a hang; the parent's own wait is whole."""
    if _pread._NATIVE is None:
        pytest.skip("the native reader was not built here (pip install -e . builds it)")
    code = """
import os, sys
import numpy as np
from gpufeed.sources import _pread
from gpufeed.sources._files import FileDescriptors
data = np.arange(1 << 22, dtype=np.uint8)
path = sys.argv[1]
data.tofile(path)
fds = FileDescriptors([path])
buf = np.zeros(len(data), dtype=np.uint8)
reads = [(0, np.array([0]), np.array([len(data)]), np.array([0]), buf.ctypes.data, len(data))]
pending = _pread.submit(fds, [path], reads, 8, keep=buf)
pid = os.fork()
if pid == 0:
    try:
        pending.result(timeout=10)
        os._exit(3)
    except OSError as exc:
        del pending
        os._exit(0 if "forked" in str(exc) else 4)
_, status = os.waitpid(pid, 0)
pending.result()
print("child", os.waitstatus_to_exitcode(status), "parent", bool((buf == data).all()))
"""
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], capture_output=True, text=True,
                         timeout=60)
    assert got.stdout.split() == ["child", "0", "parent", "True"], got.stderr


def test_python_loop_resumes_short_reads(tmp_path, monkeypatch):
    x = np.arange(4000, dtype=np.uint8).reshape(400, 10)
    np.save(tmp_path / "x.npy", x)
    src = RawSource(tmp_path / "x.npy", mmap_gather=False)
    real = os.preadv
    monkeypatch.setattr(_pread, "_NATIVE", None)
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:3]], off))  # 3 bytes a call
    rows = np.array([399, 2, 7, 8, 9, 100])
    assert np.array_equal(_read(src, rows, src.fields)["x"].numpy(), x[rows])


def test_the_environment_turns_the_native_reader_off():
    code = "from gpufeed.sources import _pread; print(_pread.backend())"
    env = {**os.environ, "GPUFEED_NATIVE_PREAD": "0"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "python" and not got.stderr  # no warning either


@pytest.mark.parametrize("abi", [None, 1])
def test_a_library_of_another_calling_convention_is_never_called(abi, tmp_path, monkeypatch):
    """A library left from an older build (no ABI function, or another number) is not loaded: the Python
    loop reads instead of a call with the wrong arguments."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    src = tmp_path / "old.c"
    body = "#include <stdint.h>\nint64_t gpufeed_pread_many(void) { return -1; }\n"
    if abi is not None:
        body += f"int64_t gpufeed_pread_abi(void) {{ return {abi}; }}\n"
    src.write_text(body)
    lib = tmp_path / "_pread_many.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    monkeypatch.setattr(_pread, "LIBRARY", lib)
    assert _pread._load() is None


def test_reads_spread_over_threads_only_where_the_source_is_read_a_chunk_at_a_time(tmp_path, monkeypatch):
    """A source with a field decoded here (gzip) is cut into pieces for reader threads: its by-offset
    fields are then read on one thread a piece, not a pool's worth each; one without is spread."""
    h5py = pytest.importorskip("h5py")
    if _pread._NATIVE is None:
        pytest.skip("the native reader was not built here (pip install -e . builds it)")
    real, threads = _pread._NATIVE, []
    monkeypatch.setattr(_pread, "_NATIVE", lambda *a: (threads.append(a[8]), real(*a))[1])
    x = np.arange(4000 * 8, dtype=np.float32).reshape(4000, 8)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("x", data=x)
        f.create_dataset("z", data=x, chunks=(100, 8), compression="gzip")
    for fields, parallel, want in ((["x", "z"], False, 1), (["x"], True, 3)):
        threads.clear()
        with H5Source(tmp_path / "d.h5", fields=fields, num_threads=3, mmap_gather=False) as src:
            assert src.parallel_reads is parallel
            out = _read(src, range(100, 3000), src.fields)
        assert np.array_equal(out["x"].numpy(), x[100:3000]) and threads == [want]


# -- submit: reads started on the native threads, packed from lists (one run) or numpy arrays ----------

native_only = pytest.mark.skipif(_pread.backend() != "native", reason="the native reader was not built here")


def _submit(src, rows):
    out = {k: torch.full((len(rows), *f.shape), -1, dtype=f.dtype) for k, f in src.fields.items()}
    pending = src.submit(rows, out)
    assert pending is not None
    pending.result(timeout=10)
    return out


@native_only
def test_a_run_across_two_files_of_one_field(tmp_path):
    a = np.arange(100 * 3, dtype=np.int32).reshape(100, 3)
    b = np.arange(1000, 1000 + 50 * 3, dtype=np.int32).reshape(50, 3)
    np.save(tmp_path / "a.npy", a), np.save(tmp_path / "b.npy", b)
    x = np.concatenate([a, b])
    with RawSource([tmp_path / "a.npy", tmp_path / "b.npy"]) as src:
        for r in [range(90, 120), range(100, 150), range(0, 100), range(99, 101)]:
            assert np.array_equal(_submit(src, r)["x"].numpy(), x[r.start:r.stop]), r


@native_only
def test_two_fields_in_two_files_land_in_their_own_memory(tmp_path):
    x = np.arange(200 * 5, dtype=np.int16).reshape(200, 5)
    y = np.arange(200, dtype=np.float64) * 0.5
    np.save(tmp_path / "x.npy", x), np.save(tmp_path / "y.npy", y)
    with RawSource(fields={"x": tmp_path / "x.npy", "y": tmp_path / "y.npy"}) as src:
        out = _submit(src, range(17, 170))
        assert np.array_equal(out["x"].numpy(), x[17:170])
        assert np.array_equal(out["y"].numpy(), y[17:170])


@native_only
def test_a_cut_second_file_is_named(tmp_path):
    a = np.zeros((100, 16), np.uint8)
    b = np.ones((100, 16), np.uint8)
    np.save(tmp_path / "a.npy", a), np.save(tmp_path / "b.npy", b)
    with RawSource([tmp_path / "a.npy", tmp_path / "b.npy"]) as src:
        header = os.path.getsize(tmp_path / "b.npy") - b.nbytes
        os.truncate(tmp_path / "b.npy", header + 10 * 16)
        out = {"x": torch.empty((40, 16), dtype=torch.uint8)}
        # 20 rows of a, then 20 of b, cut: the source sees the change before any read (its identity check;
        # a cut between that check and the read gives the native reader's "short read", naming the file)
        with pytest.raises(FileChangedError, match=re.escape(str(tmp_path / "b.npy"))):
            src.submit(range(80, 120), out).result(timeout=10)
        assert header > 0


@native_only
def test_an_empty_batch_is_submitted_and_waited(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 4), np.uint8))
    with RawSource(tmp_path / "x.npy") as src:
        pending = src.submit(range(5, 5), {"x": torch.empty((0, 4), dtype=torch.uint8)})
        assert pending is not None
        pending.result(timeout=5)


@native_only
@pytest.mark.parametrize("dst,size", [([0], [17]), ([-1], [4]), ([0, 8], [8, 9]), ([0, -8], [8, 8]),
                                      ([0], [-1])])
def test_submit_refuses_list_reads_outside_the_buffer(tmp_path, dst, size):
    (tmp_path / "f").write_bytes(bytes(64))
    fds = FileDescriptors([str(tmp_path / "f")])
    buf = torch.empty(64, dtype=torch.uint8)  # 16 bytes allowed: an unchecked read stays in real memory
    reads = [([0] * len(dst), [0] * len(dst), size, dst, buf.data_ptr(), 16)]
    with pytest.raises(ValueError, match="outside the 16-byte buffer"):
        _pread.submit(fds, ["f"], reads, 2, keep=buf)
    fds.close()


@native_only
def test_submit_takes_a_file_given_as_an_int_with_list_columns(tmp_path):
    (tmp_path / "f").write_bytes(bytes(range(64)))
    (tmp_path / "g").write_bytes(bytes(range(64, 128)))
    fds = FileDescriptors([str(tmp_path / "f"), str(tmp_path / "g")])
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    reads = [(1, [4], [8], [0], b.data_ptr(), 8), ([0, 1], [2, 10], [4, 4], [0, 4], a.data_ptr(), 8)]
    _pread.submit(fds, ["f", "g"], reads, 2, keep=(a, b)).result(timeout=5)
    assert bytes(b.numpy()) == bytes(range(68, 76))
    assert bytes(a.numpy()) == bytes([2, 3, 4, 5, 74, 75, 76, 77])
    fds.close()


@native_only
def test_submit_of_mixed_list_and_array_fields(tmp_path):
    (tmp_path / "f").write_bytes(bytes(range(64)))
    fds = FileDescriptors([str(tmp_path / "f")])
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    reads = [(0, [4], [8], [0], a.data_ptr(), 8),
             (0, np.array([8]), np.array([8]), np.array([0]), b.data_ptr(), 8)]
    _pread.submit(fds, ["f"], reads, 2, keep=(a, b)).result(timeout=5)
    assert bytes(a.numpy()) == bytes(range(4, 12)) and bytes(b.numpy()) == bytes(range(8, 16))
    fds.close()


@native_only
def test_scattered_rows_over_two_files_and_two_fields_by_submit(tmp_path):
    """The numpy path of submit (rows as an array, no memory map): per-read files, per-field memory."""
    a = np.arange(100 * 4, dtype=np.int32).reshape(100, 4)
    b = np.arange(5000, 5000 + 60 * 4, dtype=np.int32).reshape(60, 4)
    y = np.arange(160, dtype=np.int64) * 3
    np.save(tmp_path / "a.npy", a), np.save(tmp_path / "b.npy", b), np.save(tmp_path / "y.npy", y)
    x = np.concatenate([a, b])
    rows = np.array([150, 3, 99, 100, 101, 7, 159])
    with RawSource(fields={"x": [tmp_path / "a.npy", tmp_path / "b.npy"], "y": tmp_path / "y.npy"},
                   mmap_gather=False) as src:
        out = _submit(src, rows)
        assert np.array_equal(out["x"].numpy(), x[rows]) and np.array_equal(out["y"].numpy(), y[rows])
        header = os.path.getsize(tmp_path / "b.npy") - b.nbytes
        os.truncate(tmp_path / "b.npy", header + 10 * 16)
        out = {"x": torch.empty((3, 4), dtype=torch.int32), "y": torch.empty(3, dtype=torch.int64)}
        with pytest.raises(FileChangedError, match=re.escape(str(tmp_path / "b.npy"))):  # (row 20 of b: cut)
            src.submit(np.array([3, 5, 120]), out).result(timeout=10)
        assert header > 0


@native_only
@pytest.mark.parametrize("dst,size", [([0], [17]), ([-1], [4]), ([0, 8], [8, 9])])
def test_submit_refuses_array_reads_outside_the_buffer(tmp_path, dst, size):
    (tmp_path / "f").write_bytes(bytes(64))
    fds = FileDescriptors([str(tmp_path / "f")])
    buf = torch.empty(64, dtype=torch.uint8)
    reads = [(0, np.zeros(len(dst), np.int64), np.array(size), np.array(dst), buf.data_ptr(), 16)]
    with pytest.raises(ValueError, match="outside the 16-byte buffer"):
        _pread.submit(fds, ["f"], reads, 2, keep=buf)
    fds.close()
