"""CUDA specifics, run on the GPU machine (`pytest -m cuda`): streams, events, memory, exact bytes."""

import gc

import pytest
import torch

from gpufeed import CudaPrefetcher

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 2_000_000  # about a millisecond of a slow consumer kernel


def digest(t):
    """An exact, order-sensitive checksum computed on the tensor's device (int64 arithmetic)."""
    b = t.reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.int64) % 1_000_003
    return (b * w).sum()


def host_batches(n, kind, seed=0, rows=(64, 4096)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        r = int(torch.randint(rows[0], rows[1], (1,), generator=g))
        b = {"x": torch.randn(r, 33, generator=g), "y": torch.randint(0, 2**62, (r,), generator=g),
             "m": torch.rand(r, 7, generator=g) > 0.5, "h": torch.randn(r, 3, generator=g).half(), "i": i}
        if kind == "pinned":
            b = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        elif kind == "device":
            b = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        out.append(b)
    return out


@pytest.mark.parametrize("kind", ["unpinned", "pinned", "device"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_bit_exact_under_a_slow_consumer(kind, depth):
    data = host_batches(24, kind, seed=depth)
    expected = [{k: digest(v.cuda()).item() for k, v in b.items() if k != "i"} for b in data]
    torch.cuda.synchronize()
    seen = []
    with CudaPrefetcher(data, depth=depth, chunk_bytes=64 << 10) as pf:
        for _ in range(2):
            got = []
            for b in pf:
                torch.cuda._sleep(SLEEP_CYCLES)  # the consumer's stream is busy; copies run ahead
                got.append({k: digest(v) for k, v in b.items() if k != "i"})  # read after the sleep
                seen.append(b["i"])
                del b  # memory goes back to the allocator while the digest kernels may still run
            assert [{k: v.item() for k, v in g.items()} for g in got] == expected
    assert seen == list(range(24)) * 2
    assert pf.stats.batches == 48


def test_kept_batches_stay_intact():
    data = host_batches(16, "unpinned", seed=7)
    with CudaPrefetcher(data, depth=2, chunk_bytes=64 << 10) as pf:
        kept = list(pf)
    torch.cuda.synchronize()
    for b, d in zip(kept, data, strict=True):
        for k in ("x", "y", "m", "h"):
            assert torch.equal(b[k].cpu(), d[k]), k


def test_consumer_on_a_side_stream_is_fenced():
    data = host_batches(12, "unpinned", seed=3)
    expected = [digest(b["x"].cuda()).item() for b in data]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), CudaPrefetcher(data, depth=2, chunk_bytes=64 << 10) as pf:
        got = []
        for b in pf:
            torch.cuda._sleep(SLEEP_CYCLES)
            got.append(digest(b["x"]))
    side.synchronize()  # the digests were computed on the side stream
    assert [g.item() for g in got] == expected


def test_one_copy_stream_and_flat_memory_over_20_epochs():
    data = host_batches(8, "unpinned", seed=1, rows=(2048, 2049))
    pf = CudaPrefetcher(data, depth=3)
    stream = pf._stream
    marks = []
    for _epoch in range(20):
        for b in pf:
            torch.cuda._sleep(100_000)
            b["x"].sum()
        torch.cuda.synchronize()
        gc.collect()
        marks.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), pf._pool.allocated,
                      pf._pool.allocations))
        assert pf._stream is stream
    assert len(set(marks[1:])) == 1, marks  # flat after the first epoch
    assert marks[-1][0] == marks[1][0]
    pf.close()
    assert pf._pool.allocated == 0


def test_device_defaults_to_the_current_cuda_device_and_transform_runs_there():
    data = [torch.arange(256, dtype=torch.uint8).view(16, 16) for _ in range(4)]
    with CudaPrefetcher(data, transform=lambda t: t.float().mul_(0.25)) as pf:
        assert pf.device == torch.device("cuda", torch.cuda.current_device())
        out = list(pf)
    assert all(o.is_cuda and o.dtype == torch.float32 for o in out)
    assert torch.equal(out[0].cpu(), data[0].float() * 0.25)  # exact in float32


def test_pinned_budget_zero_falls_back_with_one_warning():
    data = host_batches(4, "unpinned", seed=5)
    with (
        pytest.warns(RuntimeWarning, match="pinned staging is off") as rec,
        CudaPrefetcher(data, pinned_budget=0) as pf,
    ):
        got = list(pf)
    assert len([w for w in rec if "pinned staging" in str(w.message)]) == 1
    assert all(torch.equal(g["x"].cpu(), d["x"]) for g, d in zip(got, data, strict=True))


def test_large_batch_bigger_than_the_pinned_budget():
    x = torch.randn(64 << 20 >> 2)  # 64 MiB through a 16 MiB pool
    with CudaPrefetcher([x], pinned_budget=16 << 20, chunk_bytes=4 << 20) as pf:
        (y,) = list(pf)
        assert pf._pool.allocated <= 16 << 20
    assert torch.equal(y.cpu(), x)


