"""The GPU part of the reliability suite (``pytest tests/reliability -m cuda`` on the GPU machine).

GDSSource under fault injection and bad input; a stress run with slow consumer kernels on several
prefetchers at once; a run under PyTorch's CUDA sanitizer; batches larger than the pinned budget in
source mode. (Every CPU case of this suite that takes the ``device`` fixture also runs here on CUDA:
fault injection, stress, 50-epoch memory with ``torch.cuda.memory_allocated``/``memory_reserved``, fork.)
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _rel import FaultySource, Injected, OnDisk, check_epoch, checked, keep, note

from conftest import wait_no_threads
from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import RawSource, plan_batches

pytestmark = pytest.mark.cuda

HERE = Path(__file__).resolve().parent
SLEEP = 1_000_000  # cycles of torch.cuda._sleep: about half a millisecond of a busy consumer stream
GDS_KINDS = ["raw", "raw-multi", "manifest", "h5-contiguous", "h5-chunked"]


def digest(t):
    """An exact, order-sensitive checksum of a tensor's bytes, computed where the tensor lives."""
    b = t.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.int64) % 1_000_003
    return (b * w).sum()


# -- GDSSource: faults and bad input ---------------------------------------------------------------

@pytest.fixture(params=GDS_KINDS)
def gds(request, tmp_path):
    pytest.importorskip("kvikio")
    if request.param not in ("raw", "raw-multi"):
        pytest.importorskip("h5py")
    from gpufeed.sources import GDSSource

    disk = OnDisk(request.param, tmp_path)
    return disk, lambda: GDSSource(disk.open())


@pytest.mark.timeout(60)
def test_gds_read_raises_mid_epoch(gds):
    """A GDSSource read raises mid-epoch: the exception reaches the consumer after the batches before it;
    the next epoch is complete."""
    disk, make = gds
    src = FaultySource(make(), fail_row=5 * 16 + 3)
    got = []
    with CudaPrefetcher(SourceLoader(src, batch_size=16), depth=3) as pf:
        with pytest.raises(Injected):
            for b in pf:
                got.append(keep(b))
        check_epoch(got, disk.data, plan_batches(disk.n, 16)[:5])
        check_epoch([keep(b) for b in pf], disk.data, plan_batches(disk.n, 16, epoch=1))
    wait_no_threads()
    note(f"{src.inner.mode} mode: the exception after the 5 batches before it; next epoch complete")


