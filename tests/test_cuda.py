"""CUDA specifics, run on the GPU machine (`pytest -m cuda`): streams, events, memory, exact bytes."""

import gc
import time
import weakref

import pytest
import torch

from conftest import sleep_cycles
from gpufeed import CudaPrefetcher, _gpu_idle

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
    with CudaPrefetcher(data, depth=depth) as pf:
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
    with CudaPrefetcher(data, depth=2) as pf:
        kept = list(pf)
    torch.cuda.synchronize()
    for b, d in zip(kept, data, strict=True):
        for k in ("x", "y", "m", "h"):
            assert torch.equal(b[k].cpu(), d[k]), k


def test_consumer_on_a_side_stream_is_fenced():
    data = host_batches(12, "unpinned", seed=3)
    expected = [digest(b["x"].cuda()).item() for b in data]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), CudaPrefetcher(data, depth=2) as pf:
        got = []
        for b in pf:
            torch.cuda._sleep(SLEEP_CYCLES)
            got.append(digest(b["x"]))
    side.synchronize()  # the digests were computed on the side stream
    assert [g.item() for g in got] == expected


def test_one_copy_stream_and_flat_memory_over_20_epochs():
    data = host_batches(8, "unpinned", seed=1, rows=(2048, 2049))
    pf = CudaPrefetcher(data, depth=3)
    stream = pf._stage.stream
    marks = []
    for _epoch in range(20):
        for b in pf:
            torch.cuda._sleep(100_000)
            b["x"].sum()
        torch.cuda.synchronize()
        gc.collect()
        host = torch.cuda.host_memory_stats()  # the pinned staging memory (torch's caching host allocator)
        marks.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
                      host["allocated_bytes.current"], host["num_host_alloc"]))
        assert pf._stage.stream is stream
    assert len(set(marks[2:])) == 1, marks  # flat after the first epochs: no pinned block made again
    pf.close()


def test_an_epoch_ends_without_waiting_for_its_copies():
    """The loop never waits for copies at an epoch's end (it would spin until all it queued had landed):
    its stream waits on them, on the GPU; close() waits for them."""
    data = [{"x": torch.full((1 << 20,), float(i)).pin_memory()} for i in range(6)]
    pf = CudaPrefetcher(data, depth=2)
    with torch.cuda.stream(pf._stage.stream):
        torch.cuda._sleep(400_000_000)  # the copy stream busy for a few hundred ms: every copy waits
    got = [b["x"] for b in pf]
    assert not torch.cuda.current_stream().query()  # the epoch ended with its copies still queued
    assert [float(t[-1]) for t in got] == [float(i) for i in range(6)]  # exact once they land
    pf.close()


def test_small_batches_go_on_the_loop_s_stream_once_their_copy_costs_less_than_the_copy_stream():
    """A 64 KiB copy takes a few microseconds, the copy stream's own calls tens: after the first batches,
    which measure both, such batches are copied on the loop's stream, exactly."""
    data = [torch.full((1 << 14,), float(i)).pin_memory() for i in range(64)]
    with CudaPrefetcher(data) as pf:
        for _ in range(2):
            got = [b for b in pf]
            assert [float(t[0]) for t in got] == [float(i) for i in range(64)]
    assert 120 <= pf.stats.loop_stream_batches < 128  # the first ones measure the copy stream, on it
    assert pf.stats.staged_bytes == 0  # (pinned: copied as they are, never pinned again)
    big = [torch.full((16 << 20,), float(i)).pin_memory() for i in range(8)]  # 64 MiB: a millisecond a copy
    with CudaPrefetcher(big) as pf:
        assert [float(b[-1]) for b in pf] == [float(i) for i in range(8)]
    assert pf.stats.loop_stream_batches == 0


