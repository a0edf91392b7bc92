"""Nothing silent (issues 34 and 35): a file changed under a source, a conversion that crashed, raced or
failed to write, a manifest or ``.npy`` header that lies, a corrupt chunk, a swallowed Ctrl-C, a folder
that holds other files, an HDF5 file with metadata beside its samples.

Each case asserts what the user gets: the exact bytes, or the exception type and a message that names the
file (and the fix).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _rel import checked, note

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import FileChangedError, RawSource

h5py = pytest.importorskip("h5py")

from gpufeed.convert import convert_h5_to_raw  # noqa: E402
from gpufeed.sources import H5Source  # noqa: E402
from gpufeed.sources.h5_chunks import CorruptChunkError  # noqa: E402

N = 64
LAYOUTS = {"contiguous": {}, "chunked": {"chunks": (8, 16)},
           "gzip": {"chunks": (8, 16), "compression": "gzip"},
           "lzf": {"chunks": (8, 16), "compression": "lzf"}}  # lzf: gpufeed does not decode it (h5py path)


def data(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((N, 16)).astype(np.float32),
            "y": rng.standard_normal((N, 16)).astype(np.float32)}


def write_h5(path: Path, d: dict[str, np.ndarray], order: list[str], kw: dict) -> None:
    with h5py.File(path, "w", libver="latest") as f:
        for name in order:
            f.create_dataset(name, data=d[name], **kw)


def rewrite_in_place(path: Path, d: dict[str, np.ndarray], order: list[str], kw: dict) -> None:
    """The file rewritten through its own inode, to the same size (its datasets in another order, so their
    offsets move), after a pause longer than the file system's timestamp tick."""
    other = path.with_suffix(".new")
    write_h5(other, d, order, kw)
    st = os.stat(path)
    assert os.path.getsize(other) == st.st_size, "the rewrite must keep the size for this case"
    time.sleep(0.05)
    with open(path, "r+b") as fh:
        fh.write(other.read_bytes())
    after = os.stat(path)
    assert (after.st_ino, after.st_size) == (st.st_ino, st.st_size) and after.st_mtime_ns != st.st_mtime_ns