@pytest.mark.timeout(60)
def test_gds_file_truncated_mid_epoch(gds):
    """A file under a GDSSource is truncated mid-epoch: an error (not short data) reaches the consumer."""
    disk, make = gds
    src = make()
    got = []
    with CudaPrefetcher(SourceLoader(src, batch_size=16), depth=2) as pf:
        it = iter(pf)
        got += [keep(next(it)) for _ in range(2)]
        os.truncate(disk.late_file, os.path.getsize(disk.late_file) // 2)
        with pytest.raises((OSError, RuntimeError)) as info:
            for b in it:
                got.append(keep(b))
        check_epoch(got, disk.data, plan_batches(disk.n, 16), complete=False)
        assert len(got) < 15
    wait_no_threads()
    named = str(disk.late_file) in str(info.value)
    note(f"{src.mode} mode: {type(info.value).__name__} after an exact prefix; names the file: {named}")


@pytest.mark.timeout(60)
def test_gds_file_deleted_mid_epoch(gds):
    """A file under a GDSSource is deleted mid-epoch: the open handle keeps it; the epoch is exact."""
    disk, make = gds
    with CudaPrefetcher(SourceLoader(make(), batch_size=16), depth=2) as pf:
        it = iter(pf)
        got = [keep(next(it))]
        os.remove(disk.early_file)
        got += [keep(b) for b in it]
        check_epoch(got, disk.data, plan_batches(disk.n, 16))
    wait_no_threads()
    note("the epoch completes with exact bytes")


@pytest.mark.timeout(60)
def test_gds_ctrl_c_during_next(gds, request):
    """SIGINT while the consumer waits on a slow GDSSource read: KeyboardInterrupt, the threads stop, the
    next epoch is complete."""
    import _thread

    from gpufeed.loaders._reads import READS_AHEAD

    disk, make = gds
    src = FaultySource(make(), block_s=1.0)
    # The ninth next() hands out batch 8 and takes batch 8 + depth (2). Reading to the device ("gds"), that
    # batch's read runs on a reader thread, which the ninth next() waits for; reading to the host
    # ("compat"), it starts the read of the batch READS_AHEAD after it: a small read, on the loop's thread.
    src.block_row = (8 + 2 + (READS_AHEAD if src.reads_to == "host" else 0)) * 16
    with CudaPrefetcher(SourceLoader(src, batch_size=16), depth=2) as pf:
        it = iter(pf)
        [next(it) for _ in range(8)]
        timer = threading.Timer(0.15, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                next(it)
        finally:
            timer.join()
        del it
        src.block_row = None
        check_epoch([keep(b) for b in pf], disk.data, plan_batches(disk.n, 16, epoch=1))
    wait_no_threads()
    note("KeyboardInterrupt; thread stopped; next epoch complete")


@pytest.mark.timeout(60)
def test_gds_bad_input(tmp_path):
    """GDSSource over what it cannot read by offset (gzip HDF5), a missing file, rows out of range."""
    pytest.importorskip("kvikio")
    h5py = pytest.importorskip("h5py")
    from gpufeed.sources import GDSSource

    with h5py.File(tmp_path / "z.h5", "w") as f:
        f.create_dataset("x", data=np.zeros((40, 6), np.float32), chunks=(4, 6), compression="gzip")
    fix = r"z\.h5 cannot be read by byte offset.*use H5Source.*convert_h5_to_raw"
    with pytest.raises(ValueError, match=fix):
        GDSSource(tmp_path / "z.h5", fields=["x"])
    with pytest.raises(FileNotFoundError, match=r"nope\.npy"):
        GDSSource(tmp_path / "nope.npy")
    np.save(tmp_path / "x.npy", np.zeros((40, 6), np.float32))
    src = GDSSource(tmp_path / "x.npy")
    dev = "cuda" if src.reads_to == "device" else "cpu"
    with pytest.raises(IndexError, match=r"GDSSource\(x\.npy\): row 40 is out of range for 40 samples"):
        src.read(np.array([3, 40]), {"x": torch.empty(2, 6, device=dev)})
    src.close()
    note("ValueError naming the file and the fix; FileNotFoundError naming the file; IndexError naming it")


# -- stress with slow consumer kernels -------------------------------------------------------------

DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.bool]


def random_batch(rng, g):
    """A dict/list/tuple batch of random dtypes and shapes; host pageable, host pinned or already on CUDA."""
    def leaf():
        dtype = rng.choice(DTYPES)
        shape = tuple(rng.randint(0, 40) for _ in range(rng.randint(1, 3)))
        if dtype is torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            t = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).view(shape)
        where = rng.random()
        if t.dim() >= 2 and rng.random() < 0.2:
            t = t.transpose(0, 1)
        if where < 0.2:
            return t.pin_memory()
        if where < 0.3:
            return t.cuda()
        return t
    return {"a": leaf(), "b": [leaf(), (leaf(), leaf())], "c": {"d": leaf()}}


def leaves(batch):
    return [batch["a"], batch["b"][0], batch["b"][1][0], batch["b"][1][1], batch["c"]["d"]]


@pytest.mark.timeout(300)
def test_stress_slow_consumer_kernels_many_prefetchers():
    """3 prefetchers at once (one thread and one side stream each), 2 epochs of 150 random batches,
    depth 1..4, a consumer kernel (torch.cuda._sleep) before reading each batch, digests on the GPU."""
    errors, counted = [], []

    def run(k):
        try:
            rng, g = random.Random(k), torch.Generator().manual_seed(k)
            data = [random_batch(rng, g) for _ in range(150)]
            want = [[int(digest(t.cpu())) for t in leaves(b)] for b in data]
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), CudaPrefetcher(data, depth=1 + k % 4) as pf:
                for _ in range(2):
                    got = []
                    for b in pf:
                        torch.cuda._sleep(SLEEP * rng.randint(0, 2))
                        got.append(torch.stack([digest(t) for t in leaves(b)]))
                        del b  # freed at once: the allocator must not reuse it under the digest kernels
                    got = [g.tolist() for g in got]
                    bad = sum(a != b for a, b in zip(got, want, strict=True))
                    counted.append((len(got), bad))
                    if bad:
                        errors.append(f"prefetcher {k}: {bad} batches differ")
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads)
    checked(sum(c[0] for c in counted), sum(c[1] for c in counted))
    assert not errors, errors
    note("every digest equal under slow consumer kernels, 3 prefetchers and side streams at once")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["raw", "h5-chunked", "h5-gzip"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_stress_source_slow_consumer(kind, depth, tmp_path):
    """A source through a pinned pool of two batches' buffers under a slow consumer (each read waits for a
    buffer whose copy, queued behind the consumer's kernels, completed): shuffled, 3 epochs, exact."""
    if kind != "raw":
        pytest.importorskip("h5py")
    disk = OnDisk(kind, tmp_path, n=960)
    loader = SourceLoader(disk.open(), batch_size=32, shuffle=True, pinned_budget=8192)  # batches of 1.7 KB
    with CudaPrefetcher(loader, depth=depth) as pf:
        for epoch in range(3):
            got = []
            for b in pf:
                torch.cuda._sleep(SLEEP)
                got.append(keep(b))
            check_epoch(got, disk.data, plan_batches(disk.n, 32, shuffle=True, epoch=epoch))
        assert loader._pool.allocated == 8192 and loader._pool.allocations == 2  # two 4 KiB buffers, reused
    wait_no_threads()
    assert loader._pool.allocated == 0  # close() freed them
    note("every byte equal under a slow consumer, 3 shuffled epochs, through two pinned buffers")


@pytest.mark.timeout(600)
def test_cuda_sanitizer_reports_no_race():
    """The hand-over under TORCH_CUDA_SANITIZER=1 (in a subprocess): no "CSAN detected a possible data
    race" on stderr, and the workload's own checks pass."""
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "_rel_csan_workload.py")], capture_output=True,
                          text=True, timeout=540, env=env)
    assert "CSAN detected a possible data race" not in proc.stderr, proc.stderr[-8000:]
    assert proc.returncode == 0 and "CSAN OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-8000:]
    note("no race reported by CSAN; the workload's checks pass")


