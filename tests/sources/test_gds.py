"""GDSSource: argument checks run everywhere; reads need a GPU and kvikio (-m cuda on the GPU machine)."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch

from gpufeed.sources import GDSSource, RawSource
from gpufeed.testing import SourceContract

needs_gpu = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GDSSource reads need a CUDA GPU"),
]


def _kvikio():
    """kvikio's settings module (``import kvikio`` does not load it); skips where kvikio is missing."""
    pytest.importorskip("kvikio", reason="kvikio is not installed (pip install 'gpufeed[gds]')")
    return pytest.importorskip("kvikio.defaults")


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 3, 7), dtype=np.uint8)


# ---- everywhere ------------------------------------------------------------------------------------------


def test_missing_kvikio_names_the_extra(tmp_path, monkeypatch):
    np.save(tmp_path / "x.npy", _images(4))
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import kvikio now raises ImportError
    with pytest.raises(ImportError, match=r"GDSSource needs kvikio.*pip install 'gpufeed\[gds\]'"):
        GDSSource(tmp_path / "x.npy")


def test_compressed_hdf5_is_rejected_before_kvikio_loads(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "z.h5", "w") as f:
        f.create_dataset("x", data=_images(10), chunks=True, compression="gzip")
    monkeypatch.setitem(sys.modules, "kvikio", None)
    with pytest.raises(
        ValueError, match=r"field 'x' in .*z.h5 cannot be read by byte offset.*deflate.*convert_h5_to_raw"
    ):
        GDSSource(tmp_path / "z.h5", fields=["x"])


def test_bad_arguments(tmp_path):
    np.save(tmp_path / "x.npy", _images(4))
    with pytest.raises(ValueError, match="mode must be"):
        GDSSource(tmp_path / "x.npy", mode="fast")
    with pytest.raises(ValueError, match="num_threads"):
        GDSSource(tmp_path / "x.npy", num_threads=0)
    with pytest.raises(ValueError, match="extra arguments"):
        GDSSource(RawSource(tmp_path / "x.npy"), "float32")
    with pytest.raises(ValueError, match="mmap_gather must be True, False or None"):
        GDSSource(tmp_path / "x.npy", mmap_gather="yes")


def test_mmap_gather_does_not_apply_to_reads_into_device_memory(tmp_path):
    np.save(tmp_path / "x.npy", _images(4))
    with pytest.raises(ValueError, match=r"mmap_gather applies to reads into host memory.*mode='compat'"):
        GDSSource(tmp_path / "x.npy", mode="gds", mmap_gather=True)
    with pytest.raises(ValueError, match=r"mmap_gather applies"):  # the setting of the source given
        GDSSource(RawSource(tmp_path / "x.npy", mmap_gather=True), mode="gds")


# ---- on the GPU machine ------------------------------------------------------------------------------


class _GDSContract(SourceContract):
    pytestmark = needs_gpu


class TestGDSNpy(_GDSContract):
    """1 KiB rows and 2 KiB kvikio tasks: single rows take os.preadv (compat), longer runs kvikio."""

    def make_source(self, tmp_path):
        _kvikio()
        x = np.random.default_rng(7).integers(0, 256, size=(61, 8, 128), dtype=np.uint8)
        np.save(tmp_path / "x.npy", x)
        return GDSSource(tmp_path / "x.npy", task_size=2048), {"x": x}


class TestGDSRawManyFilesTwoFields(_GDSContract):
    def make_source(self, tmp_path):
        _kvikio()
        x, y = _images(40, 1), np.arange(40, dtype=np.int64) * 3
        x[:25].tofile(tmp_path / "a.bin")
        x[25:].tofile(tmp_path / "b.bin")
        np.save(tmp_path / "y.npy", y)
        src = GDSSource(
            None,
            fields={
                "x": {"paths": [tmp_path / "a.bin", tmp_path / "b.bin"], "dtype": "uint8", "shape": (3, 7)},
                "y": tmp_path / "y.npy",
            },
        )
        return src, {"x": x, "y": y}