def test_stats_time_the_copies():
    data = host_batches(8, "unpinned", seed=9, rows=(8192, 8193))
    with CudaPrefetcher(data) as pf:
        list(pf)
        torch.cuda.synchronize()
    s = pf.stats
    assert s.batches == 8 and s.bytes == sum(
        v.numel() * v.element_size() for b in data for v in b.values() if isinstance(v, torch.Tensor))
    assert s.copy_s > 0 and s.h2d_GBps > 0.5


def test_unpinned_batches_go_through_the_compiled_stage_call_bit_exact(monkeypatch):
    """With the compiled copy, each group of chunks is filled and sent in one GIL-free call; the bytes
    equal those of torch's copy path, over many chunks per batch and several groups per batch."""
    from gpufeed import _hostcopy, staging

    if staging.STAGE_COPY != "auto" or _hostcopy.load() is None:
        pytest.skip(f"compiled copy not in use: {_hostcopy.status}")
    calls = []
    stage = _hostcopy.stage

    def counted(lib, work, *a):
        calls.append(len(work))
        return stage(lib, work, *a)

    monkeypatch.setattr(_hostcopy, "stage", counted)
    data = host_batches(12, "unpinned", seed=11, rows=(2000, 9000))
    expected = [{k: digest(v.cuda()).item() for k, v in b.items() if k != "i"} for b in data]
    for mode in ("auto", "torch"):
        monkeypatch.setattr(staging, "STAGE_COPY", mode)
        calls.clear()
        with CudaPrefetcher(data, depth=2, chunk_bytes=64 << 10) as pf:
            got = []
            for b in pf:
                torch.cuda._sleep(SLEEP_CYCLES)
                got.append({k: digest(v).item() for k, v in b.items() if k != "i"})
            assert got == expected, mode
            assert len(pf._pool._free) == pf._pool.allocations  # every buffer back in the pool
        if mode == "auto":  # several chunks per call, several calls per batch (hot set of 4 chunks)
            assert len(calls) > len(data) and max(calls) > 1 and max(calls) <= 4, calls
        else:
            assert calls == []


def test_a_failed_stage_call_arrives_after_the_batches_before_it(monkeypatch):
    from gpufeed import _hostcopy, staging

    if staging.STAGE_COPY != "auto" or _hostcopy.load() is None:
        pytest.skip(f"compiled copy not in use: {_hostcopy.status}")
    stage, n = _hostcopy.stage, []

    def failing(lib, work, *a):
        n.append(1)
        if len(n) == 6:  # issue the first chunk of this group, then fail as a driver error would
            stage(lib, work[:1], *a)
            raise _hostcopy.StageError("gpufeed: CUDA driver error 700 (CUDA_ERROR_ILLEGAL_ADDRESS)", 1)
        return stage(lib, work, *a)

    monkeypatch.setattr(_hostcopy, "stage", failing)
    data = [{"x": torch.full((1 << 20,), i, dtype=torch.uint8)} for i in range(8)]  # one chunk, one call each
    with CudaPrefetcher(data, depth=2, chunk_bytes=1 << 20) as pf:
        got = []
        with pytest.raises(_hostcopy.StageError, match="error 700"):
            for b in pf:
                got.append(int(b["x"][0]))
        assert got == [0, 1, 2, 3, 4]
        pf._pool.clear()  # waits for the issued copy; every buffer was returned
        assert pf._pool.allocated == 0


def test_staged_leaves_of_every_shape_and_dtype_arrive_as_contiguous_tensors_of_their_own():
    """The staged leaves of a batch are views of one device allocation: each has its shape, dtype and
    contiguous strides, its bytes exact, and writing one leaves the others intact."""
    g = torch.Generator().manual_seed(3)
    batch = {"scalar": torch.tensor(2.5, dtype=torch.float64), "cube": torch.randn(3, 5, 7, generator=g),
             "c": torch.randn(9, generator=g, dtype=torch.complex64), "b": torch.rand(13, generator=g) > 0.5,
             "t": torch.randn(6, 4, generator=g).t(),  # not contiguous on the host
             "odd": torch.randint(0, 255, (1001,), dtype=torch.uint8),
             "bf": torch.randn(17, 3, generator=g).bfloat16()}
    with CudaPrefetcher([batch, batch], depth=2) as pf:
        got = list(pf)
    torch.cuda.synchronize()
    for out in got:
        for k, v in batch.items():
            assert out[k].shape == v.shape and out[k].dtype == v.dtype and out[k].is_contiguous(), k
            assert torch.equal(out[k].cpu(), v), k
    got[0]["cube"].fill_(0)
    assert torch.equal(got[0]["odd"].cpu(), batch["odd"])
    assert torch.equal(got[0]["scalar"].cpu(), batch["scalar"])