def read_all(src, n: int = N) -> dict[str, np.ndarray]:
    out = {k: torch.empty((n, *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
    src.read(np.arange(n), out)
    return {k: v.numpy() for k, v in out.items()}


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# -- 1, 2: a file changed under a source --------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_file_rewritten_in_place_same_size_and_inode_raises_file_changed(tmp_path, layout):
    """Issue 35.1: an HDF5 file rewritten in place (same inode and size, datasets in another order so the
    offsets moved): the next read raises FileChangedError naming the file, never the other dataset's bytes;
    ``check_unchanged()`` says the same before any read."""
    path, old, new = tmp_path / "d.h5", data(0), data(1)
    write_h5(path, old, ["x", "y"], LAYOUTS[layout])
    src = H5Source(path, fields=["x"])
    assert np.array_equal(read_all(src)["x"], old["x"])
    rewrite_in_place(path, new, ["y", "x"], LAYOUTS[layout])
    with pytest.raises(FileChangedError, match=rf"{re.escape(str(path))} changed after the source was made: "
                       r"its mtime changed .*recreate the source"):
        src.check_unchanged()
    with pytest.raises(FileChangedError, match=rf"{re.escape(str(path))} changed.*recreate the source"
                       ) as info:
        read_all(src)
    assert info.value.filename == str(path)
    assert np.array_equal(read_all(H5Source(path, fields=["x"]))["x"], new["x"])  # a new source: new data
    src.close()
    note(f"{layout}: FileChangedError naming the file; a new source reads the new data")


@pytest.mark.parametrize("layout", ["contiguous", "gzip", "lzf"])
def test_a_file_rewritten_mid_epoch_stops_the_epoch_after_exact_batches(tmp_path, layout):
    """Issue 35.1, mid-epoch: every batch delivered before the error holds the old file's exact rows; the
    epoch ends with FileChangedError naming the file, before it ends."""
    path, old, new = tmp_path / "d.h5", data(0), data(1)
    write_h5(path, old, ["x", "y"], LAYOUTS[layout])
    src = H5Source(path, fields=["x"])
    got = []
    with pytest.raises(FileChangedError, match=re.escape(str(path))), \
            CudaPrefetcher(SourceLoader(src, batch_size=8), device="cpu", depth=2) as pf:
        for i, batch in enumerate(pf):
            got.append(batch["x"].clone())
            if i == 1:
                rewrite_in_place(path, new, ["y", "x"], LAYOUTS[layout])
    assert 2 <= len(got) < N // 8
    assert np.array_equal(torch.cat(got).numpy(), old["x"][: 8 * len(got)])
    checked(len(got), 0, sum(b.nbytes for b in got))
    src.close()
    note(f"{layout}: {len(got)} exact batches, then FileChangedError")


def test_a_raw_file_replaced_or_rewritten_raises_file_changed(tmp_path):
    """The same for RawSource: a ``.npy`` replaced by another file (new inode) before its first read, and
    one rewritten in place with other bytes of the same size."""
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(a, data(0)["x"])
    np.save(b, data(0)["x"])
    src_a, src_b = RawSource(a), RawSource(b)
    np.save(tmp_path / "other.npy", data(1)["x"])
    os.replace(tmp_path / "other.npy", a)
    with pytest.raises(FileChangedError,
                       match=rf"{re.escape(str(a))} changed .*another file now has its name"):
        read_all(src_a)
    read_all(src_b)
    time.sleep(0.05)
    with open(b, "r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff" * 16)
    with pytest.raises(FileChangedError, match=rf"{re.escape(str(b))} changed .*mtime changed"):
        read_all(src_b)


@pytest.mark.parametrize("use_offsets", [False, True])
def test_a_new_source_never_reads_the_old_version_while_an_older_source_holds_the_file(tmp_path, use_offsets):
    """Issue 35.2: HDF5 shares one open file per inode in a process. An older source (h5py path) holds the
    file open; the file is rewritten in place; a new source (h5py path, or by offsets read from the file's
    metadata) must read the new data, not the old layout's."""
    path, old, new = tmp_path / "d.h5", data(0), data(1)
    write_h5(path, old, ["x", "y"], {})
    older = H5Source(path, fields=["x", "y"], use_offsets=False)
    assert np.array_equal(read_all(older)["x"], old["x"])  # its h5py file is open now
    keep = h5py.File(path, "r")  # and one opened outside gpufeed, whose version gpufeed cannot know
    keep["x"][0]
    rewrite_in_place(path, new, ["y", "x"], {})
    newer = H5Source(path, fields=["x"], use_offsets=use_offsets)
    got = read_all(newer)["x"]
    assert np.array_equal(got, new["x"]), "read the old version of the file"
    with pytest.raises(FileChangedError):
        read_all(older)
    keep.close()
    older.close()
    newer.close()
    note("the new source read the new data; the old one raised FileChangedError")


def test_a_corrupt_chunk_of_a_file_that_changed_is_reported_as_a_change(tmp_path):
    """Issue 35.8, read path: a gzip chunk overwritten after the source was made raises FileChangedError
    (it changed), not 'the file is damaged'; a chunk damaged before the source was made raises
    CorruptChunkError naming the file and the dataset, and saying it may have been rewritten."""
    path = tmp_path / "g.h5"
    write_h5(path, data(0), ["x"], LAYOUTS["gzip"])
    src = H5Source(path, fields=["x"])
    read_all(src)
    _damage_chunk(path, "x", 1)
    with pytest.raises(FileChangedError, match=rf"{re.escape(str(path))} changed"):
        read_all(src)
    with pytest.raises(CorruptChunkError, match=rf"{re.escape(str(path))}: dataset '/x': chunk 1 .*corrupt.*"
                       r"damaged, or it was rewritten"):
        read_all(H5Source(path, fields=["x"]))


def _damage_chunk(path: Path, name: str, index: int) -> None:
    with h5py.File(path, "r") as f:
        info = f[name].id.get_chunk_info(index)
    time.sleep(0.05)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + 4)
        fh.write(b"\x00\xff" * 8)


# -- 3, 4, 5: convert exclusive and atomic --------------------------------------------------------------

_SLOW_CONVERT = """
import sys, time
import h5py
real = h5py.Dataset.read_direct
def slow(self, *a, **k):  # (called once the folder is locked)
    open(sys.argv[3], "w").close()
    time.sleep(0.05)
    return real(self, *a, **k)
h5py.Dataset.read_direct = slow
from gpufeed.convert import convert_h5_to_raw
convert_h5_to_raw(sys.argv[1], sys.argv[2], chunk_bytes=1024)
"""


def _converter(tmp_path: Path, src: Path, out: Path, started: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, str(src), str(out), str(started)],
                            env=env, cwd=tmp_path)


def test_two_conversions_into_one_folder_run_one_after_the_other(tmp_path):
    """Issue 35.3 (real processes): while one process converts a.h5 into a folder, another converts b.h5
    into it. The second waits for the folder's lock, then replaces the conversion whole: the folder ends
    with b's data, every field, never a mix of a's and b's files."""
    a, b = data(0), data(1)
    write_h5(tmp_path / "a.h5", a, ["x", "y"], {})
    write_h5(tmp_path / "b.h5", b, ["x", "y"], {})
    out, started = tmp_path / "out", tmp_path / "started"
    first = _converter(tmp_path, tmp_path / "a.h5", out, started)
    t0 = time.monotonic()
    while not started.exists():
        assert first.poll() is None and time.monotonic() - t0 < 60, "the first converter did not start"
        time.sleep(0.01)
    # it holds the lock and reads slowly: 8 reads of 0.05 s
    convert_h5_to_raw(tmp_path / "b.h5", out)
    assert first.wait(timeout=60) == 0  # (without the lock, it would finish last and leave a's files)
    got = read_all(RawSource(out))
    assert np.array_equal(got["x"], b["x"]) and np.array_equal(got["y"], b["y"])
    note("the second conversion waited for the first's lock; the folder holds the second's data, whole")


def test_concurrent_conversions_always_leave_one_whole_conversion(tmp_path):
    """Issue 35.3: two processes convert different files into one folder at the same moment: the folder
    holds one of the two conversions, whole, and nothing else."""
    a, b = data(0), data(1)
    write_h5(tmp_path / "a.h5", a, ["x", "y"], {})
    write_h5(tmp_path / "b.h5", b, ["x", "y"], {})
    out = tmp_path / "out"
    for round_ in range(1):
        procs = [_converter(tmp_path, tmp_path / f"{s}.h5", out, tmp_path / f"s{s}{round_}") for s in "ab"]
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
        got = read_all(RawSource(out))
        assert any(all(np.array_equal(got[k], d[k]) for k in d) for d in (a, b)), "a mix of a and b"
        doc = json.loads((out / "manifest.json").read_text())
        assert sorted(os.listdir(out)) == sorted([".gpufeed-convert.lock", "manifest.json",
                                                 *(s["file"] for s in doc["fields"].values())])


def _fork_convert(src: Path, out: Path) -> int:
    pid = os.fork()
    if pid == 0:  # the child converts, and is killed at some instant of it
        try:
            convert_h5_to_raw(src, out, chunk_bytes=512)
            os._exit(0)
        except BaseException:
            os._exit(1)
    return pid


def test_a_conversion_killed_at_random_instants_always_leaves_a_whole_conversion(tmp_path):
    """Issue 35.4: 60 conversions (alternately of two files) into one folder, each SIGKILLed at a random
    instant of its run (or just after it): after every kill the folder reads as the earlier conversion or
    the new one, exactly, and always has a manifest; the next successful conversion removes everything the
    killed ones left (temporaries, generations no manifest names)."""
    sources = {}
    for i, name in enumerate("ab"):
        sources[name] = {k: np.random.default_rng(i).integers(0, 255, (2000, 4 + j), np.uint8)
                         for j, k in enumerate("wxyz")}
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            for k, v in sources[name].items():
                f[k] = v
    out = tmp_path / "out"
    convert_h5_to_raw(tmp_path / "a.h5", out)
    t0 = time.perf_counter()
    convert_h5_to_raw(tmp_path / "b.h5", out, chunk_bytes=512)
    took = time.perf_counter() - t0
    rng = random.Random(35)
    outcomes = {"a": 0, "b": 0}
    for trial in range(60):
        name = "ab"[trial % 2]
        pid = _fork_convert(tmp_path / f"{name}.h5", out)
        time.sleep(rng.uniform(0, took * 1.5))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with RawSource(out) as src:
            got = read_all(src, len(src))
        which = [s for s, d in sources.items() if all(np.array_equal(got[k], d[k]) for k in d)]
        assert len(which) == 1, f"trial {trial}: the folder holds neither conversion whole"
        outcomes[which[0]] += 1
    convert_h5_to_raw(tmp_path / "a.h5", out)
    doc = json.loads((out / "manifest.json").read_text())
    assert sorted(os.listdir(out)) == sorted([".gpufeed-convert.lock", "manifest.json",
                                             *(s["file"] for s in doc["fields"].values())])
    note(f"60 kills: the folder held a whole conversion every time ({outcomes}); leftovers removed")


def test_temporaries_of_an_older_gpufeed_are_removed_by_the_next_conversion(tmp_path):
    """Issue 35.4: ``.x.bin.tmp-<pid>`` left by a conversion killed under an older gpufeed is convert's own
    file: the next successful conversion removes it, and it is not taken for a foreign file."""
    write_h5(tmp_path / "a.h5", data(0), ["x", "y"], {})
    out = tmp_path / "out"
    out.mkdir()
    (out / ".x.bin.tmp-4242").write_bytes(b"half")
    (out / ".manifest.json.tmp-4242").write_text("{")
    convert_h5_to_raw(tmp_path / "a.h5", out)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_a_manifest_write_that_fails_names_it_and_leaves_no_temporary(tmp_path, monkeypatch):
    """Issue 35.5: ENOSPC while the manifest is written: OSError 28 naming the manifest's temporary and the
    folder; no temporary left; the earlier conversion as it was."""
    write_h5(tmp_path / "a.h5", data(0), ["x", "y"], {})
    write_h5(tmp_path / "b.h5", data(1), ["x", "y"], {})
    out = tmp_path / "out"
    convert_h5_to_raw(tmp_path / "a.h5", out)
    before = folder_files(out)
    from gpufeed.sources import _manifest

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_manifest.json, "dump", full)
    with pytest.raises(OSError, match=rf"No space left on device: writing the manifest .*manifest\.json\.tmp-"
                       rf"\w+ in {re.escape(str(out))}; free space there") as info:
        convert_h5_to_raw(tmp_path / "b.h5", out)
    assert info.value.errno == 28
    monkeypatch.undo()
    assert folder_files(out) == before
    assert np.array_equal(read_all(RawSource(out))["x"], data(0)["x"])


