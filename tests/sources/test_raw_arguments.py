"""RawSource's constructor errors point at the argument or the source the user needs."""

from __future__ import annotations

import re

import numpy as np
import pytest

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