def test_a_batch_goes_on_the_loop_s_stream_where_the_gpu_idles_long_enough_to_absorb_its_copy():
    """16 MiB pinned batches (a copy of about 300 us, more than the copy stream's calls). A loop bound by
    its thread (3 ms of CPU a step, no kernel) leaves the GPU idle: once NVML has read it, the batches go on
    the loop's stream. A loop bound by its GPU (a 3 ms kernel a step, then a synchronize, as ``loss.item()``)
    leaves it idle only between steps: they stay on the copy stream. Both deliver exact bytes."""
    if _gpu_idle.busy_reader(torch.device("cuda")) is None:
        pytest.skip("NVML's utilization cannot be read here (nvidia-ml-py, the driver)")
    host = [torch.full((4 << 20,), float(i)).pin_memory() for i in range(8)]
    data = [host[i % 8] for i in range(1200)]  # (3.6 s: the idle time counts from the second reading, 2 s in)
    cycles = sleep_cycles(3)
    for bound, step in (("thread", lambda: time.sleep(0.003)),
                        ("gpu", lambda: (torch.cuda._sleep(cycles), torch.cuda.synchronize()))):
        with CudaPrefetcher(data) as pf:
            got = []
            for b in pf:
                got.append(float(b[-1]))
                step()
            assert got == [float(i % 8) for i in range(1200)]
            late = pf.stats.loop_stream_batches
        if bound == "thread":
            assert pf._stage.costs.idle_s > 0.002 and late > 400, (pf._stage.costs.idle_s, late)
        else:
            assert pf._stage.costs.idle_s < 0.0006 and late < 10, (pf._stage.costs.idle_s, late)


def test_the_gpu_s_idle_time_is_read_across_epochs_shorter_than_a_reading():
    """The same thread-bound loop in 30 epochs of 40 batches (0.12 s each): the readings run on across
    epochs, so the later epochs' batches go on the loop's stream, exactly."""
    if _gpu_idle.busy_reader(torch.device("cuda")) is None:
        pytest.skip("NVML's utilization cannot be read here (nvidia-ml-py, the driver)")
    host = [torch.full((4 << 20,), float(i)).pin_memory() for i in range(8)]
    data = [host[i % 8] for i in range(40)]
    with CudaPrefetcher(data) as pf:
        for epoch in range(30):
            if epoch == 20:
                before = pf.stats.loop_stream_batches
            got = []
            for b in pf:
                got.append(float(b[-1]))
                time.sleep(0.003)
            assert got == [float(i % 8) for i in range(40)]
        assert pf.stats.loop_stream_batches - before > 300, pf.stats.loop_stream_batches - before


def test_the_time_between_epochs_does_not_read_as_idle_time():
    """GPU-bound steps of 20 ms (a kernel, then a synchronize) in epochs of 10 batches, each epoch started by
    a loader that takes 15 ms for its first batch (a persistent worker's start, shorter than a step) and
    followed by 50 ms of the loop's own code, the GPU idle meanwhile. NVML's samples hold a quarter of idle
    time there; the readings take it off, so the 16 MiB batches (a copy of about 300 us) stay on the copy
    stream."""
    if _gpu_idle.busy_reader(torch.device("cuda")) is None:
        pytest.skip("NVML's utilization cannot be read here (nvidia-ml-py, the driver)")
    host = [torch.full((4 << 20,), float(i)).pin_memory() for i in range(10)]

    def epoch():
        time.sleep(0.015)
        yield from host

    cycles = sleep_cycles(20)
    with CudaPrefetcher(epoch) as pf:
        for _ in range(20):
            got = []
            for b in pf:
                got.append(float(b[-1]))
                torch.cuda._sleep(cycles)
                torch.cuda.synchronize()
            assert got == [float(i) for i in range(10)]
            time.sleep(0.05)
        assert pf._stage.idle is not None and pf._stage.idle._last is not None  # (the readings were taken)
        assert pf._stage.costs.idle_s < 0.001 and pf.stats.loop_stream_batches < 10, (
            pf._stage.costs.idle_s, pf.stats.loop_stream_batches)


def test_small_pageable_batches_are_pinned_and_copied_on_the_loop_s_stream_exactly():
    """A small pageable batch goes on the loop's stream too, pinned leaf by leaf (small leaves packed)
    and copied as ``pin_memory()`` + ``.to(non_blocking=True)`` would, its bytes exact while the host
    tensors are overwritten right after ``next()``."""
    data = [{"x": torch.full((1 << 16,), float(i)), "y": torch.arange(8) + i, "z": torch.tensor(i)}
            for i in range(40)]
    src = [{k: v.clone() for k, v in b.items()} for b in data]
    with CudaPrefetcher(src) as pf:
        got = []
        for i, b in enumerate(pf):
            got.append(b)
            for v in src[i].values():
                v.zero_()
            torch.cuda._sleep(200_000)  # the loop's stream busy: copies queued on it land later
        torch.cuda.synchronize()
    for g, d in zip(got, data, strict=True):
        assert all(torch.equal(g[k].cpu(), d[k]) for k in d)
    assert pf.stats.loop_stream_batches >= 36 and pf.stats.staged_bytes == pf.stats.bytes


