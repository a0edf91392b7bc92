"""RawSource's constructor errors point at the argument or the source the user needs."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from gpufeed.sources import RawSource

SIGNATURE = b"\x89HDF\r\n\x1a\n"


def test_a_dict_of_fields_passed_as_paths_names_fields(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    spec = {"x": str(tmp_path / "x.npy")}
    with pytest.raises(TypeError) as err:
        RawSource(spec)
    assert str(err.value) == (
        f"RawSource: the first argument is paths=, a file or a list of files, got a dict {spec!r}; "
        f"name fields with fields=, e.g. RawSource(fields={spec!r})")
    assert len(RawSource(fields=spec)) == 4  # what the message suggests works


@pytest.mark.parametrize("userblock", [0, 512, 2048])
def test_an_hdf5_file_points_to_h5source_and_convert(tmp_path, userblock):
    h5py = pytest.importorskip("h5py")
    path = str(tmp_path / "data.h5")
    with h5py.File(path, "w", userblock_size=userblock) as f:
        f["x"] = np.zeros((10, 3), np.float32)
    with open(path, "rb") as fh:
        assert fh.read()[userblock : userblock + 8] == SIGNATURE
    for kwargs in ({}, {"dtype": "float32", "shape": 3}):
        with pytest.raises(ValueError) as err:
            RawSource(path, **kwargs)
        assert str(err.value) == (
            f"RawSource: {path} is an HDF5 file, not raw samples: read it with H5Source({path!r}, "
            f"fields=[...]), or convert it once with `gpufeed convert {path} OUTDIR` and pass "
            "RawSource(OUTDIR)")


def test_only_a_signature_where_hdf5_looks_makes_an_hdf5_file(tmp_path):
    data = bytearray(4096)
    data[100:108] = SIGNATURE  # not at 0, 512, 1024, 2048: not where HDF5 looks
    (tmp_path / "x.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape("x.bin is a raw file: pass dtype=")):
        RawSource(tmp_path / "x.bin")
    assert len(RawSource(tmp_path / "x.bin", dtype="uint8", shape=16)) == 256
    data[1024:1032] = SIGNATURE
    (tmp_path / "x.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape("x.bin is an HDF5 file, not raw samples")):
        RawSource(tmp_path / "x.bin", dtype="uint8", shape=16)
    # offset= says the caller knows the layout: bytes after a header are read as raw samples
    assert len(RawSource(tmp_path / "x.bin", dtype="uint8", shape=16, offset=16)) == 255


def test_name_with_fields_raises_and_says_the_keys_name_the_fields(tmp_path):
    """name= names the one field of paths=; beside fields= it would name nothing."""
    np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
    spec = {"img": str(tmp_path / "x.npy")}
    with pytest.raises(ValueError) as err:
        RawSource(fields=spec, name="y")
    assert str(err.value) == ("RawSource: name='y' names the one field of paths=; with fields=, each key "
                              "names its field: RawSource(fields={name: files})")
    assert list(RawSource(fields=spec).fields) == ["img"]
    assert list(RawSource(tmp_path / "x.npy", name="y").fields) == ["y"]  # with paths=, it names the field


def test_an_offset_that_applies_to_no_raw_file_raises(tmp_path):
    """offset= skips a raw file's header; .npy files and a manifest know where their data start, so an
    offset that reaches no raw file raises instead of being dropped."""
    from gpufeed import convert_h5_to_raw

    np.save(tmp_path / "x.npy", np.arange(8, dtype=np.float32).reshape(4, 2))
    (tmp_path / "y.bin").write_bytes(bytes(16) + np.arange(4, dtype=np.int64).tobytes())
    npy = str(tmp_path / "x.npy")
    for kwargs in ({"paths": npy}, {"fields": {"x": npy}}, {"fields": {"x": [npy, npy]}}):
        with pytest.raises(ValueError) as err:
            RawSource(**kwargs, offset=16)
        assert str(err.value) == ("RawSource: offset=16 skips a header of raw files, and every file here is "
                                  ".npy, whose header says where its data start; leave offset out")
    with pytest.raises(ValueError) as err:
        RawSource(fields={"x": {"paths": npy, "offset": 16}})
    assert str(err.value) == ("RawSource: field 'x': offset=16 skips a header of raw files, and its files "
                              "are .npy, whose header says where their data start; leave offset out of its "
                              "spec")
    # an offset for the raw files beside .npy ones applies to those
    y = str(tmp_path / "y.bin")
    src = RawSource(fields={"x": npy, "y": {"paths": y, "dtype": "int64"}}, offset=16)
    out = {"x": torch.empty(4, 2), "y": torch.empty(4, dtype=torch.int64)}
    src.read(range(4), out)
    assert out["y"].tolist() == [0, 1, 2, 3] and out["x"].flatten().tolist() == list(range(8))
    assert len(RawSource(fields={"x": npy, "y": {"paths": y, "dtype": "int64", "offset": 16}})) == 4
    # a manifest records its fields' offsets
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"] = np.zeros((4, 2), np.float32)
    manifest = convert_h5_to_raw(str(tmp_path / "a.h5"), str(tmp_path / "a.raw"))
    with pytest.raises(ValueError) as err:
        RawSource(manifest, offset=16)
    assert str(err.value) == (f"RawSource: the manifest {manifest} records each field's name, dtype, shape "
                              "and data offset; do not pass name=, dtype=, shape= or offset= (select fields "
                              "with fields=[...])")
    assert len(RawSource(manifest)) == 4
