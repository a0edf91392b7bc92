"""Bad input gives a clear error of the right type that names the file and says what to do."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from gpufeed.sources import FileChangedError, RawSource

h5py = pytest.importorskip("h5py")

from gpufeed.convert import convert_h5_to_raw  # noqa: E402
from gpufeed.sources import H5Source  # noqa: E402


def _out(src, n):
    return {name: torch.empty((n, *f.shape), dtype=f.dtype) for name, f in src.fields.items()}


# ---- missing things -------------------------------------------------------------------------------------


def test_missing_npy_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.npy"):
        RawSource(tmp_path / "nope.npy")


def test_missing_file_among_many(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((3, 2)))
    with pytest.raises(FileNotFoundError, match=r"b.npy"):
        RawSource([tmp_path / "a.npy", tmp_path / "b.npy"])


def test_missing_hdf5_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.h5"):
        H5Source(tmp_path / "nope.h5", fields=["x"])


def test_missing_dataset_lists_what_exists(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["images"] = np.zeros((4, 2), np.uint8)
        f["labels"] = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=r"a.h5 has no dataset 'imgs'.*images, labels.*fields="):
        H5Source(tmp_path / "a.h5", fields=["imgs"])


def test_missing_dataset_in_a_later_file(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"] = np.zeros((4, 2), np.uint8)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["z"] = np.zeros((4, 2), np.uint8)
    with pytest.raises(ValueError, match=r"b.h5 has no dataset 'x'"):
        H5Source([tmp_path / "a.h5", tmp_path / "b.h5"], fields=["x"])


def test_group_instead_of_dataset(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["g/x"] = np.zeros((4, 2), np.uint8)
    with pytest.raises(ValueError, match=r"a.h5: 'g' is a group"):
        H5Source(tmp_path / "a.h5", fields=["g"])


def test_not_an_hdf5_file(tmp_path):
    (tmp_path / "a.h5").write_bytes(b"not hdf5 at all" * 100)
    with pytest.raises(ValueError, match=r"a.h5 as HDF5"):
        H5Source(tmp_path / "a.h5", fields=["x"])


def test_missing_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"manifest.json"):
        RawSource(tmp_path / "manifest.json")


# ---- truncated files ------------------------------------------------------------------------------------


def test_truncated_npy(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 4), np.float32))
    size = os.path.getsize(tmp_path / "x.npy")
    os.truncate(tmp_path / "x.npy", size - 5)
    with pytest.raises(ValueError, match=r"x.npy is truncated: its header says 10 samples.*re-save"):
        RawSource(tmp_path / "x.npy")


def test_raw_file_not_a_whole_number_of_samples(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 30)
    with pytest.raises(ValueError, match=r"x.bin holds 30 bytes.*16-byte samples.*dtype=, shape="):
        RawSource(tmp_path / "x.bin", dtype="float32", shape=4)


def test_raw_file_without_dtype(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 32)
    with pytest.raises(ValueError, match=r"x.bin is a raw file: pass dtype="):
        RawSource(tmp_path / "x.bin")


@pytest.mark.parametrize("kind", ["npy", "h5"])
def test_file_truncated_after_opening_raises_file_changed(tmp_path, kind):
    x = np.arange(400, dtype=np.float32).reshape(100, 4)
    if kind == "npy":
        path = tmp_path / "x.npy"
        np.save(path, x)
        src = RawSource(path)
    else:
        path = tmp_path / "x.h5"
        with h5py.File(path, "w") as f:
            f["x"] = x
        src = H5Source(path, fields=["x"])
    src.read(range(100), _out(src, 100))
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    with pytest.raises(FileChangedError, match=rf"{re.escape(str(path))} changed after the source was made: "
                       rf"its size went from {size} to {size - 100} bytes.*recreate the source"):
        src.read(range(100), _out(src, 100))


# ---- manifests that do not match their files -----------------------------------------------------------


@pytest.fixture
def manifest(tmp_path):
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"] = np.zeros((10, 4), np.float32)
        f["y"] = np.zeros(10, np.int64)
    return convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", align=1)


def _data_file(manifest, field):
    return manifest.parent / json.loads(manifest.read_text())["fields"][field]["file"]


def test_manifest_data_file_resized(manifest):
    with open(_data_file(manifest, "x"), "ab") as fh:
        fh.write(b"extra")
    with pytest.raises(
        ValueError, match=r"x.gen-\w+.bin of field 'x' is 165 bytes, the manifest says 160.*re-run gpufeed "
                          r"convert"
    ):
        RawSource(manifest)


def test_manifest_data_file_missing(manifest):
    os.remove(_data_file(manifest, "y"))
    with pytest.raises(ValueError, match=r"y.gen-\w+.bin of field 'y' is missing.*re-run gpufeed convert"):
        RawSource.from_manifest(manifest)


def test_manifest_bad_json(manifest):
    manifest.write_text("{not json")
    with pytest.raises(
        ValueError, match=r"manifest.json is not a valid gpufeed manifest.*re-run gpufeed convert"
    ):
        RawSource(manifest)


def test_manifest_from_another_version(manifest):
    doc = json.loads(manifest.read_text())
    doc["version"] = 99
    manifest.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"version 99.*re-run gpufeed convert"):
        RawSource(manifest)


def test_manifest_with_dtype_argument(manifest):
    with pytest.raises(ValueError, match=r"records each field.s name, dtype, shape and data offset"):
        RawSource(manifest, dtype="float32")


# ---- unsupported dtypes and layouts -------------------------------------------------------------------


def test_object_dtype_npy(tmp_path):
    np.save(tmp_path / "o.npy", np.array([[1], ["a"]], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"o.npy: dtype object holds Python objects"):
        RawSource(tmp_path / "o.npy")


def test_object_dtype_raw(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * 32)
    with pytest.raises(ValueError, match=r"holds Python objects"):
        RawSource(tmp_path / "x.bin", dtype=object)


def test_structured_and_string_npy(tmp_path):
    np.save(tmp_path / "s.npy", np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]))
    with pytest.raises(ValueError, match=r"s.npy: structured dtype"):
        RawSource(tmp_path / "s.npy")
    np.save(tmp_path / "b.npy", np.array([b"ab", b"cd"]))
    with pytest.raises(ValueError, match=r"b.npy: dtype .S2 has no torch equivalent"):
        RawSource(tmp_path / "b.npy")


def test_fortran_order_npy(tmp_path):
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((4, 3), np.float32)))
    with pytest.raises(ValueError, match=r"f.npy is stored in Fortran order.*ascontiguousarray"):
        RawSource(tmp_path / "f.npy")


def test_big_endian_npy(tmp_path):
    np.save(tmp_path / "be.npy", np.zeros((4, 3), ">f4"))
    with pytest.raises(
        ValueError, match=r"be.npy: dtype >f4 is not in this machine's byte order.*astype\('<f4'\)"
    ):
        RawSource(tmp_path / "be.npy")


def test_zero_d_npy(tmp_path):
    np.save(tmp_path / "z.npy", np.float32(3))
    with pytest.raises(ValueError, match=r"z.npy holds a 0-d array"):
        RawSource(tmp_path / "z.npy")


def test_vlen_strings_h5(tmp_path):
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f.create_dataset("names", data=["a", "bb", "ccc"], dtype=h5py.string_dtype())
    with pytest.raises(ValueError, match=r"s.h5: dataset 'names' holds strings or variable-length data"):
        H5Source(tmp_path / "s.h5", fields=["names"])


def test_fixed_strings_and_vlen_sequences_h5(tmp_path):
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f["fixed"] = np.array([b"ab", b"cd"])
        d = f.create_dataset("seq", shape=(2,), dtype=h5py.vlen_dtype(np.int32))
        d[0] = [1, 2]
    for name in ("fixed", "seq"):
        with pytest.raises(ValueError, match=rf"s.h5: dataset '{name}' holds strings or variable-length"):
            H5Source(tmp_path / "s.h5", fields=[name])


def test_object_references_h5(tmp_path):
    with h5py.File(tmp_path / "r.h5", "w") as f:
        f["x"] = np.zeros(2)
        f.create_dataset("refs", data=[f["x"].ref, f["x"].ref], dtype=h5py.ref_dtype)
    with pytest.raises(ValueError, match=r"r.h5: dataset 'refs'.*Python objects"):
        H5Source(tmp_path / "r.h5", fields=["refs"])


def test_compound_h5(tmp_path):
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f["rec"] = np.zeros(3, dtype=[("a", "f4"), ("b", "i4")])
    with pytest.raises(ValueError, match=r"c.h5: dataset 'rec' has a compound dtype"):
        H5Source(tmp_path / "c.h5", fields=["rec"])


def test_scalar_dataset_h5(tmp_path):
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f["s"] = 3.0
    with pytest.raises(ValueError, match=r"c.h5: dataset 's' is a scalar"):
        H5Source(tmp_path / "c.h5", fields=["s"])


def test_virtual_dataset_h5(tmp_path):
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f["x"] = np.arange(10, dtype=np.float32)
    layout = h5py.VirtualLayout(shape=(10,), dtype="f4")
    layout[:] = h5py.VirtualSource(str(tmp_path / "src.h5"), "x", shape=(10,))
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f.create_virtual_dataset("x", layout)
    with pytest.raises(ValueError, match=r"v.h5: dataset 'x' is a virtual dataset.*convert"):
        H5Source(tmp_path / "v.h5", fields=["x"])
    # The converter materializes it.
    src = RawSource(convert_h5_to_raw(tmp_path / "v.h5", tmp_path / "raw"))
    out = _out(src, 10)
    src.read(range(10), out)
    assert np.array_equal(out["x"].numpy(), np.arange(10, dtype=np.float32))


def test_external_storage_h5(tmp_path):
    np.arange(10, dtype=np.float32).tofile(tmp_path / "ext.raw")
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f.create_dataset("x", shape=(10,), dtype="f4", external=[(str(tmp_path / "ext.raw"), 0, 40)])
    with pytest.raises(
        ValueError, match=r"e.h5: dataset 'x' keeps its data in external raw file.*ext.raw.*RawSource"
    ):
        H5Source(tmp_path / "e.h5", fields=["x"])


# ---- fields that disagree ----------------------------------------------------------------------------


def test_raw_fields_with_different_counts(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 2), np.float32))
    np.save(tmp_path / "y.npy", np.zeros(9, np.int64))
    with pytest.raises(ValueError, match=r"different sample counts: 'x': 10 \(.*x.npy\), 'y': 9 \(.*y.npy\)"):
        RawSource(fields={"x": tmp_path / "x.npy", "y": tmp_path / "y.npy"})


def test_h5_fields_with_different_counts(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"] = np.zeros((10, 2), np.float32)
        f["y"] = np.zeros(9, np.int64)
    with pytest.raises(ValueError, match=r"a.h5: fields have different sample counts \('x': 10, 'y': 9\)"):
        H5Source(tmp_path / "a.h5", fields=["x", "y"])
    with pytest.warns(RuntimeWarning, match=r"reading \['x'\]; left out: 'y': 9 rows, not the 10 samples"):
        assert list(H5Source(tmp_path / "a.h5").fields) == ["x"]  # no fields named: the larger group


def test_concatenated_files_with_different_sample_shapes(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((3, 2), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match=r"b.npy holds samples of \(5,\).*a.npy holds \(2,\)"):
        RawSource([tmp_path / "a.npy", tmp_path / "b.npy"])


# ---- rows out of range --------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [range(8, 11), np.array([0, 10]), np.array([-1, 2]), range(-1, 2)])
def test_index_out_of_range_names_the_row_and_length(tmp_path, rows):
    np.save(tmp_path / "x.npy", np.zeros((10, 2), np.float32))
    src = RawSource(tmp_path / "x.npy")
    with pytest.raises(IndexError, match=r"RawSource\(x.npy\): row -?1?0? is out of range for 10 samples"):
        src.read(rows, _out(src, len(rows)))


def test_float_rows_are_rejected(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 2), np.float32))
    src = RawSource(tmp_path / "x.npy")
    with pytest.raises(ValueError, match=r"integer"):
        src.read(np.array([0.0, 1.0]), _out(src, 2))


def test_a_missing_path_is_named_without_a_field_the_user_never_named(tmp_path):
    for path in (tmp_path / "nope", str(tmp_path / "nope") + "/"):
        with pytest.raises(FileNotFoundError) as err:
            RawSource(path)
        assert str(err.value).startswith(f"RawSource: no such file or directory: {path}")
        assert "field" not in str(err.value)


def test_a_read_that_fails_in_the_os_names_the_file(tmp_path):
    """The file replaced by a directory before its first read: the error the consumer gets names the file
    (a FileChangedError: it is no longer the file the source was made on)."""
    from gpufeed import CudaPrefetcher, SourceLoader

    path = tmp_path / "x.npy"
    np.save(path, np.arange(4000, dtype=np.float32).reshape(1000, 4))
    src = RawSource(path)
    path.unlink()
    path.mkdir()
    with pytest.raises(FileChangedError) as err, CudaPrefetcher(SourceLoader(src, batch_size=100),
                                                                 device="cpu") as pf:
        list(pf)
    assert err.value.filename == str(path) and str(path) in str(err.value)
