"""The reads of an epoch of a BatchSource into the SourceLoader's buffer pool (the CUDA path's host half),
driven on the CPU with plain memory: ``EpochReads`` over a ``PinnedPool(pin=False)``."""

import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpufeed.host_memory import HostBatch
from gpufeed.host_memory.cpu_buffers import CpuBuffers
from gpufeed.host_memory.pinned_pool import PinnedPool
from gpufeed.loaders._read_plan import regions
from gpufeed.loaders._reads import READS_AHEAD, EpochReads
from gpufeed.sources import FileChangedError, RawSource, _pread, plan_batches
from test_source_mode import ArraySource, OddSource

STOP = threading.Event()
CPU = torch.device("cpu")


def pool_of(budget):
    return PinnedPool(budget=budget, pin=False)


def epoch_reads(src, plan, pool, threads=3):
    """The reads of ``plan`` into ``pool``'s buffers, as a SourceLoader makes them for a CUDA device."""
    return EpochReads(src, plan, threads, pool, CpuBuffers(slots=8), CPU, STOP)


def all_back(pool):
    """Every buffer the pool allocated is back in it (none taken, none lost)."""
    return len(pool._free) == pool.allocations


def pooled_batches(src, plan, pool, threads=3):
    """Take every batch of ``plan`` in order; yield its rows and tensors, then return its buffer (its lease,
    as the device stage does once the copy was issued). The epoch is cancelled at the end."""
    reads = epoch_reads(src, plan, pool, threads)
    try:
        for i in range(len(plan)):
            hb = reads.take(i)
            assert isinstance(hb, HostBatch) and hb.lease is not None  # read into a buffer of the pool
            yield plan[i], hb.batch
            hb.lease(None)
    finally:
        reads.cancel()


def rows_index(rows):
    return np.arange(rows.start, rows.stop) if isinstance(rows, range) else np.asarray(rows)


