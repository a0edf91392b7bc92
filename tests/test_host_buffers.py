"""Host tensors reused for CPU batches: every byte exact, and a batch the user keeps is never overwritten."""

import os

import numpy as np
import pytest
import torch

from gpufeed import CudaPrefetcher, Field, SourceLoader
from gpufeed.host_memory.cpu_buffers import CpuBuffers as HostBuffers
from gpufeed.loaders._reads import READS_AHEAD
from test_source_mode import ArraySource

FIELDS = {"x": Field("x", (3, 4), torch.float32), "y": Field("y", (), torch.int64),
          "h": Field("h", (2,), torch.bfloat16)}


def expected(src, rows):
    return {k: torch.from_numpy(a[rows]) for k, a in src.arrays.items()}


@pytest.mark.parametrize("keep", [
    lambda b: b["x"][2:],  # a view of one field
    lambda b: b["y"].numpy(),  # a numpy array
    lambda b: b["h"].untyped_storage(),  # a storage
    lambda b: b,  # the batch itself
])
def test_a_slot_is_reused_only_once_nothing_references_it(keep):
    pool = HostBuffers(slots=1)
    batch = pool.take(FIELDS, 8)
    ptr = batch["x"].data_ptr()
    kept = keep(batch)
    del batch
    busy = pool.take(FIELDS, 8)
    assert busy["x"].data_ptr() != ptr  # the one slot is busy: fresh tensors
    del busy, kept
    again = pool.take(FIELDS, 8)
    assert again["x"].data_ptr() == ptr
    assert again["x"].shape == (8, 3, 4) and again["y"].shape == (8,) and again["h"].dtype == torch.bfloat16


def test_a_free_slot_is_reused_and_a_busy_pool_gives_fresh_tensors():
    pool = HostBuffers(slots=2)
    a = pool.take(FIELDS, 8)
    ptr = a["x"].data_ptr()
    del a
    assert pool.take(FIELDS, 5)["x"].data_ptr() == ptr  # a shorter batch reuses the slot's first rows
    kept = [pool.take(FIELDS, 8) for _ in range(4)]  # 2 slots, then fresh tensors
    assert len({b["x"].data_ptr() for b in kept}) == 4
    for b in kept:
        b["x"].fill_(1)
    assert all(bool((b["x"] == 1).all()) for b in kept)


def test_cpu_batches_are_exact_and_reuse_host_tensors():
    src = ArraySource(n=103)
    with CudaPrefetcher(SourceLoader(src, batch_size=10), device="cpu", depth=2) as pf:
        ptrs = set()
        for i, batch in enumerate(pf):
            rows = np.arange(i * 10, min(103, i * 10 + 10))
            for k, t in expected(src, rows).items():
                assert torch.equal(batch[k], t), (i, k)
            ptrs.add(batch["x"].data_ptr())
    # 11 batches in at most: the one the loop holds, the two before it (the epoch frees those inside next(),
    # so that freeing costs the loop's wait, not its step), depth taken ahead, READS_AHEAD read
    assert len(ptrs) <= pf.depth + READS_AHEAD + 3


def test_kept_batches_are_never_overwritten_by_later_ones():
    src = ArraySource(n=103)
    with CudaPrefetcher(SourceLoader(src, batch_size=10), device="cpu", depth=2) as pf:
        kept, views, arrays = [], [], []
        for i, batch in enumerate(pf):
            if i % 2 == 0:
                kept.append((i, batch))
            elif i % 3 == 0:
                views.append((i, batch["x"][1:]))  # only a view of one field survives
            else:
                arrays.append((i, batch["y"].numpy()))  # only a numpy array survives
        assert len(kept) + len(views) + len(arrays) == 11
        for i, batch in kept:
            rows = np.arange(i * 10, min(103, i * 10 + 10))
            for k, t in expected(src, rows).items():
                assert torch.equal(batch[k], t), (i, k)
        for i, v in views:
            assert torch.equal(v, torch.from_numpy(src.arrays["x"][i * 10 + 1 : i * 10 + 10]))
        for i, a in arrays:
            assert np.array_equal(a, src.arrays["y"][i * 10 : min(103, i * 10 + 10)])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_waits_on_its_parents_lock():
    pool = HostBuffers(slots=2)
    kept = pool.take(FIELDS, 8)
    pool._lock.acquire()  # as if the parent's fetch thread were inside take() when it forked
    try:
        pid = os.fork()
        if pid == 0:
            ok = pool.take(FIELDS, 8)["x"].data_ptr() != kept["x"].data_ptr()
            pool.clear()
            os._exit(0 if ok else 1)
    finally:
        pool._lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