def test_a_data_file_write_that_fails_names_the_file_and_the_folder(tmp_path, monkeypatch):
    """Issue 35.5 / "every I/O error names the path": ENOSPC while a data file is synced."""
    write_h5(tmp_path / "a.h5", data(0), ["x", "y"], {})
    out = tmp_path / "out"

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=rf"No space left on device: writing {re.escape(str(out))}/x\.gen-\w+\."
                       rf"bin "
                       rf"\(converting .*a\.h5 into {re.escape(str(out))}\); free space") as info:
        convert_h5_to_raw(tmp_path / "a.h5", out)
    assert info.value.errno == 28 and not out.exists()  # a folder this call made is removed


def test_an_output_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """Issue 34: a read-only output folder is reported as the folder, with the fix, not as a temporary file
    inside it. (Simulated: this suite may run as root, which ignores permissions.)"""
    write_h5(tmp_path / "a.h5", data(0), ["x"], {})
    out = tmp_path / "ro"
    out.mkdir()
    def denying(real):
        def opener(path, *a, **k):
            if str(path).startswith(str(out)):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *a, **k)
        return opener

    monkeypatch.setattr(os, "open", denying(os.open))
    monkeypatch.setattr("builtins.open", denying(open))
    with pytest.raises(PermissionError, match=rf"cannot write in the output folder {re.escape(str(out))}; "
                       r"choose a folder you can write to"):
        convert_h5_to_raw(tmp_path / "a.h5", out)