@pytest.mark.parametrize("kind", ["tensor", "tuple"])
def test_a_small_batch_none_of_whose_leaves_pack_is_pinned_leaf_by_leaf_on_the_loop_s_stream(kind):
    """A bare tensor, or a tuple whose one small leaf packs with none (the batches the flat path pins leaf
    by leaf): on the loop's stream, the bytes exact, a pinned leaf never staged; each pageable leaf pinned
    once by the stager's pin, never through ``Stager.send`` (the stager's own path on the loop's stream)."""
    def batch(i):
        x = torch.full((1 << 16,), float(i))
        pinned = torch.full((1 << 15,), float(i)).pin_memory()
        return x if kind == "tensor" else (x, torch.arange(8) + i, pinned)

    data = [batch(i) for i in range(40)]
    src = [b.clone() if kind == "tensor" else tuple(t.clone() for t in b) for b in data]
    if kind == "tuple":
        src = [(x, y, data[i][2]) for i, (x, y, _) in enumerate(src)]  # (the pinned leaf is read as it is)
    with CudaPrefetcher(src) as pf:
        calls = {"send": 0, "pinned": 0}
        for name in calls:  # (spies on the stager's two ways to pin)
            setattr(pf._stage.stager, name, _counted(getattr(pf._stage.stager, name), name, calls))
        got = []
        for i, b in enumerate(pf):
            got.append(b)
            for t in [src[i]] if kind == "tensor" else src[i][:2]:
                t.zero_()
            torch.cuda._sleep(200_000)  # the loop's stream busy: copies queued on it land later
        torch.cuda.synchronize()
    for g, d in zip(got, data, strict=True):
        if kind == "tensor":
            assert torch.equal(g.cpu(), d)
        else:
            assert type(g) is tuple and all(torch.equal(a.cpu(), b) for a, b in zip(g, d, strict=True))
    assert pf.stats.loop_stream_batches >= 36
    pinned = 0 if kind == "tensor" else 40 * (1 << 17)
    assert pf.stats.staged_bytes == pf.stats.bytes - pinned
    assert calls == {"send": 0, "pinned": 40 * (1 if kind == "tensor" else 2)}  # (the copy stream's too)


def _counted(fn, name, calls):
    def counted(*args):
        calls[name] += 1
        return fn(*args)
    return counted


def test_a_batch_the_loop_lets_go_of_is_freed_before_its_next_call():
    """Nothing of gpufeed's holds a batch once handed over: ``del`` frees its device memory at once."""
    with CudaPrefetcher([torch.full((1 << 16,), float(i)).pin_memory() for i in range(8)]) as pf:
        it = iter(pf)
        for _ in range(3):
            batch = next(it)
            held = weakref.ref(batch)
            del batch
            assert held() is None


def test_the_link_is_measured_once_as_a_latency_and_a_rate():
    from gpufeed._device import link_cost

    device = torch.device("cuda", torch.cuda.current_device())
    latency, rate = link_cost(device)
    assert 0 <= latency < 1e-3 and 1e9 < rate < 1e12  # (PCIe 3 x16 to NVLink-C2C)
    assert link_cost(device) == (latency, rate)


class _CollectsInWorker(torch.utils.data.Dataset):
    """8 samples; reading one runs a full collection in the DataLoader's worker."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        gc.collect()
        return torch.tensor([i])


def test_cuda_objects_in_a_reference_cycle_are_never_collected_in_a_forked_worker():
    """A prefetcher (its stream and events) and its batches left in a cycle when a DataLoader forks its
    workers: collected there, an event or a pinned block would make a CUDA call and abort the worker. The
    collector's objects are frozen while the workers start, so no worker frees them."""
    class Cycle:
        def __init__(self, *held):
            self.me, self.held = self, held

    gc.disable()
    try:
        pf = CudaPrefetcher([torch.randn(1 << 18).pin_memory() for _ in range(4)])
        Cycle(pf, list(pf), pf._stage)
        del pf
        loader = torch.utils.data.DataLoader(_CollectsInWorker(), batch_size=2, num_workers=2,
                                             multiprocessing_context="fork")
        for _ in range(2):
            with CudaPrefetcher(loader) as pf:
                assert [b.tolist() for b in pf] == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    finally:
        gc.enable()