@pytest.mark.parametrize("min_read", [0, 1 << 20])  # many reads per batch, or one
@pytest.mark.parametrize("budget", [1024, 4096, 8192, 1 << 20])  # under a batch, one buffer .. all at once
@pytest.mark.parametrize("src_cls", [ArraySource, OddSource])
def test_pooled_reads_deliver_every_byte_and_return_every_buffer(budget, src_cls, min_read, monkeypatch):
    import gpufeed.loaders._read_plan as rp

    monkeypatch.setattr(rp, "MIN_READ_BYTES", min_read)
    src = src_cls()
    plan = plan_batches(len(src), 17, shuffle=True, seed=1)
    pool = pool_of(budget)
    for i, (rows, out) in enumerate(pooled_batches(src, plan, pool)):
        idx = rows_index(rows)
        for k, a in src.arrays.items():
            assert np.array_equal(out[k].numpy(), a[idx]), (i, k)
    assert all_back(pool)  # nothing left taken
    # A batch of 17 rows fits the smallest buffer (4 KiB): as many as the budget holds, at most the batch
    # being handed over and READS_AHEAD read ahead; a budget smaller than a batch still gets one buffer.
    assert pool.allocations == max(1, min(budget // 4096, 1 + READS_AHEAD))
    assert pool.allocated == pool.allocations * 4096 <= max(budget, 4096)


@pytest.mark.skipif(_pread.backend() != "native", reason="the native reader is not built here")
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("budget", [64 << 10, 1 << 20])
def test_a_source_that_submits_its_reads_delivers_every_byte(tmp_path, shuffle, budget, monkeypatch):
    """RawSource starts a batch's read on its own threads (``submit``) and no reader thread is made;
    scattered rows (which it may gather from a memory map) go to reader threads. A file cut under the
    reads fails at the next read, naming the file (it changed: no byte is read through its old layout), and
    every buffer comes back. (Batches here are small: a read of at most ``INLINE_BYTES`` would run on the
    calling thread without asking the source; that limit is lowered so that every batch is offered to
    ``submit``.)"""
    import gpufeed.loaders._read_plan as rp

    monkeypatch.setattr(rp, "INLINE_BYTES", 0)
    x = np.random.default_rng(3).integers(0, 1 << 30, size=(3000, 40), dtype=np.int32)
    np.save(tmp_path / "x.npy", x)
    src = RawSource(tmp_path / "x.npy", num_threads=4)
    real, submitted = src.submit, []

    def submit(rows, out):
        pending = real(rows, out)
        submitted.append(pending is not None)
        return pending

    src.submit = submit
    plan = plan_batches(len(src), 250, shuffle=shuffle, seed=2)
    pool = pool_of(budget)
    reads = epoch_reads(src, plan, pool)
    try:
        for i in range(len(plan)):
            hb = reads.take(i)
            assert np.array_equal(hb.batch["x"].numpy(), x[rows_index(plan[i])]), i
            hb.lease(None)
        assert len(submitted) == len(plan)  # every batch offered to the source's own threads, once
        assert all(submitted) == (not shuffle)  # contiguous rows: every read started there
        assert (reads._executor is None) == (not shuffle)  # scattered rows: reader threads
        reads.cancel()
        assert all_back(pool)
        os.truncate(tmp_path / "x.npy", os.path.getsize(tmp_path / "x.npy") // 2)
        reads = epoch_reads(src, plan_batches(len(src), 250), pool)
        with pytest.raises(FileChangedError, match=r"x\.npy"):
            for i in range(len(reads.plan)):
                reads.take(i).lease(None)
        assert i == 0
        reads.cancel()
        assert all_back(pool)
    finally:
        reads.cancel()
        src.close()


@pytest.mark.skipif(_pread.backend() != "native", reason="the native reader is not built here")
def test_a_successor_whose_read_cannot_start_fails_at_its_own_batch_and_returns_its_buffer(tmp_path):
    """``submit`` raising (a file that cannot open) while an earlier batch starts the reads ahead: the
    earlier batch is whole, the error is raised by the batch whose read it was, every buffer comes back."""
    x = np.arange(40_000 * 64, dtype=np.int32).reshape(40_000, 64)  # batches of 2 MiB: not read inline
    np.save(tmp_path / "x.npy", x)
    src = RawSource(tmp_path / "x.npy", num_threads=2)
    real = src.submit

    def submit(rows, out):
        if rows.start >= 24_000:
            raise OSError(24, "Too many open files (injected)")
        return real(rows, out)

    src.submit = submit
    pool = pool_of(64 << 20)
    reads = epoch_reads(src, plan_batches(len(src), 8000), pool, threads=2)
    got = []
    with pytest.raises(OSError, match="injected"):
        for i in range(len(reads.plan)):
            hb = reads.take(i)
            got.append(hb.batch["x"].numpy().copy())
            hb.lease(None)
    assert i == 3  # raised by batch 3 (rows 24000..), whose read it was, not by batch 1 or 2 that started it
    assert len(got) == 3 and np.array_equal(np.concatenate(got), x[:24_000])
    reads.cancel()
    assert all_back(pool)
    src.close()


@pytest.mark.skipif(_pread.backend() != "native", reason="the native reader is not built here")
def test_pending_reads_give_the_same_result_every_time(tmp_path):
    """A wait may be repeated (a Ctrl-C between the wait and its bookkeeping calls it again): the same
    result, and the same error, each time."""
    from gpufeed.sources._files import FileDescriptors

    (tmp_path / "f").write_bytes(bytes(range(256)) * 64)
    fds = FileDescriptors([str(tmp_path / "f")])
    buf = torch.zeros(4096, dtype=torch.uint8)

    def one(size):
        where = np.array([100], np.int64), np.array([size], np.int64), np.zeros(1, np.int64)
        return 0, *where, buf.data_ptr(), 4096

    pending = _pread.submit(fds, ["f"], [one(4096)], 4, keep=buf)
    pending.result()
    pending.result()
    assert bytes(buf.numpy()) == (bytes(range(256)) * 64)[100:4196]
    os.truncate(tmp_path / "f", 1000)
    pending = _pread.submit(fds, ["f"], [one(4096)], 4, keep=buf)
    for _ in range(2):
        with pytest.raises(OSError, match="expected 4096 bytes at offset 100, got 900"):
            pending.result(timeout=5)
    fds.close()


def test_a_successor_started_then_abandoned_returns_its_buffers(monkeypatch):
    """Reads started ahead of a batch and never taken (the epoch stopped) end at ``cancel``, and their
    buffers come back; a batch handed over keeps its buffer until its lease returns it."""
    import gpufeed.loaders._read_plan as rp

    monkeypatch.setattr(rp, "INLINE_BYTES", 0)  # batches this small are read inline, on the calling thread
    src = ArraySource()
    pool = pool_of(1 << 20)
    reads = epoch_reads(src, plan_batches(len(src), 10), pool)
    hb0 = reads.take(0)
    assert np.array_equal(hb0.batch["y"].numpy(), np.arange(10))
    assert sorted(reads._started) == list(range(1, 1 + READS_AHEAD))  # their reads were started ahead
    ahead = list(reads._started.values())
    assert all(b.buf is not None for b in ahead)
    reads.cancel()
    assert not reads._started and reads._executor is None
    assert all(f.done() for b in ahead for f in b.futures) and all(b.buf is None for b in ahead)
    assert pool.allocations == 1 + READS_AHEAD and len(pool._free) == READS_AHEAD  # batch 0's: still out
    hb0.lease(None)
    assert all_back(pool)


def test_regions_are_aligned_for_every_dtype():
    src = OddSource()
    offsets, nbytes = regions(src.fields, 7)
    assert all(o % 64 == 0 for o in offsets.values())
    assert nbytes >= sum(7 * f.sample_nbytes for f in src.fields.values())


def test_views_are_cached_per_buffer_and_layout():
    """Batches of one size read into a buffer reuse its views: made once per buffer and layout."""
    src = ArraySource()
    pool = pool_of(1 << 20)
    plan = plan_batches(len(src), 10)
    reads = epoch_reads(src, plan, pool)
    batches = []
    try:
        for i in range(6):  # the same layout six times, in 1 + READS_AHEAD buffers
            hb = reads.take(i)
            assert np.array_equal(hb.batch["y"].numpy(), np.arange(i * 10, i * 10 + 10))
            batches.append(hb.batch)
            hb.lease(None)
    finally:
        reads.cancel()
    assert pool.allocations == 1 + READS_AHEAD
    assert len({id(b) for b in batches}) == pool.allocations  # one set of views per buffer
    cached = [len(buf.views) for buf in pool._free]
    assert len(cached) == pool.allocations and max(cached) == 1


def test_a_small_batch_is_read_on_the_calling_thread():
    """One read under INLINE_BYTES runs on the calling thread itself, the reads ahead too: no reader thread
    is woken for them."""
    src = ArraySource()
    pool = pool_of(1 << 20)
    submitted = []
    threads = []
    real = src.read
    src.read = lambda rows, out: (threads.append(threading.current_thread()), real(rows, out))
    reads = epoch_reads(src, plan_batches(len(src), 10), pool)
    reads._executor = SimpleNamespace(submit=lambda *a: submitted.append(a), shutdown=lambda **k: None)
    try:
        for i in range(3):
            hb = reads.take(i)
            assert np.array_equal(hb.batch["y"].numpy(), np.arange(i * 10, i * 10 + 10))
            hb.lease(None)
        assert not submitted
        assert threads == [threading.current_thread()] * (3 + READS_AHEAD)  # batches 0-4, each read once
    finally:
        reads.cancel()
    assert all_back(pool)


def test_a_failing_inline_read_raises_at_its_batch_and_returns_its_buffer():
    src = ArraySource(fail_at=15)
    pool = pool_of(1 << 20)
    reads = epoch_reads(src, plan_batches(len(src), 10), pool)
    try:
        hb0 = reads.take(0)  # (batch 1's read, started ahead, failed already: it raises in its own turn)
        assert np.array_equal(hb0.batch["y"].numpy(), np.arange(10))
        hb0.lease(None)
        with pytest.raises(OSError, match="row 15"):
            reads.take(1)
        assert sorted(reads._started) == [2, 3]  # (started ahead before batch 1's error was seen)
        assert len(pool._free) == pool.allocations - READS_AHEAD == 1  # batch 1's came back
    finally:
        reads.cancel()
    assert all_back(pool)


class DeviceSource(ArraySource):
    """An ArraySource that claims to read into device memory, recording how many reads overlap."""

    def __init__(self, delay=0.01, **kw):
        super().__init__(**kw)
        self.reads_to = "device"
        self.delay, self.calls, self.busy, self.most = delay, [], 0, 0
        self._lock = threading.Lock()

    def read(self, rows, out):
        with self._lock:
            self.busy += 1
            self.most = max(self.most, self.busy)
            self.calls.append(list(rows))
        try:
            threading.Event().wait(self.delay)  # long enough for the reads started ahead to overlap
            super().read(rows, out)
        finally:
            with self._lock:
                self.busy -= 1


class FakeEvent:
    """A stand-in for ``torch.cuda.Event`` on the CPU: the fence each device read waits for. ``fail_after``
    fences are recorded, and the next ones raise (the device out of memory when a batch's read starts)."""

    recorded = 0
    fail_after = None

    def record(self, stream=None):
        if FakeEvent.fail_after is not None and FakeEvent.recorded >= FakeEvent.fail_after:
            raise RuntimeError("out of device memory (simulated)")
        FakeEvent.recorded += 1

    def synchronize(self):
        pass


def device_reads(src, plan, threads, monkeypatch, fail_after=None):
    """The reads of a source that reads into device memory, on the CPU: its device memory is host memory
    and its fence a :class:`FakeEvent`."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "recorded", 0)
    monkeypatch.setattr(FakeEvent, "fail_after", fail_after)
    reads = EpochReads(src, plan, threads, pool_of(1 << 20), CpuBuffers(slots=8), CPU, STOP)
    assert not reads.to_device  # (a CPU device reads to the host: force the device path)
    reads.to_device = True
    return reads


@pytest.mark.parametrize("threads", [1, 3])
def test_device_reads_are_one_read_a_batch_with_up_to_threads_batches_at_once(threads, monkeypatch):
    src = DeviceSource()
    plan = plan_batches(len(src), 10, shuffle=True, seed=2)
    reads = device_reads(src, plan, threads, monkeypatch)
    try:
        for i in range(len(plan)):
            hb = reads.take(i)
            assert hb.lease is None  # device memory: the consumer's, no buffer to return
            idx = np.asarray(plan[i])
            for k, a in src.arrays.items():
                assert np.array_equal(hb.batch[k].numpy(), a[idx]), (i, k)
    finally:
        reads.cancel()
    assert sorted(src.calls) == sorted(list(rows) for rows in plan)  # each batch read once, whole
    assert src.most == threads
    assert reads.pool.allocations == 0  # nothing went through the pool


def test_a_failing_device_read_raises_at_its_batch_and_the_reads_ahead_end(monkeypatch):
    from conftest import wait_no_threads

    src = DeviceSource(fail_at=35)
    reads = device_reads(src, plan_batches(len(src), 10), 4, monkeypatch)
    got = []
    with pytest.raises(OSError, match="row 35"):
        for i in range(len(reads.plan)):
            got.append(reads.take(i).batch["y"][0].item())
    assert got == [0, 10, 20]  # the batches before it, complete
    reads.cancel()  # batches 4-6, started ahead: those running end before the reader threads stop, the rest
    assert src.busy == 0 and 4 <= len(src.calls) <= 7  # are cancelled
    wait_no_threads()


def test_a_successor_that_cannot_start_fails_at_its_own_batch_and_no_read_keeps_a_delivered_batch(
        monkeypatch):
    src = DeviceSource(delay=0.0)
    # The fences of batches 0 and 1 are recorded; from batch 2 on the device is out of memory.
    reads = device_reads(src, plan_batches(len(src), 10), 4, monkeypatch, fail_after=2)
    got = []
    try:
        got.append(reads.take(0).batch["y"][0].item())  # batch 2 failed to start ahead
        assert 0 not in reads._started  # handed over, not kept
        got.append(reads.take(1).batch["y"][0].item())
        assert 1 not in reads._started
        with pytest.raises(RuntimeError, match="out of device memory"):
            reads.take(2)  # its own start, in its turn, raises
    finally:
        reads.cancel()
    assert got == [0, 10]


@pytest.mark.parametrize("batch", [7, 64, 250])
def test_pooled_multi_field_multi_file_source_through_epoch_reads(tmp_path, batch):
    """A short last batch, runs across files, two fields in separate files, two epochs through one pool."""
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, 1 << 30, size=(n, 33), dtype=np.int32) for n in (301, 77, 410)]
    y = rng.standard_normal(788).astype(np.float32)
    for i, a in enumerate(xs):
        np.save(tmp_path / f"x{i}.npy", a)
    np.save(tmp_path / "y.npy", y)
    x = np.concatenate(xs)
    src = RawSource(fields={"x": [tmp_path / f"x{i}.npy" for i in range(3)], "y": tmp_path / "y.npy"},
                    num_threads=3)
    pool = pool_of(64 << 10)
    plan = plan_batches(len(src), batch, shuffle=False)
    for epoch in range(2):
        n = 0
        for i, (rows, out) in enumerate(pooled_batches(src, plan, pool)):
            r = np.arange(rows.start, rows.stop)
            assert np.array_equal(out["x"].numpy(), x[r]), (epoch, i)
            assert np.array_equal(out["y"].numpy(), y[r]), (epoch, i)
            n += len(r)
        assert n == 788
    assert all_back(pool) and pool.allocated <= 64 << 10
    src.close()
