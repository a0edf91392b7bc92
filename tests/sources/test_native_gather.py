"""The native memory-map gather: a file cut under its mapping raises an OSError, the process lives on."""

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gpufeed.sources import RawSource, _gather, _host_source, _pread

pytestmark = pytest.mark.skipif(_pread.GATHER is None, reason="the native reader is not built")

ROW = 4096


def _run(body: str, path) -> subprocess.CompletedProcess:
    """``body`` in a fresh interpreter over a 64-page file at ``path`` (a SIGBUS that is not caught ends
    that process, not the suite's)."""
    code = textwrap.dedent("""
        import faulthandler, mmap, os, sys
        import numpy as np
        from gpufeed.sources import _pread
        faulthandler.enable()  # a SIGBUS handler installed before gpufeed's, as pytest's is
        path = sys.argv[1]
        with open(path, "wb") as f:
            f.write(bytes(range(256)) * (64 * 4096 // 256))
        fd = os.open(path, os.O_RDONLY)
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        view = np.frombuffer(m, dtype=np.uint8)
        out = np.zeros((8, 4096), dtype=np.uint8)
        def gather(offsets, threads=1):  # min_share 0: as many threads as asked, a row each at least
            offsets = np.asarray(offsets, dtype=np.int64)
            return _pread.GATHER(view.ctypes.data, offsets.ctypes.data, len(offsets), 4096, out.ctypes.data,
                                 threads, 0)
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)


def test_rows_of_a_file_cut_under_its_mapping_are_reported_and_the_process_lives(tmp_path):
    p = _run("""
        print("whole", gather([0, 8192, 4096, 65536 - 4096]), bool((out[1] == view[8192:12288]).all()))
        os.truncate(path, 10 * 4096)  # cut after it was mapped
        print("cut", gather([0, 4096, 20 * 4096, 0]))
        print("again", gather([20 * 4096]))
        print("alive")
    """, tmp_path / "rows.bin")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:4] == ["whole -1 True", "cut 2", "again 0", "alive"]


def test_rows_shared_among_threads_are_whole_and_the_first_cut_row_is_reported(tmp_path):
    p = _run("""
        rows = [0, 8192, 4096, 65536 - 4096, 12 * 4096, 3 * 4096, 40 * 4096, 7 * 4096]
        got = gather(rows, threads=4)
        print("whole", got, all((out[i] == view[r:r + 4096]).all() for i, r in enumerate(rows)))
        os.truncate(path, 10 * 4096)
        print("cut", gather([0, 4096, 8192, 20 * 4096, 0, 30 * 4096, 0, 0], threads=4))
        print("cut", gather([0, 4096, 8192, 0, 0, 30 * 4096, 0, 0], threads=8))
        print("alive")
    """, tmp_path / "rows.bin")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:4] == ["whole -1 True", "cut 3", "cut 5", "alive"]


def test_a_sigbus_outside_a_gather_still_ends_the_process(tmp_path):
    p = _run("""
        gather([0])  # gpufeed's handler is installed now
        os.truncate(path, 4096)
        print(int(view[20 * 4096]))  # not a gather: the fault is not gpufeed's to catch
    """, tmp_path / "rows.bin")
    assert p.returncode != 0 and "Bus error" in p.stderr  # faulthandler's report, then the default action


def test_a_cut_file_in_a_gather_raises_an_oserror_naming_it(tmp_path, monkeypatch):
    rows = np.arange(64 * ROW, dtype=np.uint8).reshape(64, ROW) % 251
    path = tmp_path / "x.npy"
    np.save(path, rows)
    src = RawSource(path, mmap_gather=True)
    picked = np.array([5, 1, 60, 33, 17, 9, 41, 2, 55, 28])  # scattered: gathered from the map
    out = {"x": torch.empty(len(picked), ROW, dtype=torch.uint8)}
    src.read(picked, out)
    assert torch.equal(out["x"], torch.from_numpy(rows[picked]))
    # The file is cut while the rows are copied (after the size check): the gather reports row 2.
    monkeypatch.setattr(_gather, "GATHER", lambda *args: 2)
    with pytest.raises(OSError, match=r"short read from .*x[.]npy: expected 4096 bytes at offset"):
        src.read(picked, out)
    src.close()


def test_by_default_only_rows_in_the_page_cache_are_gathered(tmp_path, monkeypatch):
    path = tmp_path / "rows.bin"
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * (16 * ROW // 256))  # rows 0-15 written: in the page cache
        f.truncate(64 * ROW)  # rows 16-63 a hole: in no cache until read
    expect = np.zeros((64, ROW), dtype=np.uint8)
    expect[:16] = np.frombuffer(bytes(range(256)) * (ROW // 256), dtype=np.uint8)
    gathered = []
    real = _gather.gather_rows
    monkeypatch.setattr(_host_source, "gather_rows", lambda *a: (gathered.append(len(a[2])), real(*a)))
    src = RawSource(path, dtype="uint8", shape=(ROW,))
    assert src.mmap_gather is None
    written = np.array([3, 0, 9, 15, 7, 1, 12, 5, 10])  # nine runs: a scattered read
    for rows, want in ((written, [9]), (written + 40, [9])):  # the hole's rows: positional reads
        out = {"x": torch.empty(len(rows), ROW, dtype=torch.uint8)}
        src.read(rows, out)
        assert gathered == want and torch.equal(out["x"], torch.from_numpy(expect[rows]))
    src.close()


def test_resident_reads_the_page_cache_without_faulting_pages_in(tmp_path):
    p = _run("""
        os.truncate(path, 128 * 4096)  # pages 64-127: a hole, in no cache
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        view = np.frombuffer(m, dtype=np.uint8)
        def resident(offsets, row=4096):
            offsets = np.asarray(offsets, dtype=np.int64)
            return _pread.RESIDENT(view.ctypes.data, len(m), offsets.ctypes.data, len(offsets), row)
        hole = 4096 * 70
        print(resident([0, 4096 * 63]), resident([4096 * 64 + 1]), resident([hole]), resident([hole]))
        print(resident([4096 * 128 - 8], row=16), resident([-1]), resident([0], row=0))
    """, tmp_path / "rows.bin")
    assert p.returncode == 0, p.stderr
    # a row in the hole is not resident, and looking does not make it so;
    # nor is a row past the end of the mapping, at a negative offset, or of no bytes
    assert p.stdout.split("\n")[:2] == ["1 0 0 0", "0 0 0"]


def test_handlers_installed_over_each_other_report_a_fault_once(tmp_path):
    p = _run("""
        faulthandler.disable()
        gather([0])  # gpufeed's handler is installed now, over the default one
        faulthandler.enable()  # installed over gpufeed's, which it calls after its report
        gather([0])  # gpufeed's again, over faulthandler's: each would hand a fault to the other
        os.truncate(path, 4096)
        print(int(view[20 * 4096]))  # not a gather
    """, tmp_path / "rows.bin")
    assert p.returncode != 0 and p.stderr.count("Fatal Python error: Bus error") == 1, p.stderr[-2000:]


def _scattered(tmp_path, monkeypatch):
    """A file of 64 rows in the page cache, scattered rows of it, and a counter of the gathers."""
    rows = np.arange(64 * ROW, dtype=np.uint8).reshape(64, ROW) % 251
    np.save(tmp_path / "x.npy", rows)
    gathered = []
    real = _gather._gather_file
    monkeypatch.setattr(_gather, "_gather_file", lambda *a: (gathered.append(len(a[2])), real(*a))[1])
    picked = np.array([5, 1, 60, 33, 17, 9, 41, 2, 55, 28])
    return rows, picked, gathered


def _read(src, picked):
    out = {"x": torch.empty(len(picked), ROW, dtype=torch.uint8)}
    src.read(picked, out)
    return out["x"]


def test_by_default_a_file_that_cannot_be_mapped_is_read_by_position(tmp_path, monkeypatch):
    rows, picked, gathered = _scattered(tmp_path, monkeypatch)

    def no_map(self, path):
        raise OSError(12, "Cannot allocate memory")  # as under an address-space limit, or out of descriptors

    monkeypatch.setattr(_gather.FileMaps, "_open", no_map)
    assert torch.equal(_read(RawSource(tmp_path / "x.npy"), picked), torch.from_numpy(rows[picked]))
    assert gathered == []
    with pytest.raises(OSError, match="Cannot allocate memory"):  # asked for, the gather says why not
        _read(RawSource(tmp_path / "x.npy", mmap_gather=True), picked)


def test_by_default_no_sigbus_handler_means_positional_reads(tmp_path, monkeypatch):
    rows, picked, gathered = _scattered(tmp_path, monkeypatch)
    monkeypatch.setattr(_gather, "GATHER", lambda *a: -2)  # sigaction failed: nothing copied
    selects = []
    real = torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: (selects.append(1), real(*a, **k))[1])
    assert torch.equal(_read(RawSource(tmp_path / "x.npy"), picked), torch.from_numpy(rows[picked]))
    assert gathered == [10] and selects == []  # tried, declined, read by position: never unprotected
    assert torch.equal(_read(RawSource(tmp_path / "x.npy", mmap_gather=True), picked),
                       torch.from_numpy(rows[picked]))
    assert selects == [1]  # asked for: gathered with torch, unprotected


def test_a_source_unpickled_without_the_native_library_reads_by_position(tmp_path, monkeypatch):
    rows, picked, gathered = _scattered(tmp_path, monkeypatch)
    src = pickle.loads(pickle.dumps(RawSource(tmp_path / "x.npy")))
    assert src._maps is not None and not src._maps.always  # the setting travels with the source
    monkeypatch.setattr(_gather, "GATHER", None)  # ... to a process where the library did not load
    monkeypatch.setattr(_gather, "RESIDENT", None)
    assert torch.equal(_read(src, picked), torch.from_numpy(rows[picked]))
    assert gathered == []
