"""The stager and the pinned pool, on plain host memory (pinning needs CUDA; tests/test_cuda.py pins)."""

import threading

import pytest
import torch

from gpufeed.staging import PinnedPool, Stager, layout

STOP = threading.Event()


def test_pool_reuses_buffers_and_stays_in_budget():
    pool = PinnedPool(budget=64 << 10, chunk_bytes=16 << 10, pin=False)
    a = pool.acquire(10 << 10, STOP)
    b = pool.acquire(16 << 10, STOP)
    assert a.nbytes == b.nbytes == 16 << 10 and pool.allocations == 2
    pool.release(a, None)
    c = pool.acquire(5000, STOP)
    assert c is a and pool.allocations == 2  # reused, not allocated again
    d = pool.acquire(32 << 10, STOP)
    assert pool.allocated == 64 << 10 and pool.try_acquire(1) is None  # budget full, nothing free
    for buf in (b, c, d):
        pool.release(buf, None)
    e = pool.acquire(48 << 10, STOP)  # too big for any free buffer: small ones are dropped to make room
    assert e.nbytes == 48 << 10 and pool.allocated <= 64 << 10


def test_a_request_larger_than_the_budget_is_served_alone():
    pool = PinnedPool(budget=32 << 10, chunk_bytes=16 << 10, pin=False)
    buf = pool.acquire(100 << 10, STOP)
    assert buf.nbytes >= 100 << 10
    pool.release(buf, None)
    pool.clear()
    assert pool.allocated == 0


def test_acquire_gives_up_when_stopped():
    from gpufeed._worker import Stopped

    pool = PinnedPool(budget=16 << 10, chunk_bytes=16 << 10, pin=False)
    pool.acquire(1, STOP)
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    with pytest.raises(Stopped):
        pool.acquire(1, stop)


@pytest.mark.parametrize("chunk_bytes", [64, 4096, 5000, 1 << 20])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 100_000, (1 << 20) + 3])
def test_stager_copies_every_byte(nbytes, chunk_bytes):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    block, (out,) = Stager(chunk_bytes, budget=1 << 20, pin=False).stage([src], torch.device("cpu"))
    assert torch.equal(out, src) and out.data_ptr() == block.data_ptr()


def test_stager_lays_leaves_end_to_end_at_aligned_offsets_with_their_dtype_and_shape():
    leaves = [torch.arange(7, dtype=torch.int16), torch.randn(3, 5, dtype=torch.float64),
              torch.empty(0, 4), torch.randn(8, 6)[:, ::2],  # a non-contiguous leaf is staged contiguous
              torch.tensor(True)]
    block, views = Stager(128, budget=256, pin=False).stage(leaves, torch.device("cpu"))
    offsets, total = layout([t.nbytes for t in leaves])
    assert block.numel() == total
    for t, v, off in zip(leaves, views, offsets, strict=True):
        assert torch.equal(v, t) and v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert off % 64 == 0 and (v.numel() == 0 or v.data_ptr() - block.data_ptr() == off)


def test_stager_rejects_nothing_and_returns_an_empty_block_for_no_leaves():
    block, views = Stager(4096, pin=False).stage([], torch.device("cpu"))
    assert block.numel() == 0 and views == []
