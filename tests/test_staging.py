"""The stager and the pinned pool, on plain host memory (pinning needs CUDA; tests/test_cuda.py pins)."""

import threading

import pytest
import torch

from gpufeed.pinned_pool import PinnedPool
from gpufeed.staging import Stager

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


@pytest.mark.parametrize("chunk_bytes", [4096, 5000, 1 << 20])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 100_000, (1 << 20) + 3])
def test_stager_copies_every_byte_whole_or_in_chunks(nbytes, chunk_bytes):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    out = Stager(chunk_bytes, pin=False).to(src, torch.device("cpu"))
    assert torch.equal(out, src) and (nbytes == 0 or out.data_ptr() != src.data_ptr())


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_stager_keeps_dtype_and_shape_and_delivers_a_non_contiguous_tensor_contiguous(chunk_bytes):
    for t in (torch.randn(64, 48, dtype=torch.float64)[:, ::2], torch.tensor(True), torch.empty(0, 4),
              torch.arange(3000, dtype=torch.int16).view(30, 100).t()):
        out = Stager(chunk_bytes, pin=False).to(t, torch.device("cpu"))
        assert torch.equal(out, t) and out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()


def test_stager_rejects_a_tiny_chunk():
    with pytest.raises(ValueError, match="chunk_bytes must be >= 4096, got 64"):
        Stager(64)