def test_a_loader_may_refill_its_pageable_tensors_once_asked_for_the_next_batch():
    """gpufeed reads a pageable batch to the end before it asks the loader for the next one: a loader that
    refills the same host tensors in place delivers every batch intact."""
    buf = {"x": torch.empty(3 << 20, dtype=torch.uint8), "y": torch.empty(1000, dtype=torch.int64)}

    def loader():
        for i in range(30):
            buf["x"].fill_(i)
            buf["y"].fill_(-i)
            yield buf

    with CudaPrefetcher(loader, depth=3, chunk_bytes=1 << 20) as pf:
        got = []
        for b in pf:
            torch.cuda._sleep(SLEEP_CYCLES)
            got.append((int(b["x"].min()), int(b["x"].max()), int(b["y"].min()), int(b["y"].max())))
    assert got == [(i, i, -i, -i) for i in range(30)]


def test_driver_calls_that_keep_the_gil_agree_with_torch():
    """gpufeed._driver's event query and stream wait act as torch's own: a query answers False behind a
    long kernel and True once it completed, and a stream made to wait on an event does not start its
    work before that event."""
    from gpufeed import _driver

    side, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    ev = torch.cuda.Event()
    x = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES * 20)
        x.fill_(7)
        ev.record(side)
    assert _driver.query(ev.cuda_event) is False and ev.query() is False
    assert _driver.wait_event(consumer.cuda_stream, ev.cuda_event)
    with torch.cuda.stream(consumer):
        y = x * 2  # reads x only after the side stream's fill, through the driver's wait
    consumer.synchronize()
    assert _driver.query(ev.cuda_event) is True and ev.query() is True
    assert bool((y == 14).all())
    assert _driver.query(0) is None and not _driver.wait_event(consumer.cuda_stream, 0)  # never recorded


def test_driver_pinned_check_and_elapsed_time_agree_with_torch():
    from gpufeed import _driver

    pageable = torch.empty(1 << 20, dtype=torch.uint8)
    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    assert _driver.is_pinned(pageable.data_ptr()) is False and not pageable.is_pinned()
    assert _driver.is_pinned(pinned.data_ptr()) is True and pinned.is_pinned()
    assert _driver.is_pinned(pinned[4096:].data_ptr()) is True  # a view inside a pinned allocation
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES * 5)
    end.record()
    end.synchronize()
    assert abs(_driver.elapsed_ms(start.cuda_event, end.cuda_event) - start.elapsed_time(end)) < 1e-3


def test_copy_events_are_reused_and_batches_stay_exact(monkeypatch):
    """The copier records its timing events again once free: over 300 batches it creates a handful, and
    every batch still arrives exact behind a slow consumer (an end event is recorded again only once the
    consumer's stream waits on it)."""
    from gpufeed import _copier

    created = []

    class Counted(torch.cuda.Event):
        def __init__(self, *a, **k):
            super().__init__()
            created.append(1)

        def __new__(cls, *a, **k):
            return super().__new__(cls, enable_timing=True)

    monkeypatch.setattr(_copier.torch.cuda, "Event", Counted)
    batches = [torch.full((1 << 18,), i, dtype=torch.int32) for i in range(300)]
    with CudaPrefetcher(batches, depth=3) as pf:
        for i, b in enumerate(pf):
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            assert int(b.min()) == i and int(b.max()) == i
        assert pf.stats.batches == 300 and pf.stats.h2d_GBps > 0.5
    assert len(created) <= 24


def test_the_next_batchs_device_block_is_made_ahead_and_a_changed_batch_gets_its_own(monkeypatch):
    """While a batch stages, a worker makes the next batch's device block for the same leaves; a batch
    whose leaves differ (shape or dtype) gets a block made for it. Every batch arrives exact, and one
    kept from early on is intact at the end."""
    import threading

    from gpufeed import _copier

    made = []
    make = _copier._make_block

    def counted(signature, device, consumer):
        made.append(threading.current_thread().name)
        return make(signature, device, consumer)

    monkeypatch.setattr(_copier, "_make_block", counted)
    g = torch.Generator().manual_seed(5)
    shapes = [(4096, 16)] * 10 + [(4095, 16)] + [(4096, 16)] * 10
    batches = [{"x": torch.randn(*shape, generator=g), "i": torch.arange(shape[0]) + k}
               for k, shape in enumerate(shapes)]
    batches[15]["x"] = batches[15]["x"].double()  # a dtype change mid-epoch
    with CudaPrefetcher(batches, depth=3) as pf:
        got = []
        for b in pf:
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            got.append(b)
    torch.cuda.synchronize()
    for b, want in zip(got, batches, strict=True):
        assert torch.equal(b["x"].cpu(), want["x"]) and torch.equal(b["i"].cpu(), want["i"])
    ahead = [name for name in made if name.startswith("gpufeed-fill")]
    here = [name for name in made if not name.startswith("gpufeed-fill")]
    # made here: the first batch, the two changed ones and the two after them; ahead: one per batch (the
    # one after the last batch may be cancelled when the epoch ends)
    assert len(here) == 5 and len(batches) - 1 <= len(ahead) <= len(batches)
