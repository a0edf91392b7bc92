"""The staged read of source batches (the CUDA path's host half), driven on the CPU with plain memory."""

import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpufeed._read_plan import regions
from gpufeed._source_batch import EpochReads
from gpufeed.pinned_pool import PinnedPool
from gpufeed.sources import RawSource, _pread, plan_batches
from test_source_mode import ArraySource, OddSource

STOP = threading.Event()


def fake_copier(budget, chunk_bytes):
    pool = PinnedPool(budget=budget, chunk_bytes=chunk_bytes, pin=False)
    return SimpleNamespace(pool=pool, trace=None, stream=None)


def staged_batches(src, plan, copier, threads=3):
    """Read every batch of ``plan`` with ``_read_staged``, in order; yield each batch and its ``out``. The
    epoch is cancelled at the end (its buffers returned)."""
    chain = EpochReads(src, plan, threads=threads)
    try:
        for i in range(len(plan)):
            b = chain.get(i)
            out = {k: torch.empty((len(b.rows), *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
            b._read_staged(copier, out, STOP)
            yield b, out
    finally:
        chain.cancel()


@pytest.mark.parametrize("min_read", [0, 1 << 20])  # many reads per chunk, or one
@pytest.mark.parametrize("budget", [4096, 8192, 1 << 20])  # from one buffer at a time to everything at once
@pytest.mark.parametrize("src_cls", [ArraySource, OddSource])
def test_staged_reads_deliver_every_byte_and_return_every_buffer(budget, src_cls, min_read, monkeypatch):
    import gpufeed._read_plan as sb

    monkeypatch.setattr(sb, "MIN_READ_BYTES", min_read)
    src = src_cls()
    plan = plan_batches(len(src), 17, shuffle=True, seed=1)
    copier = fake_copier(budget, 4096)
    for i, (b, out) in enumerate(staged_batches(src, plan, copier)):
        idx = np.asarray(b.rows) if not isinstance(b.rows, range) else np.arange(b.rows.start, b.rows.stop)
        for k, a in src.arrays.items():
            assert np.array_equal(out[k].numpy(), a[idx]), (i, k)
    assert len(copier.pool._free) == copier.pool.allocations  # nothing left taken
    assert copier.pool.allocated <= max(budget, 4096 * 2)


@pytest.mark.skipif(_pread.backend() != "native", reason="the native reader is not built here")
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("budget", [64 << 10, 1 << 20])
def test_a_source_that_submits_its_reads_delivers_every_byte(tmp_path, shuffle, budget):
    """RawSource starts a chunk's read on its own threads (``submit``) and no reader thread is made;
    scattered rows go to reader threads (they may be gathered from a memory map). A file cut under the
    reads fails at a batch that reads past its end, and every buffer comes back."""
    x = np.random.default_rng(3).integers(0, 1 << 30, size=(3000, 40), dtype=np.int32)
    np.save(tmp_path / "x.npy", x)
    src = RawSource(tmp_path / "x.npy", num_threads=4)
    plan = plan_batches(len(src), 250, shuffle=shuffle, seed=2)
    copier = fake_copier(budget, 16 << 10)
    chain = EpochReads(src, plan, threads=3)
    try:
        for i in range(len(plan)):
            b = chain.get(i)
            out = {"x": torch.empty((len(b.rows), 40), dtype=torch.int32)}
            b._read_staged(copier, out, STOP)
            assert np.array_equal(out["x"].numpy(), x[np.asarray(list(b.rows))]), i
        assert (chain._executor is None) == (not shuffle)
        chain.cancel()
        assert len(copier.pool._free) == copier.pool.allocations
        os.truncate(tmp_path / "x.npy", os.path.getsize(tmp_path / "x.npy") // 2)
        chain = EpochReads(src, plan_batches(len(src), 250), threads=3)
        with pytest.raises(OSError, match=r"x\.npy"):
            for i in range(len(chain.plan)):
                b = chain.get(i)
                b._read_staged(copier, {"x": torch.empty((len(b.rows), 40), dtype=torch.int32)}, STOP)
        assert i >= 5  # the first half of the file was read
        chain.cancel()
        assert len(copier.pool._free) == copier.pool.allocations
    finally:
        chain.cancel()
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
    copier = fake_copier(64 << 20, 4 << 20)
    chain = EpochReads(src, plan_batches(len(src), 8000), threads=2)
    got = []
    with pytest.raises(OSError, match="injected"):
        for i in range(len(chain.plan)):
            b = chain.get(i)
            out = {"x": torch.empty((len(b.rows), 64), dtype=torch.int32)}
            b._read_staged(copier, out, STOP)
            got.append(out["x"].numpy().copy())
    assert len(got) == 3 and np.array_equal(np.concatenate(got), x[:24_000])
    chain.cancel()
    assert len(copier.pool._free) == copier.pool.allocations
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


@pytest.mark.skipif(_pread.backend() != "native", reason="the native reader is not built here")
def test_reads_started_on_the_sources_threads_are_traced(tmp_path):
    """No reader thread records a fill for them: each chunk's read is a ``read`` span of its own track."""
    from gpufeed._tracing import TraceRecorder

    x = np.arange(24_000 * 64, dtype=np.int32).reshape(24_000, 64)  # 2 MiB batches, chunks of 1 MiB
    np.save(tmp_path / "x.npy", x)
    copier = fake_copier(64 << 20, 1 << 20)
    copier.trace = TraceRecorder()
    with RawSource(tmp_path / "x.npy") as src:
        chain = EpochReads(src, plan_batches(len(src), 8000), threads=2)
        for i in range(len(chain.plan)):
            b = chain.get(i)
            b._read_staged(copier, {"x": torch.empty((len(b.rows), 64), dtype=torch.int32)}, STOP)
        chain.cancel()
    spans = [e for e in copier.trace._trace_events() if e.get("ph") == "X"]
    assert [e["name"] for e in spans] == ["read"] * 6 and all(e["dur"] >= 0 for e in spans)  # 2 a batch


def test_a_successor_started_then_abandoned_returns_its_buffers(monkeypatch):
    import gpufeed._read_plan as sb

    monkeypatch.setattr(sb, "INLINE_BYTES", 0)  # batches this small are read inline, with no successor
    src = ArraySource()
    copier = fake_copier(1 << 20, 4096)
    chain = EpochReads(src, plan_batches(len(src), 10), threads=3)
    b0 = chain.get(0)
    out = {k: torch.empty((10, *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
    b0._read_staged(copier, out, STOP)
    assert chain.get(1)._entries  # its reads were started ahead
    chain.cancel()
    assert not chain.get(1)._entries
    assert len(copier.pool._free) == copier.pool.allocations


def test_regions_are_aligned_for_every_dtype():
    src = OddSource()
    offsets, nbytes = regions(src.fields, 7)
    assert all(o % 64 == 0 for o in offsets.values())
    assert nbytes >= sum(7 * f.sample_nbytes for f in src.fields.values())


def test_views_are_cached_per_buffer_and_layout():
    src = ArraySource()
    copier = fake_copier(1 << 20, 4096)
    plan = plan_batches(len(src), 10)
    chain = EpochReads(src, plan, threads=3)
    try:
        for i in range(3):  # same layout three times: the views are made once per buffer
            b = chain.get(i)
            out = {k: torch.empty((len(b.rows), *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
            b._read_staged(copier, out, STOP)
            assert np.array_equal(out["y"].numpy(), np.arange(i * 10, i * 10 + 10))
        cached = [len(buf.views) for buf in copier.pool._free]
        assert cached and max(cached) == 1
    finally:
        chain.cancel()


def test_a_small_batch_is_read_on_the_calling_thread():
    """One read under INLINE_BYTES runs on the background thread itself: no worker is woken for it."""
    src = ArraySource()
    copier = fake_copier(1 << 20, 4096)
    submitted = []
    threads = []
    real = src.read
    src.read = lambda rows, out: (threads.append(threading.current_thread()), real(rows, out))
    chain = EpochReads(src, plan_batches(len(src), 10), threads=3)
    chain._executor = SimpleNamespace(submit=lambda *a: submitted.append(a), shutdown=lambda **k: None)
    try:
        for i in range(3):
            b = chain.get(i)
            out = {k: torch.empty((10, *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
            b._read_staged(copier, out, STOP)
            assert np.array_equal(out["y"].numpy(), np.arange(i * 10, i * 10 + 10))
        assert not submitted and threads == [threading.current_thread()] * 3
    finally:
        chain.cancel()
    assert len(copier.pool._free) == copier.pool.allocations


def test_a_failing_inline_read_raises_and_returns_its_buffer():
    src = ArraySource(fail_at=15)
    copier = fake_copier(1 << 20, 4096)
    chain = EpochReads(src, plan_batches(len(src), 10), threads=3)
    try:
        out = {k: torch.empty((10, *f.shape), dtype=f.dtype) for k, f in src.fields.items()}
        chain.get(0)._read_staged(copier, out, STOP)
        with pytest.raises(OSError, match="row 15"):
            chain.get(1)._read_staged(copier, out, STOP)
    finally:
        chain.cancel()
    assert len(copier.pool._free) == copier.pool.allocations


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


def device_copier():
    """The parts of a copier a device read uses, on the CPU: a stream stand-in and the device."""
    return SimpleNamespace(device=torch.device("cpu"), stream=SimpleNamespace(synchronize=lambda: None))


@pytest.mark.parametrize("threads", [1, 3])
def test_device_reads_are_one_read_a_batch_with_up_to_threads_batches_at_once(threads):
    src = DeviceSource()
    plan = plan_batches(len(src), 10, shuffle=True, seed=2)
    chain = EpochReads(src, plan, threads=threads)
    try:
        for i in range(len(plan)):
            b = chain.take(i)
            out = b._read_device(device_copier(), STOP)
            idx = np.asarray(b.rows)
            for k, a in src.arrays.items():
                assert np.array_equal(out[k].numpy(), a[idx]), (i, k)
    finally:
        chain.cancel()
    assert sorted(src.calls) == sorted(list(rows) for rows in plan)  # each batch read once, whole
    assert src.most == threads


def test_a_failing_device_read_raises_at_its_batch_and_the_reads_ahead_end():
    from conftest import wait_no_threads

    src = DeviceSource(fail_at=35)
    chain = EpochReads(src, plan_batches(len(src), 10), threads=4)
    got = []
    with pytest.raises(OSError, match="row 35"):
        for i in range(len(chain.plan)):
            got.append(chain.take(i)._read_device(device_copier(), STOP)["y"][0].item())
    assert got == [0, 10, 20]  # the batches before it, complete
    chain.cancel()  # batches 4-6, started ahead: those running end before the reader threads stop, the rest
    assert src.busy == 0 and 4 <= len(src.calls) <= 7  # are cancelled
    wait_no_threads()


def test_a_successor_that_cannot_start_fails_at_its_own_batch_and_no_read_keeps_a_delivered_batch():
    src = DeviceSource(delay=0.0)
    chain = EpochReads(src, plan_batches(len(src), 10), threads=4)
    copier = device_copier()
    calls = {"n": 0}

    def failing_sync():  # the fences of batches 0 and 1 pass; from batch 2 on the device is out of memory
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("out of device memory (simulated)")

    copier.stream.synchronize = failing_sync
    got = []
    try:
        got.append(chain.take(0)._read_device(copier, STOP)["y"][0].item())  # batch 2 failed to start ahead
        assert chain.get(0)._device_out == {}  # handed over, not kept
        got.append(chain.take(1)._read_device(copier, STOP)["y"][0].item())
        with pytest.raises(RuntimeError, match="out of device memory"):
            chain.take(2)._read_device(copier, STOP)  # its own start, in its turn, raises
    finally:
        chain.cancel()
    assert got == [0, 10]


@pytest.mark.parametrize("batch", [7, 64, 250])
def test_staged_multi_field_multi_file_source_through_epoch_reads(tmp_path, batch):
    """Several chunks per batch, a short last batch, runs across files, two fields in separate files."""
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, 1 << 30, size=(n, 33), dtype=np.int32) for n in (301, 77, 410)]
    y = rng.standard_normal(788).astype(np.float32)
    for i, a in enumerate(xs):
        np.save(tmp_path / f"x{i}.npy", a)
    np.save(tmp_path / "y.npy", y)
    x = np.concatenate(xs)
    src = RawSource(fields={"x": [tmp_path / f"x{i}.npy" for i in range(3)], "y": tmp_path / "y.npy"},
                    num_threads=3)
    copier = fake_copier(64 << 10, 8 << 10)
    plan = plan_batches(len(src), batch, shuffle=False)
    for epoch in range(2):
        for i, (b, out) in enumerate(staged_batches(src, plan, copier)):
            r = np.arange(b.rows.start, b.rows.stop)
            assert np.array_equal(out["x"].numpy(), x[r]), (epoch, i)
            assert np.array_equal(out["y"].numpy(), y[r]), (epoch, i)
    assert len(copier.pool._free) == copier.pool.allocations
    src.close()
