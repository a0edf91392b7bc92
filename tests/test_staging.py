"""The stager and the pinned pool, on plain host memory (pinning needs CUDA; tests/test_cuda.py pins)."""

import threading
import time

import pytest
import torch

from gpufeed._staging import PACK_BYTES, PACK_LEAF_BYTES, Stager
from gpufeed._threads import Stopped
from gpufeed.host_memory.pinned_pool import PinnedPool

STOP = threading.Event()


def test_pool_reuses_buffers_and_stays_in_budget():
    pool = PinnedPool(budget=64 << 10, pin=False)
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
    assert e.nbytes == 64 << 10 and pool.allocated <= 64 << 10  # (the power of two above)


def test_a_request_larger_than_the_budget_is_served_alone():
    pool = PinnedPool(budget=32 << 10, pin=False)
    buf = pool.acquire(100 << 10, STOP)
    assert buf.nbytes >= 100 << 10
    pool.release(buf, None)
    pool.clear()
    assert pool.allocated == 0


def test_acquire_gives_up_when_stopped():
    pool = PinnedPool(budget=16 << 10, pin=False)
    pool.acquire(16 << 10, STOP)  # the whole budget
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    with pytest.raises(Stopped):
        pool.acquire(1, stop)


def test_acquire_waits_for_a_buffer_to_come_back_and_takes_it_at_once():
    """Every buffer out: acquire blocks until one is released, then takes that one."""
    pool = PinnedPool(budget=16 << 10, pin=False)
    held = pool.acquire(16 << 10, STOP)  # the whole budget
    threading.Timer(0.2, pool.release, (held, None)).start()
    t0 = time.perf_counter()
    got = pool.acquire(1, STOP)
    waited = time.perf_counter() - t0
    assert got is held and 0.15 < waited < 5.0


def stage(stager, leaves):
    """The leaves on the (CPU) device, and the distinct device allocations they are views of."""
    outs, jobs = stager.prepare(leaves, torch.device("cpu"))
    for job in jobs:
        job()
    storages = {}
    for m in outs:
        if m.numel():
            storages.setdefault(m.untyped_storage().data_ptr(), m.untyped_storage().nbytes())
    return outs, storages


@pytest.mark.parametrize("chunk_bytes", [4096, 5000, 1 << 20])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 100_000, (1 << 20) + 3])
def test_stager_copies_every_byte_whole_or_in_chunks(nbytes, chunk_bytes):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    (out,), _ = stage(Stager(chunk_bytes, pin=False), [src])
    assert torch.equal(out, src) and (nbytes == 0 or out.data_ptr() != src.data_ptr())


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_stager_keeps_dtype_and_shape_and_delivers_a_non_contiguous_tensor_contiguous(chunk_bytes):
    for t in (torch.randn(64, 48, dtype=torch.float64)[:, ::2], torch.tensor(True), torch.empty(0, 4),
              torch.arange(3000, dtype=torch.int16).view(30, 100).t()):
        (out,), _ = stage(Stager(chunk_bytes, pin=False), [t])
        assert torch.equal(out, t) and out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()


def test_prepare_allocates_before_any_copy_and_the_jobs_fill():
    """The device stage fences its copy stream after the allocations: prepare() copies nothing."""
    t = torch.arange(100_000, dtype=torch.int32)
    (out,), jobs = Stager(4096, pin=False).prepare([t], torch.device("cpu"))
    out.zero_()
    assert not torch.equal(out, t)
    for job in jobs:
        job()
    assert torch.equal(out, t)


def _leaves():
    g = torch.Generator().manual_seed(5)
    return [torch.tensor(2.5, dtype=torch.float64), torch.randn(3, 5, 7, generator=g),
            torch.randn(9, generator=g, dtype=torch.complex64), torch.rand(13, generator=g) > 0.5,
            torch.randn(6, 4, generator=g).t(), torch.randint(0, 255, (1001,), dtype=torch.uint8),
            torch.randn(17, 3, generator=g).bfloat16(), torch.empty(0, 4),
            torch.arange(3000, dtype=torch.int16), torch.arange(6000, dtype=torch.int64)[::3],
            torch.randn(1, generator=g).expand(50), torch.empty(3, 0, dtype=torch.int16)]


