"""Limits: a pinned budget of zero, a batch larger than the pinned budget, a low open-files limit.

The CUDA halves live in ``tests/test_cuda.py`` (``test_pinned_budget_zero_falls_back_with_one_warning``,
``test_a_leaf_larger_than_a_chunk_is_staged_chunk_by_chunk_exactly``) and in ``test_rel_gpu.py``.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from _rel import OnDisk, check_epoch, checked, keep, note, open_fds

from conftest import wait_no_threads
from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed._staging import Stager
from gpufeed._threads import Stopped
from gpufeed.host_memory import PinnedUnavailable
from gpufeed.host_memory.pinned_pool import PinnedPool
from gpufeed.sources import RawSource, plan_batches


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["loader", "source"])
def test_cpu_pinned_budget_zero_is_silent(mode, tmp_path):
    """pinned_budget=0 (a SourceLoader's) on the CPU path, which never pins, and a plain loader on the CPU
    (which has no pinned_budget): exact batches, not a single warning, no pinned memory."""
    disk = OnDisk("raw", tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mode == "source":
            loader = SourceLoader(disk.open(), batch_size=16, pinned_budget=0)
            with CudaPrefetcher(loader, device="cpu") as pf:
                for epoch in range(2):
                    check_epoch([keep(b) for b in pf], disk.data, plan_batches(disk.n, 16, epoch=epoch))
                assert loader._pool is None  # no pool is made for reads on the CPU
        else:
            data = [{"x": torch.randn(64, 8), "i": i} for i in range(20)]
            with CudaPrefetcher(data, device="cpu") as pf:
                got = [keep({"x": b["x"]}) for b in pf]
            assert all(torch.equal(g["x"], d["x"]) for g, d in zip(got, data, strict=True))
            checked(len(got))
            assert pf._arena is None  # no worker arena (nothing pinned) on the CPU
    assert [str(w.message) for w in caught] == []
    wait_no_threads()
    note("exact batches, no warning, no pool memory")


STOP = threading.Event()


@pytest.mark.timeout(30)
def test_pool_serves_a_request_larger_than_its_budget():
    """PinnedPool (pin=False): a request 16x its budget is served by one buffer; while that buffer is out
    a second request waits (bounded by its stop flag) and gets it once it is released."""
    budget = 64 << 10
    pool = PinnedPool(budget, pin=False)
    big = pool.acquire(1 << 20, STOP)
    assert big.nbytes >= 1 << 20 and pool.allocated == big.nbytes > budget
    assert pool.try_acquire(1000) is None  # over budget: nothing more is allocated
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(Stopped):
        pool.acquire(1000, stop)  # waits, and gives up when told to stop
    threading.Timer(0.1, pool.release, args=(big, None)).start()
    t0 = time.monotonic()
    again = pool.acquire(1000, STOP)  # served by the big buffer once it comes back
    waited = time.monotonic() - t0
    assert again is big and pool.allocations == 1
    pool.release(again, None)
    small = pool.acquire(2 << 20, STOP)  # bigger still: the free, too-small buffer is dropped first
    assert small.nbytes >= 2 << 20 and pool.allocated == small.nbytes and pool.allocations == 2
    pool.release(small, None)
    pool.clear()
    assert pool.allocated == 0
    note(f"served by one oversized buffer; the next request waited {waited:.2f} s for it; cleared to 0")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk", [4096, 64 << 10, 1 << 20])
def test_stager_stages_a_tensor_many_chunks_long(chunk):
    """The stager (host memory for pinned) moves a 3 MiB tensor in chunks of 4 KiB, 64 KiB or 1 MiB:
    every byte arrives in a tensor of its own, one staged block per chunk."""
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    stager = Stager(chunk, pin=False)
    staged = []
    real = stager.pinned
    stager.pinned = lambda t: (staged.append(t.numel()), real(t))[1]
    outs, jobs = stager.prepare([src], torch.device("cpu"))
    assert len(outs) == 1 and outs[0].data_ptr() != src.data_ptr()
    for job in jobs:
        job()
    assert torch.equal(outs[0], src)
    assert staged == [chunk] * ((3 << 20) // chunk)  # chunk by chunk
    checked(1, 0, src.numel())
    note("every byte staged")


def _failing_pin(monkeypatch):
    """Make every pinned allocation fail, as cudaHostAlloc does over a locked-memory limit."""
    real = torch.empty

    def empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (simulated cudaHostAlloc failure)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.timeout(30)
def test_pinned_allocation_failure_makes_the_pool_unavailable(monkeypatch):
    """Pinning fails: the pool says so (``available`` False) and hands out nothing, instead of raising
    into the consumer, so the SourceLoader reads into pageable memory (regression: finding 5)."""
    _failing_pin(monkeypatch)
    pool = PinnedPool(1 << 20, pin=True)
    assert pool.try_acquire(4096) is None and not pool.available and pool.allocated == 0
    with pytest.raises(PinnedUnavailable, match="pinned allocation failed"):
        pool.acquire(4096, STOP)
    note("try_acquire gives None, available is False, acquire raises PinnedUnavailable (the callers' cue "
         "to copy pageable)")


@pytest.mark.timeout(30)
def test_pool_with_a_budget_of_zero_hands_out_nothing():
    """A budget of 0 pins nothing, even for a request no buffer could hold (regression: finding 6)."""
    pool = PinnedPool(0, pin=False)
    assert pool.try_acquire(8192) is None and pool.allocated == 0 and not pool.available
    with pytest.raises(PinnedUnavailable, match="pinned_budget is 0"):
        pool.acquire(8192, STOP)
    note("nothing allocated; acquire raises PinnedUnavailable")


# -- a low open-files limit --------------------------------------------------------------------------

def _in_child(fn, timeout=60.0):
    """Run ``fn`` in a forked child (its limits do not touch pytest); returns what it returned (JSON)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, json.dumps(fn()).encode())
        except BaseException as exc:
            os.write(w, json.dumps({"child error": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    chunks = []
    os.set_blocking(r, False)
    while True:
        try:
            chunk = os.read(r, 65536)
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError("the child hung") from None
            time.sleep(0.01)
            continue
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


@pytest.mark.timeout(60)
def test_low_open_files_limit_multi_file_raw_source(tmp_path):
    """RLIMIT_NOFILE lowered below what a 64-file RawSource needs: the error reaches the consumer as
    OSError(EMFILE) naming a file, no hang; once the limit is raised the same source reads again."""
    paths = []
    for i in range(64):
        paths.append(tmp_path / f"part{i:02d}.npy")
        np.save(paths[-1], np.full((4, 8), i, dtype=np.int32))

    def child():
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(open_fds()) + 24, hard))
        src = RawSource(paths)  # opens files one at a time to read headers: fits
        result = {}
        try:
            with CudaPrefetcher(SourceLoader(src, batch_size=32), device="cpu") as pf:
                for _ in pf:
                    pass
            result["error"] = None
        except OSError as exc:
            result.update(error=type(exc).__name__, errno=exc.errno, message=str(exc))
        t0 = time.monotonic()
        while [t for t in threading.enumerate() if t.name.startswith("gpufeed")]:
            if time.monotonic() - t0 > 5:
                result["threads"] = "alive"
                break
            time.sleep(0.01)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        with CudaPrefetcher(SourceLoader(src, batch_size=32), device="cpu") as pf:
            values = torch.cat([b["x"][:, 0] for b in pf]).tolist()
        result["after"] = values == [i for i in range(64) for _ in range(4)]
        return result

    res = _in_child(child)
    assert res.get("error") == "OSError" and res["errno"] == errno.EMFILE, res
    assert "too many open files" in res["message"] and str(tmp_path) in res["message"], res
    assert "ulimit -n" in res["message"], res  # the fix
    assert "threads" not in res and res["after"] is True, res
    checked(8)
    note(f"OSError(EMFILE) in the consumer: '{res['message'].replace(str(tmp_path), '<dir>')}' (names the "
         "file and the fix); reads again once the limit is raised")