# -- limits ------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("row_mib", [1, 4])
def test_source_batch_larger_than_the_pinned_budget(row_mib, tmp_path):
    """Source mode with a 2 MiB pinned budget: 8 MiB batches of 1 MiB rows, and of 4 MiB rows (one row
    larger than the whole budget). Each batch is read whole into one buffer of its size, one buffer at a
    time: exact bytes; the pool holds that one 8 MiB buffer, reused for every batch.
    (The loader-mode case: test_cuda.py::test_a_leaf_larger_than_a_chunk_is_staged_chunk_by_chunk_exactly.)
    """
    row = row_mib << 20
    x = np.random.default_rng(row_mib).integers(0, 256, (24, row), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    loader = SourceLoader(RawSource(tmp_path / "x.npy"), batch_size=8 // row_mib, pinned_budget=2 << 20)
    with CudaPrefetcher(loader, depth=2) as pf:
        got = [b["x"].cpu() for b in pf]
        assert loader._pool.allocated == 8 << 20 and loader._pool.allocations == 1
    assert torch.equal(torch.cat(got), torch.from_numpy(x))
    checked(len(got), 0, x.nbytes)
    note("exact; the pool held one 8 MiB buffer (one batch) over a 2 MiB budget, reused for every batch")


@pytest.mark.timeout(120)
def test_source_pinned_budget_zero_falls_back_with_one_warning(tmp_path):
    """SourceLoader(pinned_budget=0): reads into pageable memory, exactly one RuntimeWarning over two
    epochs, nothing in the pool, exact bytes (regression: finding 6)."""
    import warnings

    disk = OnDisk("raw", tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = SourceLoader(disk.open(), batch_size=16, pinned_budget=0)
        with CudaPrefetcher(loader) as pf:
            for epoch in range(2):
                check_epoch([keep(b) for b in pf], disk.data, plan_batches(disk.n, 16, epoch=epoch))
            assert loader._pool.allocated == 0 and loader._pool.allocations == 0
    said = [w for w in caught if "pinned_budget is 0" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    note("exact; one warning; no pinned memory in the pool")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["loader", "source"])
def test_pinned_allocation_failure_falls_back_with_one_warning(mode, tmp_path, monkeypatch):
    """Every pinned allocation fails (simulated cudaHostAlloc error): pageable copies, one warning, exact
    bytes, in both modes (regression: finding 5)."""
    import warnings

    real = torch.empty

    def empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (simulated cudaHostAlloc failure)")
        return real(*args, **kwargs)

    def pin_memory(self, *args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (simulated cudaHostAlloc failure)")

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    disk = OnDisk("raw", tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mode == "source":
            with CudaPrefetcher(SourceLoader(disk.open(), batch_size=16)) as pf:
                check_epoch([keep(b) for b in pf], disk.data, plan_batches(disk.n, 16))
        else:
            data = [{k: torch.from_numpy(v[i : i + 16]) for k, v in disk.data.items()}
                    for i in range(0, disk.n, 16)]
            with CudaPrefetcher(data) as pf:
                check_epoch([keep(b) for b in pf], disk.data, plan_batches(disk.n, 16))
    said = [w for w in caught if "pinned allocation failed" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    note("exact; one warning 'pinned allocation failed'")
