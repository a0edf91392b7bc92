"""convert_h5_to_raw: round trip through RawSource, alignment, caching, reconversion, bounded chunks."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

h5py = pytest.importorskip("h5py")

from gpufeed.convert import convert_h5_to_raw  # noqa: E402
from gpufeed.sources import RawSource  # noqa: E402
from gpufeed.testing import SourceContract  # noqa: E402


def _data(n: int = 37) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "x": rng.integers(0, 256, size=(n, 2, 3), dtype=np.uint8),
        "grp/y": rng.integers(0, 10, size=n).astype(np.int64),
        "w": rng.standard_normal((n, 3)).astype(np.float32),
    }


def _file(folder, field):
    """The data file of ``field`` that the manifest in ``folder`` names."""
    return folder / json.loads((folder / "manifest.json").read_text())["fields"][field]["file"]


def _h5(path, data, big_endian_w=False, gzip=False):
    with h5py.File(path, "w") as f:
        for name, arr in data.items():
            if big_endian_w and name == "w":
                arr = arr.astype(">f4")
            kw = {"chunks": True, "compression": "gzip"} if gzip else {}
            f.create_dataset(name, data=arr, **kw)


class TestRawFromManifest(SourceContract):
    """The converter's output, read back (gzip and big-endian sources, small chunks to stream)."""

    def make_source(self, tmp_path):
        data = _data()
        _h5(tmp_path / "in.h5", data, big_endian_w=True, gzip=True)
        manifest = convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", chunk_bytes=50)
        return RawSource.from_manifest(manifest), data


def test_manifest_contents_and_alignment(tmp_path):
    data = _data()
    _h5(tmp_path / "in.h5", data)
    manifest = convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", align=512)
    assert manifest == tmp_path / "raw" / "manifest.json"
    doc = json.loads(manifest.read_text())
    assert doc["format"] == "gpufeed.raw" and doc["version"] == 2 and doc["num_samples"] == 37
    assert doc["source"]["path"] == str((tmp_path / "in.h5").resolve())
    assert doc["source"]["size"] == os.path.getsize(tmp_path / "in.h5")
    y = doc["fields"]["grp/y"]
    gen = re.fullmatch(r"grp__y\.gen-([0-9a-f]{12})\.bin", y["file"]).group(1)
    assert y == {
        "file": f"grp__y.gen-{gen}.bin",
        "dtype": "<i8",
        "shape": [],
        "num_samples": 37,
        "offset": 0,
        "file_size": 512,
    }
    for spec in doc["fields"].values():
        assert spec["offset"] % 512 == 0
        assert os.path.getsize(tmp_path / "raw" / spec["file"]) == spec["file_size"]
        assert spec["file_size"] % 512 == 0
    assert sorted(os.listdir(tmp_path / "raw")) == [".gpufeed-convert.lock", f"grp__y.gen-{gen}.bin",
                                                    "manifest.json", f"w.gen-{gen}.bin", f"x.gen-{gen}.bin"]


def test_passing_the_manifest_path_or_directory_to_raw_source(tmp_path):
    data = _data()
    _h5(tmp_path / "in.h5", data)
    manifest = convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", fields=["x"])
    for arg in (manifest, str(manifest), tmp_path / "raw"):
        src = RawSource(arg)
        assert list(src.fields) == ["x"] and len(src) == 37


def test_rerun_with_unchanged_source_does_nothing(tmp_path):
    _h5(tmp_path / "in.h5", _data())
    manifest = convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    before = {p: os.stat(tmp_path / "raw" / p).st_mtime_ns for p in os.listdir(tmp_path / "raw")}
    os.utime(_file(tmp_path / "raw", "x"), ns=(1, 1))  # a rewrite would change this again
    before[_file(tmp_path / "raw", "x").name] = 1
    assert convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw") == manifest
    after = {p: os.stat(tmp_path / "raw" / p).st_mtime_ns for p in os.listdir(tmp_path / "raw")}
    assert after == before