# -- 6: manifests that lie ------------------------------------------------------------------------------


@pytest.fixture
def converted(tmp_path):
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"] = np.zeros((40, 64), np.float32)
        f["y"] = np.zeros(40, np.uint8)
    return convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")


def _edit(manifest: Path, rechecksum: bool = False, **fields) -> None:
    from gpufeed.sources._manifest import checksum

    doc = json.loads(manifest.read_text())
    for key, value in fields.items():
        if key == "num_samples_top":
            doc["num_samples"] = value
            continue
        field, attr = key.split("__")
        doc["fields"][field][attr] = value
    if rechecksum:
        doc["checksum"] = checksum(doc)
    manifest.write_text(json.dumps(doc))


EDITS = {
    "dtype <f4 -> <f2": {"x__dtype": "<f2"},
    "shape [64] -> [32]": {"x__shape": [32]},
    "num_samples halved in every field": {"x__num_samples": 20, "y__num_samples": 20, "num_samples_top": 20},
    "dtype <f4 -> <i4": {"x__dtype": "<i4"},
    "dtype |u1 -> |i1": {"y__dtype": "|i1"},
    "shape [64] -> [8, 8]": {"x__shape": [8, 8]},
    "top-level count halved only": {"num_samples_top": 20},
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_manifest_is_refused(converted, edit):
    """Issue 35.6: every edit of a manifest is refused with a ValueError naming it and the fix (its
    checksum), also those that keep every size consistent."""
    _edit(converted, **EDITS[edit])
    with pytest.raises(ValueError, match=rf"{re.escape(str(converted))} was edited after gpufeed convert "
                       r"wrote "
                       r"it.*re-run gpufeed convert"):
        RawSource(converted)


@pytest.mark.parametrize("case", ["padding with align=1", "field count against the manifest's",
                                  "dtype of another size"])
def test_a_manifest_with_a_valid_checksum_is_still_checked_against_its_files(converted, case):
    """Issue 35.6: a manifest whose checksum matches (written by a faulty tool) is still checked: the data
    end against the file's exact size (align 1: no padding), each field's count against the manifest's."""
    if case == "padding with align=1":
        x = converted.parent / json.loads(converted.read_text())["fields"]["x"]["file"]
        with open(x, "ab") as fh:
            fh.write(bytes(64))
        _edit(converted, rechecksum=True, x__file_size=os.path.getsize(x))
        want = r"is 10304 bytes, the manifest says 10304, and its 40 samples of 256 bytes .* need 10240"
    elif case == "field count against the manifest's":
        _edit(converted, rechecksum=True, num_samples_top=20)
        want = r"field 'x' has 40 samples, the manifest 20"
    else:
        _edit(converted, rechecksum=True, x__dtype="<f8")
        want = r"is 10240 bytes, the manifest says 10240, and its 40 samples of 512 bytes"
    with pytest.raises(ValueError, match=rf"{re.escape(str(converted))}: .*{want}.*re-run gpufeed convert"):
        RawSource(converted)


# -- 7: .npy headers ---------------------------------------------------------------------------------


def _npy_cases(path: Path) -> dict[str, bytes]:
    np.save(path, np.arange(40 * 6, dtype=np.float32).reshape(40, 6))
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[8:10], "little")
    header = raw[10 : 10 + hlen]
    assert header.startswith(b"{")
    return {
        "a damaged header byte": raw[:10] + b"\x00" + raw[11:],  # numpy: tokenize.TokenError, naming no file
        "header length -16": raw[:8] + (hlen - 16).to_bytes(2, "little") + raw[10:],
        "descr <f4 -> <f8": raw.replace(b"'<f4'", b"'<f8'", 1),
        "descr <f4 -> <f2": raw.replace(b"'<f4'", b"'<f2'", 1),
        "shape (40, 6) -> (40, 3)": raw.replace(b"(40, 6)", b"(40, 3)", 1),
        "shape (40, 6) -> (80, 6)": raw.replace(b"(40, 6)", b"(80, 6)", 1),
    }