def test_a_prefetcher_left_in_a_cycle_never_aborts_a_plain_dataloader_s_workers_later():
    """A prefetcher kept in a cycle by a frame (an exception's traceback, as a trainer's loop leaves one)
    after it ran; later a DataLoader that gpufeed does not wrap forks workers that collect: none may free
    the prefetcher's events there (each would make a CUDA call and abort the worker)."""
    def train():
        pf = CudaPrefetcher([torch.randn(1 << 16) for _ in range(8)])
        try:
            for _ in pf:
                raise KeyError("stop")
        except KeyError as exc:
            failed = exc  # this frame -> failed -> its traceback -> this frame: a cycle holding pf
        pf.close()
        return failed is not None

    gc.disable()
    try:
        assert train()
        loader = torch.utils.data.DataLoader(_CollectsInWorker(), batch_size=2, num_workers=2,
                                             multiprocessing_context="fork")
        assert [b.tolist() for b in loader] == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    finally:
        gc.enable()


def test_device_defaults_to_the_current_cuda_device_and_transform_runs_there():
    data = [torch.arange(256, dtype=torch.uint8).view(16, 16) for _ in range(4)]
    with CudaPrefetcher(data, transform=lambda t: t.float().mul_(0.25)) as pf:
        assert pf.device == torch.device("cuda", torch.cuda.current_device())
        out = list(pf)
    assert all(o.is_cuda and o.dtype == torch.float32 for o in out)
    assert torch.equal(out[0].cpu(), data[0].float() * 0.25)  # exact in float32


def test_pinning_that_fails_falls_back_to_pageable_copies_with_one_warning(monkeypatch):
    import gpufeed.host_memory as hm

    def refuse(t):
        raise hm.PinnedUnavailable("pinned allocation failed: test")

    monkeypatch.setattr(hm, "pin", refuse)
    monkeypatch.setattr(hm, "pinned_empty", refuse)
    data = host_batches(4, "unpinned", seed=5)
    with (
        pytest.warns(RuntimeWarning, match="pinned memory is unavailable") as rec,
        CudaPrefetcher(data) as pf,
    ):
        got = [list(pf) for _ in range(2)]
    assert len([w for w in rec if "pinned memory is unavailable" in str(w.message)]) == 1
    for epoch in got:
        assert all(torch.equal(g["x"].cpu(), d["x"]) for g, d in zip(epoch, data, strict=True))


def test_a_leaf_larger_than_a_chunk_is_staged_chunk_by_chunk_exactly(monkeypatch):
    """A 64 MiB leaf in 32 MiB chunks: 2 pinned chunks a batch, every byte exact behind a slow consumer."""
    pinned = []
    real = torch.Tensor.pin_memory

    def counted(self, *a, **k):
        pinned.append(self.nbytes)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "pin_memory", counted)
    x = torch.randn(64 << 20 >> 2)
    with CudaPrefetcher([x, x.neg(), {"small": x[:1000]}]) as pf:
        got = []
        for b in pf:
            torch.cuda._sleep(SLEEP_CYCLES)
            got.append(b)
    torch.cuda.synchronize()
    assert torch.equal(got[0].cpu(), x) and torch.equal(got[1].cpu(), x.neg())
    assert torch.equal(got[2]["small"].cpu(), x[:1000])
    # each large leaf pinned in two 32 MiB chunks; the small leaf, alone in its batch, pinned whole
    assert pinned == [32 << 20] * 4 + [x[:1000].nbytes]


def test_stats_time_the_copies():
    """The first batches, then one in ``TIME_EVERY``, have their copies timed with CUDA events, accounted even
    when a copy was still in flight as the epoch ended (``close()`` waits for it). The rate itself is shown
    by the benchmarks."""
    data = host_batches(8, "pinned", seed=9, rows=(8192, 8193))
    with CudaPrefetcher(data) as pf:
        list(pf)
    s = pf.stats
    nbytes = [sum(v.nbytes for v in b.values() if isinstance(v, torch.Tensor)) for b in data]
    assert s.batches == 8 and s.bytes == sum(nbytes)
    assert 0 < s.timed_bytes <= s.bytes and s.copy_s > 0 and s.h2d_GBps > 0


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
        assert len({t.untyped_storage().data_ptr() for t in out.values()}) == 1  # one allocation, one copy
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

    with CudaPrefetcher(loader, depth=3) as pf:
        got = []
        for b in pf:
            torch.cuda._sleep(SLEEP_CYCLES)
            got.append((int(b["x"].min()), int(b["x"].max()), int(b["y"].min()), int(b["y"].max())))
    assert got == [(i, i, -i, -i) for i in range(30)]




