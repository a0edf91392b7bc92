"""Memory and resources over many epochs: process RSS, Python objects, gpufeed's host buffers (a
SourceLoader's pinned pool or CPU buffers, torch's pinned blocks that staging takes), threads, file
descriptors and (on the GPU machine) CUDA memory stay flat after the first epochs.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch
from _rel import KINDS, OnDisk, check_epoch, checked, keep, note, open_fds, rss_bytes

from conftest import wait_no_threads
from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.host_memory.pinned_pool import PinnedPool
from gpufeed.sources import plan_batches

MiB = 1 << 20
EPOCHS = 50
WARM = 5  # epochs before the baseline: allocator pools, lazy imports, h5py caches settle


def _needs(kind):
    if kind not in ("raw", "raw-multi"):
        pytest.importorskip("h5py")


def _host_buffers(pf, device):
    """``(bytes, buffers)`` of the host memory gpufeed keeps for reuse: a SourceLoader's pinned pool (CUDA)
    or its reused CPU buffers (CPU); for any other loader, the pinned blocks of torch's caching host
    allocator, which staging takes (CUDA)."""
    loader = pf.source
    if isinstance(loader, SourceLoader):
        if loader._pool is not None:
            return loader._pool.allocated, loader._pool.allocations
        slots = loader._cpu._all
        return sum(a.nbytes for s in slots for a in s.arrays.values()), len(slots)
    if device.type == "cuda":
        stats = torch.cuda.host_memory_stats()
        return stats.get("allocated_bytes.current", 0), stats.get("allocations.current", 0)
    return 0, 0


class Marks:
    """Resource readings after epoch ``WARM`` and every fifth epoch after it (a GC pass first: leaks are
    what survives a collection)."""

    def __init__(self, pf, device):
        self.pf, self.device, self.rows, self.epoch = pf, device, [], 0

    def take(self):
        self.epoch += 1
        if self.epoch < WARM or (self.epoch - WARM) % 5:
            return
        gc.collect()
        cuda = (0, 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            cuda = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
        pool, buffers = _host_buffers(self.pf, self.device)
        # A SourceLoader's reader pool starts its threads on demand, up to num_threads: count them apart.
        fill = sum(t.name.startswith("gpufeed-read") for t in threading.enumerate())
        assert fill <= getattr(self.pf.source, "num_threads", 0), fill
        self.rows.append({"rss": rss_bytes(), "objects": len(gc.get_objects()), "pool": pool,
                          "buffers": buffers, "fds": len(open_fds()),
                          "threads": threading.active_count() - fill, "cuda": cuda})

    def check(self, rss_slack=5 * MiB, objects_slack=300):
        assert self.epoch == EPOCHS and len(self.rows) == 1 + (EPOCHS - WARM) // 5
        a, b = self.rows[0], self.rows[-1]
        # RSS readings jitter by about 2.5 MiB (glibc arenas of each epoch's new threads; a 2-core CI
        # machine once read +5.04 MiB with no trend): compare the medians of the first and last three
        # readings (epochs 5-15 and 40-50), which a leak growing with the epochs still moves.
        rss = [r["rss"] for r in self.rows]
        growth = sorted(rss[-3:])[1] - sorted(rss[:3])[1]
        assert growth < rss_slack, f"RSS grew {growth / MiB:.1f} MiB (epochs {WARM}-15 to 40-{EPOCHS}): {rss}"
        assert b["objects"] - a["objects"] < objects_slack, (a["objects"], b["objects"])
        for key in ("pool", "buffers", "fds", "threads", "cuda"):
            assert len({r[key] for r in self.rows}) == 1, (key, [r[key] for r in self.rows])
        return growth


def fresh_batches(n, rows=4096, seed=0):
    """A loader that allocates new tensors for every batch (about 260 KiB each), as a DataLoader does."""
    def gen():
        g = torch.Generator().manual_seed(seed)
        for i in range(n):
            yield {"x": torch.randn(rows, 15, generator=g), "y": torch.randint(0, 9, (rows,), generator=g),
                   "i": i}
    return gen


@pytest.mark.timeout(90)
def test_loader_50_epochs_flat(device):
    """50 epochs of a loader with fresh tensors: RSS, objects, pinned blocks, threads, fds (and CUDA memory)
    flat."""
    loader = fresh_batches(8)
    with CudaPrefetcher(loader, device=device, depth=3) as pf:
        marks = Marks(pf, device)
        # Exact integer checksums: a float sum differs between the CPU and the GPU in its last bits.
        expected = [b["x"].view(torch.int32).to(torch.int64).sum().item() for b in loader()]
        for _ in range(EPOCHS):
            sums = [b["x"].view(torch.int32).to(torch.int64).sum().item() for b in pf]
            assert sums == expected
            checked(len(sums))
            del sums
            marks.take()
        growth = marks.check()
    wait_no_threads()
    note(f"{EPOCHS} epochs: RSS +{growth / MiB:.2f} MiB (median of epochs {WARM}-15 to 40-{EPOCHS}); "
         "objects, pool, threads, descriptors (and CUDA memory) unchanged")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["raw", "h5-contiguous", "h5-gzip"])
def test_source_50_epochs_flat(kind, device, tmp_path):
    """50 shuffled epochs of a source: RSS, objects, the loader's buffers (pinned pool on CUDA, CPU buffers
    on the CPU), threads, fds (and CUDA memory) flat."""
    _needs(kind)
    disk = OnDisk(kind, tmp_path)
    shuffle = "blocks" if kind == "h5-gzip" else True  # random rows through h5py cost 10 ms a batch
    with CudaPrefetcher(SourceLoader(disk.open(), batch_size=40, shuffle=shuffle),
                        device=device, depth=2) as pf:
        marks = Marks(pf, device)
        for epoch in range(EPOCHS):
            got = [keep(b) for b in pf]
            check_epoch(got, disk.data, plan_batches(disk.n, 40, shuffle=shuffle, epoch=epoch))
            del got
            marks.take()
        growth = marks.check()
    wait_no_threads()
    note(f"{EPOCHS} shuffled epochs: RSS +{growth / MiB:.2f} MiB (median of epochs {WARM}-15 to "
         f"40-{EPOCHS}); objects, buffers, threads, descriptors (and CUDA memory) unchanged")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_open_close_leaks_no_descriptor(kind, tmp_path):
    """Sources and prefetchers opened and closed 15 times (full epochs and ``break``, then ``close()`` of
    both; or both dropped without ``close`` and collected): the process holds the same file descriptors
    before and after. (A prefetcher leaves its source open: the source is the user's.)"""
    _needs(kind)
    disk = OnDisk(kind, tmp_path)

    def round_trip(i):
        src = disk.open()
        pf = CudaPrefetcher(SourceLoader(src, batch_size=16, shuffle=bool(i % 2)), device="cpu")
        if i % 3 == 0:
            list(pf)
            pf.close()
            src.close()
        elif i % 3 == 1:
            for k, _ in enumerate(pf):
                if k == 2:
                    break
            pf.close()
            src.close()
        else:  # never closed: garbage collection must release everything
            next(iter(pf))
            del pf, src
            gc.collect()
        wait_no_threads()

    round_trip(0)  # warm-up: lazy imports, h5py's library state
    gc.collect()
    before = sorted(open_fds())
    for i in range(15):
        round_trip(i)
    after = sorted(open_fds())
    assert after == before, sorted(set(after) ^ set(before))
    note(f"{len(before)} descriptors before and after 15 open/iterate/close rounds (full, break, GC only)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["raw-multi", "h5-gzip"])
def test_dropped_source_releases_its_descriptors_without_gc(kind, tmp_path):
    """With the garbage collector off: after an epoch (complete, or left with ``break``), closing the
    prefetcher and dropping the source closes the source's files at once; nothing keeps them in a
    reference cycle (regression: finding 7)."""
    _needs(kind)
    disk = OnDisk(kind, tmp_path)
    gc.collect()
    before = sorted(open_fds())
    gc.disable()
    try:
        for stop_early in (False, True):
            src = disk.open()
            pf = CudaPrefetcher(SourceLoader(src, batch_size=16, shuffle=True), device="cpu")
            for k, _ in enumerate(pf):
                if stop_early and k == 2:
                    break
            pf.close()
            del pf, src
            wait_no_threads()
            assert sorted(open_fds()) == before, "descriptors stay open until a GC pass"
    finally:
        gc.enable()
    note("every descriptor closed at once, with the GC disabled")


@pytest.mark.timeout(60)
def test_pinned_pool_flat_over_50_rounds():
    """The pool (host memory standing in for pinned) under 50 rounds of random requests: allocations stop
    after the first rounds, its size never exceeds the budget, every buffer comes back."""
    rng = np.random.default_rng(0)
    budget = 256 << 10
    pool = PinnedPool(budget, pin=False)
    stop = threading.Event()
    sizes = [int(s) for s in rng.integers(1, 64 << 10, size=8)]
    seen = []
    for _ in range(50):
        held = []
        for size in sizes:  # as an epoch's reads take buffers: wait for one only when it holds none
            buf = pool.acquire(size, stop) if not held else pool.try_acquire(size)
            if buf is None:
                pool.release(held.pop(0), None)
                buf = pool.acquire(size, stop)
            buf.tensor[:size].fill_(size % 251)
            assert buf.nbytes >= size
            held.append(buf)
            assert pool.allocated <= budget
        for buf in held:
            pool.release(buf, None)
        checked(len(sizes), 0, sum(sizes))
        seen.append((pool.allocated, pool.allocations))
    assert len(set(seen[WARM - 1 :])) == 1, seen
    assert sum(b.nbytes for b in pool._free) == pool.allocated
    pool.clear()
    assert pool.allocated == 0
    note(f"pool flat at {seen[-1][0] >> 10} KiB ({seen[-1][1]} allocations, all in the first round) within "
         f"a {budget >> 10} KiB budget; cleared to 0")


def _cyclic_garbage(run):
    """The objects that only a GC pass would free after ``run()``: collected with the GC off, then found
    by one collection that keeps what it finds (``gc.DEBUG_SAVEALL``)."""
    gc.collect()
    gc.disable()
    try:
        run()
        wait_no_threads()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found


def _held_by_cycles(found):
    """Among ``found``: CUDA events and streams, tensors, and gpufeed's own objects."""
    bad = []
    for o in found:
        t = type(o)
        if (isinstance(o, (torch.Tensor, torch.cuda.Event, torch.cuda.Stream))
                or t.__module__.startswith("gpufeed")):
            bad.append(f"{t.__module__}.{t.__qualname__}")
    return sorted(set(bad))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["complete", "break", "consumer error", "loader error", "source"])
def test_no_reference_cycle_holds_device_objects(end, device, tmp_path):
    """After an epoch ends (complete, ``break``, an error in the consumer or the loader, a source epoch)
    and the prefetcher is closed, nothing of it waits for a GC pass: no event, stream, tensor or gpufeed
    object sits in a reference cycle. (A CUDA object left for the GC is freed by whichever process
    collects it; in a DataLoader worker forked later, that aborts the worker: ``CUDA error:
    initialization error``, seen in this suite's forked children.)"""
    data = [{"x": torch.full((64, 8), float(i)), "y": torch.arange(64) + i} for i in range(6)]

    class Fails:
        def __iter__(self):
            yield data[0]
            yield data[1]
            raise KeyError("loader broke")

    def run():
        if end == "source":
            disk = OnDisk("raw-multi", tmp_path)
            src = disk.open()
            pf = CudaPrefetcher(SourceLoader(src, batch_size=16, shuffle=True), device=device)
            got = [keep(b) for b in pf]
            check_epoch(got, disk.data, plan_batches(disk.n, 16, shuffle=True))
            pf.close()
            src.close()
            return
        pf = CudaPrefetcher(Fails() if end == "loader error" else data, device=device, depth=2)
        try:
            for k, b in enumerate(pf):
                assert torch.equal(b["x"].cpu(), data[k]["x"])
                if end == "break" and k == 2:
                    break
                if end == "consumer error" and k == 1:
                    raise ValueError("consumer broke")
        except (KeyError, ValueError):
            pass
        pf.close()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    held = _held_by_cycles(_cyclic_garbage(run))
    assert not held, f"left in reference cycles: {held}"
    checked(1)
    note("nothing of the prefetcher (no event, stream, tensor or gpufeed object) waits for a GC pass")