@pytest.mark.parametrize("case", ["a damaged header byte", "header length -16",
                                  "descr <f4 -> <f8", "descr <f4 -> <f2", "shape (40, 6) -> (40, 3)",
                                  "shape (40, 6) -> (80, 6)"])
def test_a_damaged_npy_header_is_a_value_error_naming_the_file(tmp_path, case):
    """Issue 35.7: one damaged byte, a header length off by 16, another descr or shape: a ValueError naming
    the file (the exact size is checked against the header), never shifted or retyped rows."""
    path = tmp_path / "x.npy"
    damaged = _npy_cases(path)[case]
    assert damaged != path.read_bytes()
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} .*(re-save it|write it) with np\.save"):
        RawSource(path)


# -- 8: convert of a corrupt chunk -----------------------------------------------------------------------


def test_convert_of_a_corrupt_gzip_chunk_names_the_file_and_the_dataset(tmp_path):
    """Issue 35.8: h5py says only "Can't synchronously read data (filter returned failure during read)";
    the conversion's error names the file, the dataset and the rows, and an earlier conversion stays."""
    path = tmp_path / "g.h5"
    write_h5(path, data(0), ["x"], LAYOUTS["gzip"])
    out = tmp_path / "out"
    _damage_chunk(path, "x", 2)
    with pytest.raises(OSError, match=rf"reading rows \d+\.\.\d+ of dataset '/x' of {re.escape(str(path))} "
                       r"failed \(.*\); the file is damaged: check it with h5dump -d /x"):
        convert_h5_to_raw(path, out)
    assert not out.exists()


