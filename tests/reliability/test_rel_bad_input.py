"""Bad input for every source kind: the error has the right type, names the file, and says the fix.

Each case builds the defect, expects an exception type, a pattern that names the file and, where the
message states a fix, a pattern for it. Cases whose message leaves the fix implicit (a missing file:
"no such file") say so in their note; docs/reliability.md lists the messages that could say more.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from _rel import note

from gpufeed.sources import FileChangedError, RawSource

h5py = pytest.importorskip("h5py")

from gpufeed.convert import convert_h5_to_raw  # noqa: E402
from gpufeed.sources import H5Source  # noqa: E402
from gpufeed.sources._manifest import checksum  # noqa: E402

X = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)
Y = np.arange(40, dtype=np.int64)
H5_LAYOUTS = {"h5-contiguous": {}, "h5-chunked": {"chunks": 4},
              "h5-gzip": {"chunks": 4, "compression": "gzip"}}  # chunks: rows per chunk
KINDS = ["npy", "raw", "raw-files", "manifest", *H5_LAYOUTS]


def write(kind: str, root: Path, x=X, y=Y, name: str = "d") -> tuple[Path, callable]:
    """Files of ``kind`` holding x and y; returns (the file holding x, a function opening the source)."""
    if kind == "npy":
        np.save(root / f"{name}x.npy", x)
        np.save(root / f"{name}y.npy", y)
        return root / f"{name}x.npy", lambda: RawSource(fields={"x": root / f"{name}x.npy",
                                                                "y": root / f"{name}y.npy"})
    if kind == "raw":
        x.tofile(root / f"{name}x.f32")
        y.tofile(root / f"{name}y.i64")
        return root / f"{name}x.f32", lambda: RawSource(fields={
            "x": {"paths": root / f"{name}x.f32", "dtype": "float32", "shape": x.shape[1:]},
            "y": {"paths": root / f"{name}y.i64", "dtype": "int64"}})
    if kind == "raw-files":
        np.save(root / f"{name}x0.npy", x[:15])
        np.save(root / f"{name}x1.npy", x[15:])
        np.save(root / f"{name}y.npy", y)
        return root / f"{name}x1.npy", lambda: RawSource(fields={
            "x": [root / f"{name}x0.npy", root / f"{name}x1.npy"], "y": root / f"{name}y.npy"})
    if kind == "manifest":
        _h5(root / f"{name}src.h5", {}, x, y)
        m = convert_h5_to_raw(root / f"{name}src.h5", root / f"{name}raw", align=1)
        return _data_file(m, "x"), lambda: RawSource(m)
    path = root / f"{name}.h5"
    _h5(path, H5_LAYOUTS[kind], x, y)
    return path, lambda: H5Source(path, fields=["x", "y"])


def _data_file(manifest: Path, field: str) -> Path:
    """The data file the manifest names for ``field`` (``x.gen-<id>.bin``)."""
    return manifest.parent / json.loads(manifest.read_text())["fields"][field]["file"]


def _h5(path: Path, kw: dict, x, y) -> None:
    with h5py.File(path, "w") as f:
        for name, arr in (("x", x), ("y", y)):
            opts = dict(kw)
            if "chunks" in opts:
                opts["chunks"] = (opts["chunks"], *arr.shape[1:])
            f.create_dataset(name, data=arr, **opts)


def expect(fn, exc_type, names, fix=None):
    """Run ``fn``; it must raise ``exc_type`` with a message matching ``names`` (the file) and ``fix``."""
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    assert re.search(names, msg), f"the message does not name the file ({names}): {msg}"
    if fix is not None:
        assert re.search(fix, msg), f"the message does not say the fix ({fix}): {msg}"
    note(f"{exc_type.__name__}; names the file; " + ("says the fix" if fix else "fix implicit"))
    return msg


def _read(src, rows):
    out = {k: torch.empty((len(rows), *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
    src.read(rows, out)


# -- missing files ---------------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_missing_file(kind, tmp_path):
    """A file of the source is missing when the source is made."""
    victim, opener = write(kind, tmp_path)
    os.remove(victim)
    if kind == "manifest":
        expect(opener, ValueError, re.escape(str(victim)), r"is missing.*re-run gpufeed convert")
    else:
        expect(opener, FileNotFoundError, re.escape(str(victim)), None)


@pytest.mark.timeout(30)
def test_missing_manifest(tmp_path):
    """The manifest itself is missing (``from_manifest`` and a ``.json`` path)."""
    expect(lambda: RawSource.from_manifest(tmp_path / "gone"), FileNotFoundError, "gone", "gpufeed convert")
    expect(lambda: RawSource(tmp_path / "gone.json"), FileNotFoundError, "gone.json", None)


# -- truncated files -------------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_truncated_before_open(kind, tmp_path):
    """A file is shorter than its header or manifest says, before the source is made."""
    victim, opener = write(kind, tmp_path)
    os.truncate(victim, os.path.getsize(victim) - 20)
    where = re.escape(str(victim))
    if kind in ("npy", "raw-files"):
        expect(opener, ValueError, where, r"truncated.*re-save it")
    elif kind == "raw":
        expect(opener, ValueError, where, r"not a whole number.*check dtype=, shape= and offset=")
    elif kind == "manifest":
        expect(opener, ValueError, where, r"manifest says.*re-run gpufeed convert")
    else:  # HDF5 checks its end-of-file address when opening
        expect(opener, ValueError, where + r" as HDF5 \(.*truncated file", None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_truncated_after_open(kind, tmp_path):
    """A file is truncated after the source was made: the read raises FileChangedError (an OSError)."""
    victim, opener = write(kind, tmp_path)
    src = opener()
    _read(src, range(2))
    size = os.path.getsize(victim)
    os.truncate(victim, size // 3)
    expect(lambda: _read(src, range(40)), FileChangedError,
           re.escape(str(victim)) + f" changed after the source was made: its size went from {size} to "
           f"{size // 3} bytes", r"truncated or rewritten\).*recreate the source")
    src.close()


# -- wrong dtype or shape --------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["npy", "raw", "raw-files", "manifest", *H5_LAYOUTS])
def test_wrong_dtype(kind, tmp_path):
    """A dtype that does not match the data (or concatenated files of different dtypes)."""
    if kind == "npy":
        np.save(tmp_path / "x.npy", X)
        expect(lambda: RawSource(tmp_path / "x.npy", dtype="int32"), ValueError, r"x\.npy",
               r"holds dtype torch.float32, but dtype=torch.int32 was passed")
    elif kind == "raw":
        X.tofile(tmp_path / "x.bin")
        expect(lambda: RawSource(tmp_path / "x.bin", dtype="floot32", shape=6), ValueError, r"x\.bin",
               r"is not a dtype; pass e\.g\. 'float32'")
    elif kind == "raw-files":
        np.save(tmp_path / "a.npy", X)
        np.save(tmp_path / "b.npy", X.astype(np.float64))
        expect(lambda: RawSource([tmp_path / "a.npy", tmp_path / "b.npy"]), ValueError, r"b\.npy.*a\.npy",
               "concatenated files must agree")
    elif kind == "manifest":
        _, _opener = write(kind, tmp_path)
        expect(lambda: RawSource(tmp_path / "draw", dtype="float32"), ValueError, r"manifest \S*draw",
               r"records each field.s name, dtype, shape and data offset; do not pass name=, dtype=")
    else:
        write(kind, tmp_path, name="a")
        write(kind, tmp_path, X.astype(np.float64), name="b")
        expect(lambda: H5Source([tmp_path / "a.h5", tmp_path / "b.h5"], fields=["x", "y"]), ValueError,
               r"b\.h5.*a\.h5", "concatenated files must agree")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["npy", "raw", "raw-files", "manifest", *H5_LAYOUTS])
def test_wrong_shape(kind, tmp_path):
    """A per-sample shape that does not match the data (or concatenated files of different shapes)."""
    if kind == "npy":
        np.save(tmp_path / "x.npy", X)
        expect(lambda: RawSource(tmp_path / "x.npy", shape=(3, 2)), ValueError, r"x\.npy",
               r"holds shape \(6,\), but shape=\(3, 2\) was passed")
    elif kind == "raw":
        X.tofile(tmp_path / "x.bin")
        expect(lambda: RawSource(tmp_path / "x.bin", dtype="float32", shape=7), ValueError, r"x\.bin",
               r"not a whole number of 28-byte samples.*check dtype=, shape= and offset=")
    elif kind == "raw-files":
        np.save(tmp_path / "a.npy", X)
        np.save(tmp_path / "b.npy", X.reshape(40, 3, 2))
        expect(lambda: RawSource([tmp_path / "a.npy", tmp_path / "b.npy"]), ValueError, r"b\.npy.*a\.npy",
               "concatenated files must agree")
    elif kind == "manifest":
        victim, opener = write(kind, tmp_path)
        m = victim.parent / "manifest.json"
        doc = json.loads(m.read_text())
        doc["fields"]["x"]["shape"] = [7]
        m.write_text(json.dumps(doc))
        expect(opener, ValueError, re.escape(str(m)), r"was edited after gpufeed convert wrote it.*re-run "
               "gpufeed convert")
        _edit_field(m, "x", shape=[7])  # the same edit with a valid checksum: the size check
        expect(opener, ValueError, re.escape(str(victim)), r"40 samples of 28 bytes.*re-run gpufeed convert")
    else:
        write(kind, tmp_path, name="a")
        write(kind, tmp_path, X.reshape(40, 2, 3), name="b")
        expect(lambda: H5Source([tmp_path / "a.h5", tmp_path / "b.h5"], fields=["x", "y"]), ValueError,
               r"b\.h5.*a\.h5", "concatenated files must agree")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("what", ["dtype", "shape", "rows"])
def test_wrong_out_tensors(kind, what, tmp_path):
    """``read`` into out tensors of the wrong dtype, shape or too few rows: ValueError naming the source's
    file and what to pass."""
    _, opener = write(kind, tmp_path)
    src = opener()
    out = {k: torch.empty((4, *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
    if what == "dtype":
        out["x"] = torch.empty(4, 6, dtype=torch.float64)
        fix = r"out\['x'\] has dtype torch.float64, the field holds torch.float32"
    elif what == "shape":
        out["x"] = torch.empty(4, 5)
        fix = r"out\['x'\] has shape \(4, 5\), expected \(rows, \*\(6,\)\)"
    else:
        out["x"] = torch.empty(2, 6)
        fix = r"room for 2 rows but 4 rows were asked; pass a tensor of at least 4 rows"
    first = Path(src.files[0]).name
    expect(lambda: src.read(range(4), out), ValueError, re.escape(first), fix)
    src.close()


# -- manifests that do not match -------------------------------------------------------------------

def _append(path, data):
    with open(path, "ab") as fh:
        fh.write(data)


MANIFEST_EDITS = {
    "data file resized": (lambda m: _append(_data_file(m, "x"), b"12345"), r"x\.gen-\w+\.bin",
                          r"is 965 bytes, the manifest says 960.*re-run gpufeed convert"),
    "bad JSON": (lambda m: m.write_text("{oops"), r"manifest\.json",
                 r"not a valid gpufeed manifest.*re-run"),
    "other version": (lambda m: _edit(m, version=99), r"manifest\.json",
                      r"version 99.*re-run gpufeed convert"),
    "counts edited": (lambda m: _edit_field(m, "y", num_samples=39), r"manifest\.json: field 'y'",
                      r"has 39 samples, the manifest 40.*re-run gpufeed convert"),
    "edited, checksum left": (lambda m: _edit_field(m, "x", dtype="<i4", rechecksum=False), r"manifest\.json",
                              r"was edited after gpufeed convert wrote it.*re-run gpufeed convert"),
    "path outside": (lambda m: _edit_field(m, "x", file="../x.bin"), r"manifest\.json",
                     r"must be a plain name beside the manifest.*re-run gpufeed convert"),
    "object dtype": (lambda m: _edit_field(m, "y", dtype="|O"), r"y\.gen-\w+\.bin",
                     r"holds Python objects.*store numbers"),
}


def _edit(m, **kw):
    doc = json.loads(m.read_text())
    doc.update(kw)
    m.write_text(json.dumps(doc))


def _edit_field(m, name, rechecksum=True, **kw):
    """Edit a field of a manifest; ``rechecksum``: as a faulty writer would, with a matching checksum, so
    that the checks of its contents against the files are what is tested."""
    doc = json.loads(m.read_text())
    doc["fields"][name].update(kw)
    if rechecksum:
        doc["checksum"] = checksum(doc)
    m.write_text(json.dumps(doc))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_manifest_does_not_match(edit, tmp_path):
    """A manifest that does not match its files (or is not a manifest)."""
    victim, opener = write("manifest", tmp_path)
    fn, names, fix = MANIFEST_EDITS[edit]
    fn(victim.parent / "manifest.json")
    expect(opener, ValueError, names, fix)


# -- unsupported layouts and dtypes ----------------------------------------------------------------

def _h5_case(make):
    def build(path):
        with h5py.File(path, "w") as f:
            make(f)
    return build


def _virtual(f):
    src = Path(f.filename).with_name("vsrc.h5")
    with h5py.File(src, "w") as g:
        g["x"] = np.arange(10, dtype=np.float32)
    layout = h5py.VirtualLayout(shape=(10,), dtype="f4")
    layout[:] = h5py.VirtualSource(str(src), "x", shape=(10,))
    f.create_virtual_dataset("x", layout)


def _external(f):
    ext = Path(f.filename).with_name("ext.raw")
    np.arange(10, dtype=np.float32).tofile(ext)
    f.create_dataset("x", shape=(10,), dtype="f4", external=[(str(ext), 0, 40)])


UNSUPPORTED = {
    "h5 vlen strings": (_h5_case(lambda f: f.create_dataset("x", data=["a", "b"], dtype=h5py.string_dtype())),
                        "holds strings or variable-length data.*store them as numbers"),
    "h5 vlen sequences": (_h5_case(lambda f: f.create_dataset("x", shape=(2,), dtype=h5py.vlen_dtype("i4"))),
                          "holds strings or variable-length data.*store them as numbers"),
    "h5 object references": (_h5_case(lambda f: f.create_dataset("x", shape=(2,), dtype=h5py.ref_dtype)),
                             "holds Python objects.*store numbers"),
    "h5 compound": (_h5_case(lambda f: f.create_dataset("x", data=np.zeros(3, "f4,i4"))),
                    "compound dtype.*store each member as its own dataset"),
    "h5 scalar": (_h5_case(lambda f: f.create_dataset("x", data=3.0)), r"is a scalar.*shape \(N, \.\.\.\)"),
    "h5 virtual": (_h5_case(_virtual), "virtual dataset.*convert_h5_to_raw"),
    "h5 external": (_h5_case(_external), "external raw file.*RawSource"),
    "npy object": (lambda p: np.save(p, np.array([[1], ["a"]], dtype=object), allow_pickle=True),
                   "holds Python objects.*store numbers"),
    "npy structured": (lambda p: np.save(p, np.zeros(3, "f4,i4")), "structured dtype.*its own field"),
    "npy bytes": (lambda p: np.save(p, np.array([b"ab", b"cd"])), "no torch equivalent.*numeric dtype"),
    "npy Fortran order": (lambda p: np.save(p, np.asfortranarray(np.zeros((4, 3), "f4"))),
                          r"Fortran order.*np\.ascontiguousarray"),
    "npy big-endian": (lambda p: np.save(p, np.zeros((4, 3), ">f4")), r"byte order.*astype\('<f4'\)"),
    "npy 0-d": (lambda p: np.save(p, np.float32(1)), r"0-d array.*shape \(N, \.\.\.\)"),
    "npy not npy": (lambda p: p.write_bytes(b"not numpy at all"), "not a valid .npy file.*np.save"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_layout_or_dtype(case, tmp_path):
    """An HDF5 layout or dtype, or a .npy file, that gpufeed cannot read as fixed-size numeric samples."""
    build, fix = UNSUPPORTED[case]
    path = tmp_path / ("d.h5" if case.startswith("h5") else "d.npy")
    build(path)
    opener = (lambda: H5Source(path, fields=["x"])) if case.startswith("h5") else (lambda: RawSource(path))
    expect(opener, ValueError, re.escape(path.name), fix)


# -- fields with different sample counts -----------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_fields_with_different_sample_counts(kind, tmp_path):
    """Fields of one source hold different numbers of samples."""
    if kind == "manifest":
        victim, opener = write(kind, tmp_path)
        _edit_field(victim.parent / "manifest.json", "y", num_samples=39)
        expect(opener, ValueError, r"manifest\.json: field 'y'", "has 39 samples, the manifest 40")
        return
    _, opener = write(kind, tmp_path, y=Y[:39])
    names = r"\.h5: fields" if kind.startswith("h5") else r"'x': 40 \(.*'y': 39 \(.*y\."
    expect(opener, ValueError, names, "different sample counts.*one row per sample")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("layout", list(H5_LAYOUTS))
def test_h5_files_with_different_sample_counts_per_field(layout, tmp_path):
    """The second of two HDF5 files holds fewer samples in one field."""
    write(layout, tmp_path, name="a")
    write(layout, tmp_path, y=Y[:39], name="b")
    expect(lambda: H5Source([tmp_path / "a.h5", tmp_path / "b.h5"], fields=["x", "y"]), ValueError,
           r"b\.h5: fields have different sample counts", "one row per sample")


# -- rows out of range -----------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [range(39, 41), np.array([3, 40]), np.array([-1]), range(-1, 2)],
                         ids=["range past the end", "array past the end", "negative array", "negative range"])
def test_index_out_of_range(kind, rows, tmp_path):
    """``read`` of a row outside ``[0, len)``: IndexError naming the source, the row and the valid range."""
    _, opener = write(kind, tmp_path)
    src = opener()
    first = Path(src.files[0]).name
    bad = 40 if (np.asarray(rows) >= 40).any() else -1
    expect(lambda: _read(src, rows), IndexError, re.escape(first),
           rf"row {bad} is out of range for 40 samples \(valid: 0\.\.39\)")
    src.close()