class Images(torch.utils.data.Dataset):
    """Item ``i``: 256 KiB whose every element says ``i``, and ``i``."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.full((1 << 16,), float(i)), i


def test_dataloader_workers_collate_into_pinned_slots_that_a_copy_reads_before_they_are_reused():
    """Each copy waits behind a sleep kernel that the transform of the batch before queued on the copy stream:
    a slot released before its copy completed would be overwritten by its worker's next batch first."""
    loader = torch.utils.data.DataLoader(Images(), batch_size=4, num_workers=2)

    def slow(batch):
        torch.cuda._sleep(5_000_000)  # on the copy stream, after this batch's copy and before the next one's
        return batch

    pf = CudaPrefetcher(loader, depth=2, transform=slow)
    for _ in range(2):
        for (x, i), start in zip(pf, range(0, 96, 4), strict=True):
            assert x.is_cuda and i.tolist() == list(range(start, start + 4))
            assert torch.equal(x[:, -1].cpu(), i.float().cpu())
            assert (x == i[:, None].float()).all()
        slots = list(pf._arena._slots.values())
        assert slots and all(s.is_pinned() for s in slots)  # registered with CUDA: the copy engine reads them
    assert pf.stats.slot_batches == 48 and pf.stats.staged_bytes == 0
    pf.close()
    assert not pf._arena._registered and not pf._arena._slots


def test_worker_slots_off_leaves_the_dataloader_hand_over_as_it_is():
    loader = torch.utils.data.DataLoader(Images(), batch_size=8, num_workers=2)
    with CudaPrefetcher(loader, worker_slots=False) as pf:
        assert [int(i[0]) for _, i in pf] == list(range(0, 96, 8))
    assert pf.stats.slot_batches == 0 and pf._arena is None


def test_slots_that_cannot_be_pinned_are_staged_with_one_warning(monkeypatch):
    """cudaHostRegister refused (the locked-memory limit): one warning, and the slots' batches are staged as
    pageable ones, exactly."""
    import gpufeed.host_memory as ws

    class Refusing:
        def cudaHostRegister(self, ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(ws.torch.cuda, "cudart", Refusing)
    loader = torch.utils.data.DataLoader(Images(), batch_size=8, num_workers=2)
    with pytest.warns(RuntimeWarning, match="cannot pin") as caught, CudaPrefetcher(loader) as pf:
        for _ in range(2):
            assert [int(i[0]) for _, i in pf] == list(range(0, 96, 8))
            assert all(torch.equal(x[:, 0], i.float()) for x, i in pf)
    assert sum("cannot pin" in str(w.message) for w in caught) == 1
    assert pf.stats.slot_batches == 48 and pf.stats.staged_bytes > 0 and not pf._arena._registered


def test_batches_dropped_before_their_hand_over_never_write_into_reused_memory():
    """An epoch broken off while its read-ahead's copies still wait on the copy stream: their device memory
    goes back to the allocator, and the loop's next allocation may get it. The loop's stream waits on those
    copies first, so a tensor the loop fills there is never overwritten by a late copy."""
    data = [torch.full((1 << 22,), float(i + 1)).pin_memory() for i in range(8)]  # 16 MiB: the copy stream
    pf = CudaPrefetcher(data, depth=3)
    it = iter(pf)
    next(it)
    with torch.cuda.stream(pf._stage.stream):
        torch.cuda._sleep(200_000_000)  # the copies issued from now on wait a while
    next(it)  # takes one more batch, whose copy waits behind the sleep
    it.close()  # dropped: batches 2-4, their copies still queued
    fresh = [torch.zeros(1 << 22, device="cuda") for _ in range(4)]  # may reuse their blocks
    torch.cuda.synchronize()
    assert all(float(t.abs().max()) == 0.0 for t in fresh)
    pf.close()