class TestGDSManifest(_GDSContract):
    def make_source(self, tmp_path):
        _kvikio()
        h5py = pytest.importorskip("h5py")
        from gpufeed.convert import convert_h5_to_raw

        x = _images(33, 2)
        with h5py.File(tmp_path / "in.h5", "w") as f:
            f.create_dataset("x", data=x, chunks=True, compression="gzip")
        return GDSSource(convert_h5_to_raw(tmp_path / "in.h5", tmp_path / "raw")), {"x": x}


class TestGDSH5ContiguousAndChunked(_GDSContract):
    def make_source(self, tmp_path):
        _kvikio()
        h5py = pytest.importorskip("h5py")
        x, w = _images(45, 3), np.random.default_rng(3).standard_normal((45, 5)).astype(np.float32)
        with h5py.File(tmp_path / "a.h5", "w") as f:
            f.create_dataset("x", data=x)
            f.create_dataset("w", data=w, chunks=(4, 5))
        return GDSSource(tmp_path / "a.h5", fields=["x", "w"]), {"x": x, "w": w}


class TestGDSForcedCompat(_GDSContract):
    def make_source(self, tmp_path):
        _kvikio()
        x = _images(29, 4)
        np.save(tmp_path / "x.npy", x)
        src = GDSSource(RawSource(tmp_path / "x.npy"), mode="compat")
        assert src.mode == "compat" and src.reads_to == "host"
        return src, {"x": x}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestGDSOnGPU:
    def test_mode_matches_kvikio_and_threads_are_many(self, tmp_path):
        defaults = _kvikio()
        np.save(tmp_path / "x.npy", _images(8))
        src = GDSSource(tmp_path / "x.npy")
        compat = defaults.is_compat_mode_preferred()
        assert src.mode == ("compat" if compat else "gds")
        assert src.reads_to == ("host" if compat else "device")
        assert src.num_threads > 1 and defaults.get("num_threads") > 1
        assert src.mode in src.describe()
        print(src.describe())

    def test_mode_gds_raises_where_gds_is_unavailable(self, tmp_path):
        defaults = _kvikio()
        if not defaults.is_compat_mode_preferred():
            pytest.skip("GDS is available here")
        np.save(tmp_path / "x.npy", _images(8))
        with pytest.raises(RuntimeError, match="GPUDirect Storage is not available"):
            GDSSource(tmp_path / "x.npy", mode="gds")

    @pytest.mark.parametrize("task_size", [256, None])  # through kvikio, and through os.preadv (compat)
    def test_file_truncated_after_opening_is_a_short_read(self, tmp_path, task_size):
        _kvikio()
        x = _images(100)
        np.save(tmp_path / "x.npy", x)
        src = GDSSource(tmp_path / "x.npy", task_size=task_size)
        out = SourceContract.empty_out(src, 100)
        src.read(range(100), out)
        os.truncate(tmp_path / "x.npy", os.path.getsize(tmp_path / "x.npy") - 50)
        with pytest.raises(OSError, match=r"x.npy.*(truncated|EOF)"):
            src.read(range(100), SourceContract.empty_out(src, 100))

    def test_large_read_from_a_fresh_thread_into_pinned_or_device_memory(self, tmp_path):
        _kvikio()
        x = np.random.default_rng(0).integers(0, 256, size=(64, 1 << 16), dtype=np.uint8)  # 4 MiB
        np.save(tmp_path / "x.npy", x)
        src = GDSSource(tmp_path / "x.npy", task_size=1 << 20)
        out = SourceContract.empty_out(src, 64)
        errors = []

        def work():
            try:
                src.read(range(64), out)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=work)
        t.start()
        t.join(60)
        assert not errors, errors
        torch.cuda.synchronize()
        assert np.array_equal(out["x"].cpu().numpy(), x)
