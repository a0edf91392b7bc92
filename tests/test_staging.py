"""The pinned pool and the chunk pipeline, on plain host memory (pinning needs CUDA)."""

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gpufeed.staging import ChunkPipeline, PinnedPool, plan_leaf_chunks

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


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "workers"])  # fills here or on workers
@pytest.mark.parametrize("fill_bytes", [None, 4096, 5000], ids=["torch", "threads", "threads-odd"])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 100_000, 1 << 20])
def test_pipeline_copies_every_byte(nbytes, fill_bytes, inline, monkeypatch):
    import gpufeed.staging as staging

    if not inline:
        monkeypatch.setattr(staging, "INLINE_BYTES", 0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    pool = PinnedPool(budget=64 << 10, chunk_bytes=16 << 10, pin=False)
    chunks = plan_leaf_chunks(src, dst, 16 << 10, fill_bytes)
    if fill_bytes is not None:  # memmove pieces on the workers, none bigger than fill_bytes
        assert all(not c.segments and len(c.fills) == -(-c.nbytes // fill_bytes) for c in chunks)
    with ThreadPoolExecutor(4) as ex:
        ChunkPipeline(pool, ex, None, max_in_flight=8).run(chunks, STOP)
    assert torch.equal(src, dst)
    assert pool.allocated <= 64 << 10


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "workers"])
def test_pipeline_error_in_a_fill_is_raised_and_buffers_come_back(inline, monkeypatch):
    import gpufeed.staging as staging

    if not inline:
        monkeypatch.setattr(staging, "INLINE_BYTES", 0)
    pool = PinnedPool(budget=64 << 10, chunk_bytes=16 << 10, pin=False)
    src = torch.zeros(64 << 10, dtype=torch.uint8)
    dst = torch.empty_like(src)
    chunks = plan_leaf_chunks(src, dst, 16 << 10)

    def bad(buf):
        raise OSError("disk gone")

    chunks[2].segments = []
    chunks[2].fills = [lambda buf: None, bad]
    with ThreadPoolExecutor(2) as ex, pytest.raises(OSError, match="disk gone"):
        ChunkPipeline(pool, ex, None, max_in_flight=8).run(chunks, STOP)
    assert len(pool._free) == pool.allocations  # every buffer is back in the pool


@pytest.mark.parametrize("fill_bytes", [None, 4096], ids=["torch", "threads"])
def test_leaves_are_laid_end_to_end_and_copied_exactly(fill_bytes):
    from gpufeed.staging import plan_chunks

    g = torch.Generator().manual_seed(0)
    sizes = (1, 3, 1000, 4097, 20000)
    srcs = [torch.randint(0, 1 << 30, (k,), generator=g, dtype=torch.int32) for k in sizes]
    srcs.append(torch.rand(33, 7, generator=g).to(torch.bfloat16))
    srcs.append(torch.randint(0, 256, (100_000,), generator=g, dtype=torch.uint8))
    dsts = [torch.empty_like(s) for s in srcs]
    chunks = plan_chunks(list(zip(srcs, dsts, strict=True)), 16 << 10, fill_bytes)
    assert all(c.nbytes <= 16 << 10 for c in chunks)
    aligned = sum(-(-s.numel() * s.element_size() // 64) * 64 for s in srcs)
    assert len(chunks) == -(-aligned // (16 << 10))  # leaves share chunks: as many as their bytes need
    pool = PinnedPool(budget=256 << 10, chunk_bytes=16 << 10, pin=False)
    with ThreadPoolExecutor(3) as ex:
        ChunkPipeline(pool, ex, None, max_in_flight=8).run(chunks, STOP)
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts, strict=True))
    assert len(pool._free) == pool.allocations


def test_a_batch_of_several_tensors_takes_the_chunks_of_one_tensor_of_its_bytes():
    """A 64 MiB batch of a 60 MiB tensor and three small ones is two 32 MiB chunks, as 64 MiB in one."""
    from gpufeed.staging import plan_chunks

    mib = 1 << 20
    leaves = [(torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8))
              for n in (60 * mib, 2 * mib, mib, mib)]
    chunks = plan_chunks(leaves, 32 * mib)
    assert [c.nbytes for c in chunks] == [32 * mib, 32 * mib]
    assert [len(c.segments) for c in chunks] == [1, 4]  # the tail of the big one and the three small ones


class _InFlight:
    """A stand-in for a CUDA event whose copy completes when ``done`` is set."""

    cuda_event = 0  # no driver event: the pool asks query(), as it does of an event never recorded

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def record(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        self.done = True


def test_pool_waits_for_a_buffer_in_flight_rather_than_grow_past_the_hot_set():
    pool = PinnedPool(budget=1 << 20, chunk_bytes=16 << 10, pin=False)
    assert pool.hot_bytes == 4 * (16 << 10)
    bufs = [pool.acquire(16 << 10, STOP) for _ in range(4)]
    events = []
    for buf in bufs:  # each released behind a copy that has not completed yet
        buf.event = _InFlight()
        buf.busy = True
        events.append(buf.event)
        pool.release(buf, None)
    assert pool.try_acquire(16 << 10, hot=True) is None  # the budget has room, but the hot set is full
    assert pool.allocations == 4
    events[2].done = True
    assert pool.try_acquire(16 << 10, hot=True) is bufs[2]  # the first copy to complete frees its buffer
    grown = pool.try_acquire(16 << 10)  # without hot (source reads), the pool grows within its budget
    assert grown is not None and pool.allocations == 5
    big = pool.try_acquire(64 << 10, hot=True)  # nothing in flight could serve this one: it is allocated
    assert big is not None and big.nbytes == 64 << 10 and pool.allocations == 6


def test_stage_copy_setting_is_checked():
    import subprocess
    import sys

    env = {**__import__("os").environ, "GPUFEED_STAGE_COPY": "bogus"}
    r = subprocess.run([sys.executable, "-c", "import gpufeed"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "GPUFEED_STAGE_COPY must be 'auto', 'torch' or 'threads', got 'bogus'" in r.stderr
    env["GPUFEED_STAGE_COPY"] = "threads"
    r = subprocess.run([sys.executable, "-c", "import gpufeed.staging as s; print(s.STAGE_COPY)"], env=env,
                       capture_output=True, text=True)
    assert r.stdout.strip() == "threads"
    env["GPUFEED_COPY_THREADS"] = "eight"
    r = subprocess.run([sys.executable, "-c", "import gpufeed"], env=env, capture_output=True, text=True)
    assert "GPUFEED_COPY_THREADS must be a whole number >= 0 (0: the default), got 'eight'" in r.stderr
    env["GPUFEED_COPY_THREADS"] = "3"
    code = "import gpufeed.staging as s; print(s.copy_threads())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.stdout.strip() == "3"


def test_a_small_chunk_is_filled_without_waking_a_worker():
    """Chunks up to INLINE_BYTES are filled on the calling thread; bigger ones by the workers."""
    import gpufeed.staging as staging

    class Counting(ThreadPoolExecutor):
        submitted = 0

        def submit(self, *a, **k):
            Counting.submitted += 1
            return super().submit(*a, **k)

    for nbytes, workers in ((staging.INLINE_BYTES, False), (staging.INLINE_BYTES + 4096, True)):
        Counting.submitted = 0
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        pool = PinnedPool(budget=64 << 20, chunk_bytes=8 << 20, pin=False)
        with Counting(2) as ex:
            chunks = plan_leaf_chunks(src, dst, 8 << 20, 1 << 20)
            ChunkPipeline(pool, ex, None, max_in_flight=8).run(chunks, STOP)
        assert torch.equal(src, dst)
        assert (Counting.submitted > 0) == workers, (nbytes, Counting.submitted)


# -- the compiled staging copy (_hostcopy) ---------------------------------------------------------------

needs_cc = pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here"
)


def _segments(seed, sizes):
    """Host sources of ``sizes`` bytes and their places, 64-byte aligned, in one destination buffer."""
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    offs, off = [], 0
    for n in sizes:
        offs.append(off)
        off = -(-(off + n) // 64) * 64
    return srcs, offs, off


SIZES = [1, 63, 4096, 65_536, 262_144, 262_145, 1_000_003, 3 << 20]


@pytest.mark.parametrize("mode", ["auto", "torch"])
def test_fill_segments_copies_every_byte_in_place(mode, monkeypatch):
    import gpufeed.staging as staging

    monkeypatch.setattr(staging, "STAGE_COPY", mode)
    srcs, offs, total = _segments(1, SIZES)
    buf = torch.full((total + 64,), 0xAB, dtype=torch.uint8)
    staging.fill_segments(buf, list(zip(srcs, offs, strict=True)))
    for src, off in zip(srcs, offs, strict=True):
        assert torch.equal(buf[off : off + src.numel()], src)
    gaps = torch.ones(total + 64, dtype=torch.bool)
    for src, off in zip(srcs, offs, strict=True):
        gaps[off : off + src.numel()] = False
    assert bool((buf[gaps] == 0xAB).all())  # nothing written outside the segments


@needs_cc
def test_the_compiled_copy_is_built_and_used(tmp_path, monkeypatch):
    from gpufeed import _hostcopy

    monkeypatch.setenv("GPUFEED_CACHE", str(tmp_path))
    monkeypatch.setattr(_hostcopy, "_tried", False)
    monkeypatch.setattr(_hostcopy, "_lib", None)
    lib = _hostcopy.load()
    assert lib is not None and _hostcopy.status.startswith("built ") and str(tmp_path) in _hostcopy.status
    assert len(list(tmp_path.glob("hostcopy-*.so"))) == 1
    srcs, offs, total = _segments(2, SIZES)
    buf = torch.zeros(total, dtype=torch.uint8)
    parts = [(s.data_ptr(), o, s.numel()) for s, o in zip(srcs, offs, strict=True)]
    _hostcopy.copy(lib, buf.data_ptr(), parts, 5)
    assert all(torch.equal(buf[o : o + s.numel()], s) for s, o in zip(srcs, offs, strict=True))


@needs_cc
def test_the_compiled_copy_is_never_built_in_or_loaded_from_a_folder_others_can_write(tmp_path, monkeypatch):
    import tempfile

    from gpufeed import _hostcopy

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("GPUFEED_CACHE", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(_hostcopy, "_tried", False)
    monkeypatch.setattr(_hostcopy, "_lib", None)
    assert _hostcopy.load() is not None
    assert list(shared.iterdir()) == []  # nothing built or loaded there
    built = list((tmp_path / "tmp").glob("gpufeed-*/hostcopy-*.so"))
    assert len(built) == 1 and str(built[0]) in _hostcopy.status
    assert built[0].parent.stat().st_mode & 0o077 == 0  # the fallback folder is private


def test_without_a_compiler_staging_falls_back_to_torch(tmp_path, monkeypatch):
    import gpufeed.staging as staging
    from gpufeed import _hostcopy

    monkeypatch.setenv("GPUFEED_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(_hostcopy, "_tried", False)
    monkeypatch.setattr(_hostcopy, "_lib", None)
    monkeypatch.setattr(staging, "STAGE_COPY", "auto")
    srcs, offs, total = _segments(3, [1 << 20, 5])
    buf = torch.zeros(total, dtype=torch.uint8)
    staging.fill_segments(buf, list(zip(srcs, offs, strict=True)))
    assert _hostcopy.load() is None
    assert _hostcopy.status.startswith("unavailable (") and "no-such-cc" in _hostcopy.status
    assert all(torch.equal(buf[o : o + s.numel()], s) for s, o in zip(srcs, offs, strict=True))


@needs_cc
def test_the_compiled_copy_serves_threads_at_once():
    """Two prefetchers in one process stage at the same time: calls queue up, every byte lands."""
    import gpufeed.staging as staging

    if staging.STAGE_COPY != "auto":
        pytest.skip("GPUFEED_STAGE_COPY is set")
    errors = []

    def work(seed):
        try:
            for i in range(20):
                srcs, offs, total = _segments(seed * 100 + i, [700_001, 262_144, 3])
                buf = torch.zeros(total, dtype=torch.uint8)
                staging.fill_segments(buf, list(zip(srcs, offs, strict=True)))
                assert all(torch.equal(buf[o : o + s.numel()], s) for s, o in zip(srcs, offs, strict=True))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)


@needs_cc
def test_the_compiled_copy_works_in_a_forked_child_even_mid_copy():
    """A child forked while another thread copies gets its own team (the parent's threads are not there)."""
    import gpufeed.staging as staging

    if staging.STAGE_COPY != "auto":
        pytest.skip("GPUFEED_STAGE_COPY is set")
    srcs, offs, total = _segments(4, [4 << 20])
    segs = list(zip(srcs, offs, strict=True))
    staging.fill_segments(torch.zeros(total, dtype=torch.uint8), segs)  # the parent's team exists
    stop = threading.Event()

    def busy():
        buf = torch.zeros(total, dtype=torch.uint8)
        while not stop.is_set():
            staging.fill_segments(buf, segs)

    t = threading.Thread(target=busy)
    t.start()
    try:
        for _ in range(5):
            pid = os.fork()
            if pid == 0:  # the child: copy, check, leave without running the parent's cleanup
                ok = False  # (no torch op that runs OpenMP here: torch's own hang in a forked child)
                try:
                    buf = torch.empty(total, dtype=torch.uint8)
                    staging.fill_segments(buf, segs)
                    ok = buf.numpy().tobytes() == srcs[0].numpy().tobytes()
                finally:
                    os._exit(0 if ok else 3)
            deadline = time.monotonic() + 30
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if done[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung in the compiled copy")
            assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        stop.set()
        t.join(30)


@pytest.mark.parametrize("chunk_bytes", [4096, 5000, 1 << 20])
def test_plan_raw_moves_every_leaf_into_its_place_in_the_block(chunk_bytes):
    """plan_raw's chunks, carried out by memmove (fill, then send), leave each leaf at its layout offset."""
    import ctypes

    from gpufeed.staging import layout, plan_raw

    srcs, _, _ = _segments(5, [1, 63, 4096, 70_001, 8, 300_000])
    sizes = [s.numel() for s in srcs]
    offsets, total = layout(sizes)
    block = torch.zeros(total, dtype=torch.uint8)
    chunks = plan_raw([(s.data_ptr(), s.numel()) for s in srcs], chunk_bytes, block.data_ptr())
    assert all(c.nbytes <= chunk_bytes for c in chunks)
    assert len(chunks) == -(-total // (chunk_bytes // 64 * 64))
    buf = torch.empty(chunk_bytes, dtype=torch.uint8)
    for c in chunks:
        buf.fill_(0xEE)
        for addr, off, n in c.segments:
            ctypes.memmove(buf.data_ptr() + off, addr, n)
        for dev, off, n in c.copies:
            ctypes.memmove(dev, buf.data_ptr() + off, n)
    for src, off in zip(srcs, offsets, strict=True):
        assert torch.equal(block[off : off + src.numel()], src)


@pytest.mark.parametrize("fill_bytes", [None, 4096], ids=["inline", "threads"])
def test_plan_chunks_into_one_block_puts_each_leaf_at_its_layout_offset(fill_bytes):
    """With a block (the device allocation of a batch; host memory here), each chunk is one copy and
    every leaf lands at the offset :func:`layout` gives it."""
    from gpufeed.staging import layout, plan_chunks

    srcs, _, _ = _segments(6, [5, 64, 20_000, 1, 40_000])
    offsets, total = layout([s.numel() for s in srcs])
    block = torch.zeros(total, dtype=torch.uint8)
    chunks = plan_chunks([(s, None) for s in srcs], 16 << 10, fill_bytes, block)
    assert all(len(c.copies) == 1 for c in chunks)
    pool = PinnedPool(budget=256 << 10, chunk_bytes=16 << 10, pin=False)
    with ThreadPoolExecutor(2) as ex:
        ChunkPipeline(pool, ex, None, max_in_flight=8).run(chunks, STOP)
    for src, off in zip(srcs, offsets, strict=True):
        assert torch.equal(block[off : off + src.numel()], src)


@needs_cc
def test_without_a_home_folder_the_compiled_copy_is_built_in_the_temp_folder(tmp_path, monkeypatch):
    import tempfile
    from pathlib import Path

    from gpufeed import _hostcopy

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("GPUFEED_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(_hostcopy, "_tried", False)
    monkeypatch.setattr(_hostcopy, "_lib", None)
    assert _hostcopy.load() is not None and str(tmp_path) in _hostcopy.status


@needs_cc
@pytest.mark.parametrize("fail_at", [None, 2])
def test_the_stage_call_fills_then_sends_each_chunk_in_order(fail_at, monkeypatch, tmp_path):
    """gpufeed_stage without a GPU: the driver's functions are stand-ins that copy into host memory and
    log the events. Every chunk is filled before it is sent, its event follows its copies, and a driver
    error stops at that chunk with the chunks before it issued whole."""
    import ctypes

    from gpufeed import _hostcopy
    from gpufeed.staging import layout, plan_raw

    monkeypatch.setenv("GPUFEED_CACHE", str(tmp_path))
    monkeypatch.setattr(_hostcopy, "_tried", False)
    monkeypatch.setattr(_hostcopy, "_lib", None)
    lib = _hostcopy.load()
    srcs, _, _ = _segments(7, [70_000, 5, 200_001, 64, 90_000])
    offsets, total = layout([s.numel() for s in srcs])
    block = torch.zeros(total, dtype=torch.uint8)  # stands in for the device allocation
    chunks = plan_raw([(s.data_ptr(), s.numel()) for s in srcs], 64 << 10, block.data_ptr())
    bufs = [torch.full((64 << 10,), 0xEE, dtype=torch.uint8) for _ in chunks]
    log = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    def h2d(dev, host, n, stream):
        if fail_at is not None and len([e for e in log if e[0] == "event"]) == fail_at:
            return 700
        ctypes.memmove(dev, host, n)
        log.append(("copy", dev))
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    def record(event, stream):
        log.append(("event", event))
        return 0

    funcs = (ctypes.cast(h2d, ctypes.c_void_p).value, ctypes.cast(record, ctypes.c_void_p).value)
    pairs = enumerate(zip(chunks, bufs, strict=True))
    work = [(b.data_ptr(), c.segments, c.copies, 1000 + i) for i, (c, b) in pairs]
    if fail_at is None:
        _hostcopy.stage(lib, work, 0, 3, funcs)
        for src, off in zip(srcs, offsets, strict=True):
            assert torch.equal(block[off : off + src.numel()], src)
        assert [e for e in log if e[0] == "event"] == [("event", 1000 + i) for i in range(len(chunks))]
        assert [k for k, _ in log] == ["copy", "event"] * len(chunks)  # one copy per chunk, then its event
    else:
        message = r"CUDA driver error 700 \(\?\) sending chunk 2"
        with pytest.raises(_hostcopy.StageError, match=message) as err:
            _hostcopy.stage(lib, work, 0, 3, funcs)
        assert err.value.issued == 2 and [k for k, _ in log] == ["copy", "event"] * 2