# -- 9: Ctrl-C on the h5py path ------------------------------------------------------------------------


def _swallowing_read_direct(monkeypatch, calls: list) -> None:
    """read_direct that receives a SIGINT whose KeyboardInterrupt is eaten inside it, as h5py's weak-
    reference callbacks do."""
    real = h5py.Dataset.read_direct

    def read_direct(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass  # swallowed
        return real(self, *a, **k)

    monkeypatch.setattr(h5py.Dataset, "read_direct", read_direct)


def test_one_ctrl_c_stops_an_h5py_read_even_when_h5py_swallows_it(tmp_path, monkeypatch):
    """Issue 35.9: the read through h5py (``use_offsets=False``) raises KeyboardInterrupt after the call
    that swallowed it, instead of reading on; the SIGINT handler is Python's own again afterwards."""
    path = tmp_path / "d.h5"
    write_h5(path, data(0), ["x", "y"], {})
    src = H5Source(path, fields=["x", "y"], use_offsets=False)
    calls: list = []
    _swallowing_read_direct(monkeypatch, calls)
    with pytest.raises(KeyboardInterrupt):
        read_all(src)
    assert len(calls) == 1, "the read went on after the Ctrl-C"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.undo()
    assert np.array_equal(read_all(src)["x"], data(0)["x"])  # and the source still reads
    src.close()


def test_one_ctrl_c_stops_a_conversion_even_when_h5py_swallows_it(tmp_path, monkeypatch):
    """Issue 35.9, convert: KeyboardInterrupt; the earlier conversion stays, nothing of the new one."""
    write_h5(tmp_path / "a.h5", data(0), ["x", "y"], {})
    write_h5(tmp_path / "b.h5", data(1), ["x", "y"], {})
    out = tmp_path / "out"
    convert_h5_to_raw(tmp_path / "a.h5", out)
    before = folder_files(out)
    calls: list = []
    _swallowing_read_direct(monkeypatch, calls)
    with pytest.raises(KeyboardInterrupt):
        convert_h5_to_raw(tmp_path / "b.h5", out)
    assert len(calls) == 1 and folder_files(out) == before


# -- issue 34: folders holding other files, realistic files ---------------------------------------------


def test_a_folder_holding_files_convert_did_not_write_is_refused_unless_forced(tmp_path):
    """Issue 34.1: a folder with other files is refused, naming them, writing nothing; with force=True the
    conversion is written beside them and they stay as they were."""
    write_h5(tmp_path / "a.h5", data(0), ["x", "y"], {})
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.bin").write_bytes(b"mine")
    (out / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=rf"{re.escape(str(out))} holds files gpufeed convert did not "
                       r"write: notes\.txt, x\.bin; choose an empty or new folder, or pass force=True"):
        convert_h5_to_raw(tmp_path / "a.h5", out)
    assert sorted(os.listdir(out)) == [".gpufeed-convert.lock", "notes.txt", "x.bin"]
    convert_h5_to_raw(tmp_path / "a.h5", out, force=True)
    assert (out / "x.bin").read_bytes() == b"mine" and (out / "notes.txt").read_text() == "keep"
    assert np.array_equal(read_all(RawSource(out))["x"], data(0)["x"])


def test_a_reconversion_removes_the_files_of_fields_it_no_longer_writes(tmp_path):
    """Issue 34.1: converting ``x`` after ``x`` and ``y`` leaves no file of ``y`` (nor the old ``x``)."""
    write_h5(tmp_path / "a.h5", data(0), ["x", "y"], {})
    out = tmp_path / "out"
    convert_h5_to_raw(tmp_path / "a.h5", out, fields=["x", "y"])
    convert_h5_to_raw(tmp_path / "a.h5", out, fields=["x"])
    doc = json.loads((out / "manifest.json").read_text())
    want = [".gpufeed-convert.lock", "manifest.json", doc["fields"]["x"]["file"]]
    assert sorted(os.listdir(out)) == sorted(want)


def test_the_cli_refuses_a_foreign_folder_and_force_writes_beside(tmp_path, capsys):
    """Issue 34.1 on the command line: the error names the files and ``--force``."""
    from gpufeed.cli import main

    write_h5(tmp_path / "a.h5", data(0), ["x"], {})
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt").write_bytes(b"w")
    assert main(["convert", str(tmp_path / "a.h5"), str(out)]) == 1
    err = capsys.readouterr().err
    assert "did not write: model.pt" in err and "--force" in err and "force=True" not in err
    assert main(["convert", str(tmp_path / "a.h5"), str(out), "--force"]) == 0
    assert (out / "model.pt").read_bytes() == b"w"


def _cifar_like(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    d = {"images": rng.integers(0, 256, (500, 3, 32, 32), np.uint8), "labels": rng.integers(0, 10, 500),
         "mean": np.array([0.49, 0.48, 0.45], np.float32), "std": np.array([0.25, 0.24, 0.26], np.float32)}
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=d["images"], chunks=(50, 3, 32, 32), compression="gzip")
        f["labels"] = d["labels"]
        f["mean"], f["std"] = d["mean"], d["std"]
        f["class_names"] = np.array([f"class{i}" for i in range(10)], dtype=h5py.string_dtype())
        f.attrs["description"] = "a CIFAR-like file"
        f.attrs["version"] = np.int64(3)
        f["images"].attrs["layout"] = "NCHW"
    return d


def test_a_realistic_file_converts_by_default_and_keeps_its_metadata(tmp_path):
    """Issue 34.2: images (N,3,32,32) gzip, labels (N,), mean (3,), std (3,), class_names (10 strings) and
    attributes. By default convert and H5Source take images and labels (the largest group of one length),
    name every other dataset with why, and keep the small ones and every attribute as metadata, equal in
    H5Source.metadata and RawSource.metadata."""
    path = tmp_path / "cifar_like.h5"
    d = _cifar_like(path)
    with pytest.warns(RuntimeWarning, match=r"skipped \['class_names', 'mean', 'std'\].*'class_names': .*"
                      r"strings.*'mean': 3 rows, not the 500 samples of \['images', 'labels'\].*kept in the "
                      r"manifest's metadata: \['class_names', 'mean', 'std'\]"):
        manifest = convert_h5_to_raw(path, tmp_path / "out")
    doc = json.loads(manifest.read_text())
    assert sorted(doc["fields"]) == ["images", "labels"] and sorted(doc["skipped"]) == ["class_names", "mean",
                                                                                        "std"]
    raw = RawSource(manifest)
    got = read_all(raw, 500)
    assert np.array_equal(got["images"], d["images"]) and np.array_equal(got["labels"], d["labels"])
    with pytest.warns(RuntimeWarning, match=r"reading \['images', 'labels'\]; left out: .*'mean'"):
        h5 = H5Source(path)
    assert list(h5.fields) == ["images", "labels"] and sorted(h5.skipped) == ["class_names", "mean", "std"]
    for meta in (raw.metadata, h5.metadata):
        mean = meta["datasets"]["mean"]
        assert np.array_equal(mean, d["mean"]) and mean.dtype == np.float32
        assert np.array_equal(meta["datasets"]["std"], d["std"])
        assert meta["datasets"]["class_names"].tolist() == [f"class{i}" for i in range(10)]
        assert meta["attrs"]["/"]["description"] == "a CIFAR-like file"
        assert meta["attrs"]["/"]["version"] == 3 and meta["attrs"]["/images"]["layout"] == "NCHW"
    assert set(raw.metadata["datasets"]) == set(h5.metadata["datasets"])


def test_fields_given_as_one_name_is_that_one_field(tmp_path):
    """Issue 34: ``fields="images"`` (a string) reads that one dataset, as ``["images"]``; never its
    letters."""
    path = tmp_path / "cifar_like.h5"
    d = _cifar_like(path)
    src = H5Source(path, fields="images")
    assert list(src.fields) == ["images"] and np.array_equal(read_all(src, 500)["images"], d["images"])
    manifest = convert_h5_to_raw(path, tmp_path / "out", fields="labels")
    assert list(RawSource(manifest).fields) == ["labels"]
    assert list(RawSource(manifest, fields="labels").fields) == ["labels"]