def test_changed_source_is_reconverted(tmp_path):
    _h5(tmp_path / "in.h5", _data())
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    new = _data(50)
    new["x"][:] = 9
    _h5(tmp_path / "in.h5", new)
    st = os.stat(tmp_path / "in.h5")
    os.utime(tmp_path / "in.h5", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse mtime clocks
    src = RawSource(convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw"))
    assert len(src) == 50
    out = {name: SourceContract.empty_out(src, 50)[name] for name in src.fields}
    src.read(range(50), out)
    assert (out["x"].numpy() == 9).all()


def test_changed_fields_are_reconverted(tmp_path):
    _h5(tmp_path / "in.h5", _data())
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", fields=["x"])
    src = RawSource(convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", fields=["x", "w"]))
    assert sorted(src.fields) == ["w", "x"]


def test_damaged_output_is_reconverted(tmp_path):
    _h5(tmp_path / "in.h5", _data())
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    with open(_file(tmp_path / "raw", "w"), "r+b") as fh:
        fh.truncate(10)
    assert len(RawSource(convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw"))) == 37


def test_streams_in_bounded_chunks(tmp_path, monkeypatch):
    # Every read_direct the converter makes stays within chunk_bytes (rounded to whole rows).
    data = {"x": np.arange(4000, dtype=np.float32).reshape(1000, 4)}
    _h5(tmp_path / "in.h5", data)
    sizes = []
    real = h5py.Dataset.read_direct

    def spy(self, dest, source_sel=None, dest_sel=None):
        sizes.append(dest.nbytes)
        return real(self, dest, source_sel, dest_sel)

    monkeypatch.setattr(h5py.Dataset, "read_direct", spy)
    src = RawSource(convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", chunk_bytes=1600))
    assert sizes and max(sizes) <= 1600 and len(sizes) == 10
    out = {"x": SourceContract.empty_out(src, 1000)["x"]}
    src.read(range(1000), out)
    assert np.array_equal(out["x"].numpy(), data["x"])


def test_no_temporary_files_left_and_manifest_is_written_last(tmp_path):
    _h5(tmp_path / "in.h5", _data())
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    assert not [p for p in os.listdir(tmp_path / "raw") if "tmp" in p]


def test_unsupported_datasets_are_skipped_and_named_and_a_named_one_raises_writing_nothing(tmp_path):
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"] = np.arange(10, dtype=np.float32).reshape(5, 2)
        f["s"] = np.array(["a", "b", "c", "d", "e"], dtype=h5py.string_dtype())
    with pytest.warns(RuntimeWarning, match=r"skipped \['s'\], not converted as fields: 's': .*strings.*kept "
                      r"in the manifest's metadata: \['s'\]"):
        manifest = convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    doc = json.loads(manifest.read_text())
    assert list(doc["fields"]) == ["x"] and list(doc["skipped"]) == ["s"]
    out = {"x": torch.empty(5, 2)}
    RawSource(manifest).read(range(5), out)
    assert torch.equal(out["x"], torch.arange(10.0).view(5, 2))
    with pytest.raises(ValueError, match=r"strings"):  # named: an error, and no folder left behind
        convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "named", fields=["x", "s"])
    assert not (tmp_path / "named").exists()
    with h5py.File(tmp_path / "strings.h5", "w") as f:
        f["s"] = np.array(["a", "b"], dtype=h5py.string_dtype())
    with pytest.raises(ValueError, match=r"no dataset can become raw samples"):
        convert_h5_to_raw(tmp_path / "strings.h5", tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_bad_arguments(tmp_path):
    _h5(tmp_path / "in.h5", _data())
    with pytest.raises(ValueError, match=r"power of two"):
        convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", align=1000)
    with pytest.raises(FileNotFoundError, match=r"nope.h5"):
        convert_h5_to_raw(tmp_path / "nope.h5", tmp_path / "raw")


def test_a_conversion_failing_part_way_leaves_the_earlier_one_in_its_folder_as_it_was(tmp_path, monkeypatch):
    """Into a folder that holds a conversion, a conversion that fails after its first field writes nothing:
    the earlier manifest and files are intact, and no temporary file is left."""
    _h5(tmp_path / "in.h5", _data())
    manifest = convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    before = {p: (tmp_path / "raw" / p).read_bytes() for p in os.listdir(tmp_path / "raw")}
    data = {k: v[::-1].copy() for k, v in _data().items()}  # new contents, same shapes
    _h5(tmp_path / "in.h5", data)
    st = os.stat(tmp_path / "in.h5")
    os.utime(tmp_path / "in.h5", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed, whatever the clock
    real, calls = h5py.Dataset.read_direct, []

    def fail_on_the_second_field(self, *a, **k):
        calls.append(self.name)
        if len({c for c in calls}) > 1:
            raise OSError("disk gone")
        return real(self, *a, **k)

    monkeypatch.setattr(h5py.Dataset, "read_direct", fail_on_the_second_field)
    with pytest.raises(OSError, match="disk gone"):
        convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    after = {p: (tmp_path / "raw" / p).read_bytes() for p in os.listdir(tmp_path / "raw")}
    assert after == before and len(set(calls)) == 2
    monkeypatch.undo()
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")  # and the next one replaces it whole
    got = RawSource(manifest)
    out = {k: torch.empty((len(got), *f.shape), dtype=f.dtype) for k, f in got.fields.items()}
    got.read(range(len(got)), out)
    assert all(np.array_equal(out[k].numpy(), data[k]) for k in out)


def test_a_rename_that_fails_leaves_the_earlier_conversion_and_no_temporary_file(tmp_path, monkeypatch):
    """The one rename that switches generations fails: the earlier manifest and files stay, readable as
    they were, the error names the manifest and the folder, and nothing of the new generation is left."""
    _h5(tmp_path / "in.h5", _data())
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    before = {p: (tmp_path / "raw" / p).read_bytes() for p in os.listdir(tmp_path / "raw")}
    _h5(tmp_path / "in.h5", {k: v[::-1].copy() for k, v in _data().items()})
    st = os.stat(tmp_path / "in.h5")
    os.utime(tmp_path / "in.h5", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    def fails(a, b):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", fails)
    with pytest.raises(PermissionError, match=rf"renaming .*manifest.json.*the earlier conversion in "
                       rf"{re.escape(str(tmp_path / 'raw'))} is unchanged"):
        convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    monkeypatch.undo()
    after = {p: (tmp_path / "raw" / p).read_bytes() for p in os.listdir(tmp_path / "raw")}
    assert after == before
    src = RawSource(tmp_path / "raw")
    out = {"x": torch.empty(37, 2, 3, dtype=torch.uint8)}
    RawSource(tmp_path / "raw", fields=["x"]).read(range(37), out)
    assert np.array_equal(out["x"].numpy(), _data()["x"]) and len(src) == 37


def test_a_converted_file_read_directly_returns_no_padding_rows(tmp_path):
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["x"] = np.arange(16, dtype=np.float32).reshape(8, 2)  # 64 bytes, padded to 4096: 504 rows of zeros
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "unpadded")
    assert os.path.getsize(_file(tmp_path / "unpadded", "x")) == 64  # by default a file holds its data only
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw", align=4096)
    x_bin = _file(tmp_path / "raw", "x")
    assert os.path.getsize(x_bin) == 4096
    src = RawSource(x_bin, dtype="float32", shape=(2,))
    assert len(src) == 8
    out = {"x": torch.empty(8, 2)}
    src.read(range(8), out)
    assert torch.equal(out["x"], torch.arange(16.0).view(8, 2))
    as_bytes = RawSource(x_bin, dtype="uint8", shape=())  # the same 64 bytes, by byte
    assert len(as_bytes) == 64
    with pytest.raises(ValueError, match="64 bytes of data"):
        RawSource(x_bin, dtype="float32", shape=(3,))  # 12-byte samples do not fit
    with open(x_bin, "ab") as fh:  # no longer the file the manifest describes
        fh.write(bytes(4096))
    assert len(RawSource(x_bin, dtype="float32", shape=(2,))) == 1024


def test_raw_source_selects_and_renames_the_fields_of_a_manifest_as_h5source_does(tmp_path):
    _h5(tmp_path / "in.h5", _data())
    manifest = convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")
    every = RawSource(manifest)
    first = next(iter(every.fields))
    assert list(RawSource(manifest, fields=[first]).fields) == [first]
    renamed = RawSource(manifest, fields={"a": first})
    assert list(renamed.fields) == ["a"] and renamed.fields["a"].shape == every.fields[first].shape
    with pytest.raises(ValueError, match=r"has no field \['nope'\]; its fields are: "):
        RawSource(manifest, fields=["nope"])
    with pytest.raises(ValueError, match=r"do not pass name=, dtype=, shape= or offset="):
        RawSource(manifest, name="y")


def test_progress_shows_bytes_rate_and_time_left_only_when_asked(tmp_path, capsys):
    _h5(tmp_path / "in.h5", _data())
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "quiet", chunk_bytes=1024)
    assert capsys.readouterr().err == ""  # not a terminal: quiet
    convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "shown", chunk_bytes=1024, progress=True)
    err = capsys.readouterr().err
    assert err.startswith("\r  ") and " MiB/s, " in err and err.rstrip().endswith("s left")
    assert err.endswith("\n")