def test_stage_packs_small_tensors_and_delivers_each_exact_and_on_its_own():
    leaves = [*_leaves(), torch.arange(PACK_LEAF_BYTES // 4 + 1, dtype=torch.int32)]  # one too big to pack
    moved, allocations = stage(Stager(1 << 20, pin=False), leaves)
    for t, m in zip(leaves, moved, strict=True):
        assert torch.equal(m, t) and m.dtype == t.dtype and m.shape == t.shape and m.is_contiguous()
    assert len(allocations) == 2  # the big one alone, every other leaf in one block
    for m in moved:
        assert m.numel() == 0 or m.data_ptr() % 64 == 0  # each on a cache line
    moved[1].fill_(0)  # a view of the same block as its neighbours: they stay intact
    assert all(torch.equal(m, t) for m, t in zip(moved[2:], leaves[2:], strict=True))
    assert torch.equal(moved[0], leaves[0])


def test_stage_sends_a_tensor_larger_than_a_chunk_alone_in_chunks():
    big = torch.randint(0, 256, (3 * 4096 + 5,), dtype=torch.uint8)
    small = torch.arange(10)
    moved, allocations = stage(Stager(4096, pin=False), [small, big, small])
    assert torch.equal(moved[1], big) and torch.equal(moved[0], small) and torch.equal(moved[2], small)
    assert len(allocations) == 2  # the big one, then one block of both smalls


def test_a_packed_buffer_holds_at_most_pack_bytes():
    """A leaf the loop keeps keeps its block alive: no block is larger than PACK_BYTES."""
    leaves = [torch.full((PACK_LEAF_BYTES // 8,), i, dtype=torch.int64) for i in range(40)]  # 40 x 64 KiB
    moved, allocations = stage(Stager(32 << 20, pin=False), leaves)
    assert all(torch.equal(m, t) for m, t in zip(moved, leaves, strict=True))
    assert len(allocations) == -(-40 * PACK_LEAF_BYTES // PACK_BYTES)
    assert all(n <= PACK_BYTES for n in allocations.values())


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_send_delivers_what_prepare_delivers_and_packs_the_same_way(chunk_bytes):
    """``send`` (the loop's stream: copies issued at once) and ``prepare`` + jobs (the copy stream) give the
    same tensors, packed into the same blocks; a tensor alone is copied with one call, a tensor larger
    than a chunk in chunks."""
    leaves = [*_leaves(), torch.arange(PACK_LEAF_BYTES // 4 + 1, dtype=torch.int32),
              torch.randint(0, 256, (3 * 4096 + 5,), dtype=torch.uint8)]
    prepared, blocks = stage(Stager(chunk_bytes, pin=False), leaves)
    sent = Stager(chunk_bytes, pin=False).send(leaves, torch.device("cpu"))
    sent_blocks = {m.untyped_storage().data_ptr() for m in sent if m.numel()}
    assert len(sent_blocks) == len(blocks)
    for t, p, s in zip(leaves, prepared, sent, strict=True):
        assert torch.equal(s, t) and torch.equal(p, t), t.shape
        assert s.dtype == t.dtype and s.shape == t.shape and s.is_contiguous()
        assert s.numel() == 0 or s.data_ptr() != t.data_ptr()


@pytest.mark.parametrize("small", [0, 1, 2])
def test_send_packs_two_small_tensors_or_more_and_sends_the_rest_each_alone(small):
    """A batch of a large tensor (transposed: sent contiguous) and ``small`` tensors of at most
    ``PACK_LEAF_BYTES``: with one small tensor or none each goes alone (a block of its own, one call, as
    ``prepare`` does it); two are packed into one block."""
    big = torch.randn(300, 200).t()
    smalls = [torch.arange(512) * (k + 1) for k in range(small)]
    leaves = [big, *smalls]
    sent = Stager(1 << 20, pin=False).send(leaves, torch.device("cpu"))
    prepared, blocks = stage(Stager(1 << 20, pin=False), leaves)
    for t, s, p in zip(leaves, sent, prepared, strict=True):
        assert torch.equal(s, t) and torch.equal(p, t) and s.is_contiguous() and s.data_ptr() != t.data_ptr()
    sent_blocks = {m.untyped_storage().data_ptr() for m in sent}
    assert len(sent_blocks) == len(blocks) == (len(leaves) if small < 2 else 2)


def test_one_thread_pinning_copies_every_byte_and_leaves_what_numpy_cannot_read_to_torch(monkeypatch):
    """``parallel=False`` (``ToDevice``'s stage) pins by one thread's copy (``host_memory.pin_one_thread``):
    every byte of every dtype arrives, by either stream's path; a tensor numpy cannot read (requiring grad,
    with a conjugate bit) is pinned by torch. On the CPU the "pinned" block is a plain one."""
    from gpufeed import host_memory

    by_torch, by_numpy = [], []
    monkeypatch.setattr(host_memory, "pinned_empty", lambda n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(host_memory, "pin", lambda t: by_torch.append(t) or t.clone())
    copyto = host_memory.np.copyto
    monkeypatch.setattr(host_memory.np, "copyto",
                        lambda dst, src: by_numpy.append(src.nbytes) or copyto(dst, src))

    class Sub(torch.Tensor):
        pass

    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(300, 200, generator=g).to(torch.bfloat16), torch.rand(100_000, generator=g) > 0.5,
             torch.randint(-9, 9, (3, 4000), generator=g), torch.randn(300, 100, generator=g).t(),
             torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, generator=g)]  # (3 chunks of 1 MiB)
    odd = [torch.randn(300, 100, generator=g).requires_grad_(),
           torch.randn(300, 100, generator=g).as_subclass(Sub),
           torch.randn(20_000, dtype=torch.complex64, generator=g).conj()]
    plain.append(torch.tensor(2.5))  # (0-dim, small, but the only one: sent alone, not packed)
    leaves = [*plain, *odd]
    prepared, _ = stage(Stager(1 << 20, pin=True, parallel=False), leaves)
    sent = Stager(1 << 20, pin=True, parallel=False).send(leaves, torch.device("cpu"))
    for t, p, s in zip(leaves, prepared, sent, strict=True):
        want = t.detach().resolve_conj()
        for got in (p, s):
            assert torch.equal(got.detach().resolve_conj(), want)
            assert got.dtype == t.dtype and got.shape == t.shape
    # every byte of the plain tensors by numpy's copy, the others by torch's pin (each by both paths)
    assert sum(by_numpy) == 2 * sum(t.nbytes for t in plain)
    assert sorted(id(t) for t in by_torch) == sorted(id(t) for t in odd + odd)


def test_staging_falls_back_to_pageable_memory_once_pinning_fails_and_says_so_once():
    """The device stage's one fallback for both streams: a staging run that cannot pin turns pinning off,
    warns once and runs again from pageable memory; only pinned staging counts as staged bytes."""
    from gpufeed._device import DeviceStage
    from gpufeed.host_memory import PinnedUnavailable
    from gpufeed.stats import PrefetchStats

    stage = DeviceStage(torch.device("cpu"), None, PrefetchStats())
    stage.pinning = stage.stager.pin = True  # (as on CUDA, where pinning starts on)
    host = [torch.arange(10), torch.ones(3)]
    assert stage._staged(lambda: "pinned", host) == "pinned" and stage.stats.staged_bytes == 92
    calls = []

    def run():
        calls.append(stage.stager.pin)
        if stage.stager.pin:
            raise PinnedUnavailable("pinned allocation failed: test")
        return "pageable"

    with pytest.warns(RuntimeWarning, match="pinned memory is unavailable") as rec:
        assert stage._staged(run, host) == "pageable"
        assert stage._staged(run, host) == "pageable"
    assert calls == [True, False, False] and len(rec) == 1
    assert not stage.pinning and stage.stats.staged_bytes == 92
