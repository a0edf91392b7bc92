"""An epoch runs on the loop's thread: it takes each batch from the loader when asked, ``depth`` ahead."""

import threading
import time

import numpy as np
import pytest
import torch

from conftest import gpufeed_threads
from gpufeed import CudaPrefetcher, RawSource, SourceLoader
from gpufeed.sources import _pread


class Pulls:
    """A loader whose iterator counts the batches pulled from it and whether it was closed."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at = n, fail_at
        self.pulled = 0
        self.closed = False

    def __iter__(self):
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise KeyError(f"bad sample in batch {i}")
                self.pulled += 1
                yield {"x": torch.full((3,), i)}
        finally:
            self.closed = True


def test_each_batch_is_pulled_when_the_loop_asks_on_its_own_thread():
    loader = Pulls(5)
    got = []
    for i, batch in enumerate(CudaPrefetcher(loader, device="cpu", depth=3)):
        assert loader.pulled == min(5, i + 1 + 3)  # depth ahead
        assert not gpufeed_threads()
        got.append(batch["x"].tolist())
    assert got == [[i] * 3 for i in range(5)]
    assert loader.closed


def test_an_error_arrives_at_its_batch_and_the_loader_is_closed():
    loader = Pulls(6, fail_at=3)
    pf = CudaPrefetcher(loader, device="cpu")
    seen = []
    with pytest.raises(KeyError, match="bad sample in batch 3"):
        for batch in pf:
            seen.append(int(batch["x"][0]))
    assert seen == [0, 1, 2]
    assert loader.closed
    loader.closed, again = False, []
    with pytest.raises(KeyError, match="bad sample in batch 3"):  # the next epoch starts over
        for batch in pf:
            again.append(int(batch["x"][0]))
    assert again == [0, 1, 2] and loader.closed


def test_break_closes_the_loaders_iterator():
    loader = Pulls(10)
    pf = CudaPrefetcher(loader, device="cpu")
    it = iter(pf)
    next(it)
    next(it)
    it.close()
    assert loader.closed and loader.pulled == 2 + 2  # and depth ahead
    with pytest.raises(RuntimeError, match="stopped: closed"):
        next(it)


def test_source_batches_read_inline_are_exact(tmp_path):
    data = np.arange(1000 * 6, dtype=np.float32).reshape(1000, 6)
    np.save(tmp_path / "x.npy", data)
    with RawSource(fields={"x": tmp_path / "x.npy"}) as src:
        loader = SourceLoader(src, batch_size=64, shuffle=True, seed=3, num_threads=2)
        with CudaPrefetcher(loader, device="cpu") as pf:
            for _ in range(2):
                rows = []
                it = iter(pf)
                for batch, want in zip(it, loader.plan(pf.epoch), strict=True):
                    assert torch.equal(batch["x"], torch.from_numpy(data[want]))
                    rows.extend(want.tolist())
                assert sorted(rows) == list(range(1000))
                assert not [t for t in gpufeed_threads() if t.name == "gpufeed-fetch"]


class _OwnReads:
    """A BatchSource that reads on the thread that calls it (no ``parallel_reads``), recording which."""

    def __init__(self, src):
        self.src, self.seen = src, set()
        self.fields, self.reads_to = src.fields, "host"

    def __len__(self):
        return len(self.src)

    def read(self, rows, out):
        self.seen.add(threading.current_thread().name)
        self.src.read(rows, out)

    def close(self):
        self.src.close()


@pytest.mark.parametrize(("num_threads", "readers"), [(1, range(0, 1)), (3, range(1, 3))])
def test_reads_on_the_cpu_use_the_loops_thread_and_the_readers(tmp_path, num_threads, readers):
    """A batch read on the CPU is split among the loader's threads: the calling thread reads one piece, the
    reader threads the others."""
    data = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024)  # 16 MiB: pieces of >= 4 MiB
    np.save(tmp_path / "x.npy", data)
    with RawSource(fields={"x": tmp_path / "x.npy"}, num_threads=1) as raw:
        src = _OwnReads(raw)
        loader = SourceLoader(src, batch_size=4096, num_threads=num_threads)
        with CudaPrefetcher(loader, device="cpu") as pf:
            (batch,) = list(pf)
            assert torch.equal(batch["x"], torch.from_numpy(data))
    assert threading.main_thread().name in src.seen
    assert len([n for n in src.seen if n.startswith("gpufeed-read")]) in readers  # one may take both


@pytest.mark.skipif(_pread.backend() != "native", reason="the native reader is not built here")
def test_a_source_with_reads_of_its_own_gets_the_batch_in_one_read(tmp_path):
    """A source that spreads a read over its own threads (``parallel_reads``) is given the whole batch in
    one call on the loop's thread, whatever the loader's num_threads."""
    data = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024)
    np.save(tmp_path / "x.npy", data)
    calls = []
    with RawSource(fields={"x": tmp_path / "x.npy"}, num_threads=4) as src:
        real = src.read
        src.read = lambda rows, out: (calls.append((threading.current_thread().name, len(rows))),
                                      real(rows, out))[1]
        assert src.parallel_reads
        with CudaPrefetcher(SourceLoader(src, batch_size=4096, num_threads=3), device="cpu") as pf:
            (batch,) = list(pf)
            assert torch.equal(batch["x"], torch.from_numpy(data))
    assert calls == [(threading.main_thread().name, 4096)]


class Slow(Pulls):
    """A loader whose batch ``at`` takes ``delay`` seconds to pull."""

    def __init__(self, n, at, delay):
        super().__init__(n)
        self.at, self.delay = at, delay

    def __iter__(self):
        try:
            for i in range(self.n):
                if i == self.at:
                    time.sleep(self.delay)
                self.pulled += 1
                yield {"x": torch.full((3,), i)}
        finally:
            self.closed = True


def test_a_close_from_another_thread_during_a_read_ends_the_epoch_there():
    """The batch being read when another thread closes the prefetcher is not handed out: the loop gets the
    stop error, and the loader's iterator is closed by the time it does."""
    loader = Slow(5, at=2, delay=0.5)
    pf = CudaPrefetcher(loader, device="cpu", depth=1)
    it = iter(pf)
    assert int(next(it)["x"][0]) == 0
    closer = threading.Timer(0.1, pf.close)
    closer.start()
    with pytest.raises(RuntimeError, match="stopped: the CudaPrefetcher was closed"):
        next(it)
    closer.join()
    assert loader.closed and loader.pulled == 3


def test_ctrl_c_in_the_loader_arrives_at_its_batch_and_closes_the_epoch():
    class Interrupted(Pulls):
        def __iter__(self):
            try:
                for i in range(self.n):
                    if i == 2:
                        raise KeyboardInterrupt
                    yield {"x": torch.full((3,), i)}
            finally:
                self.closed = True

    loader = Interrupted(5)
    seen = []
    with pytest.raises(KeyboardInterrupt):  # raised when it happens: the batches taken ahead are dropped
        for batch in CudaPrefetcher(loader, device="cpu", depth=1):
            seen.append(int(batch["x"][0]))
    assert seen == [0] and loader.closed


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("stop_at", [(0, 0), (0, 5), (1, 3)])
def test_resume_inline_yields_exactly_the_rest(shuffle, stop_at):
    from test_source_mode import test_resume_yields_exactly_the_rest as resume

    resume(shuffle, 2, stop_at)


def test_static_batches_inline():
    from test_trace_and_static import test_static_batches_share_storage_and_pad_the_last as static

    static(torch.device("cpu"))
