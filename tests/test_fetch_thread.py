"""An epoch fetches on the loop's thread, and moves to a background thread only when that pays."""

import threading
import time

import pytest
import torch

import gpufeed._worker
import gpufeed.prefetcher
from conftest import gpufeed_threads, wait_no_threads
from gpufeed import CudaPrefetcher
from gpufeed.prefetcher import PROBE_BATCHES, _thread_pays

REAL_COST = gpufeed.prefetcher.THREAD_COST_S  # read at import, before the suite patches it
STEP_S = 2 * REAL_COST  # a step, and a fetch, that leave a thread time to pay


@pytest.fixture
def real_cost(monkeypatch):
    """The real rule instead of the suite's (a thread always pays)."""
    monkeypatch.setattr(gpufeed.prefetcher, "THREAD_COST_S", REAL_COST)


class Loader:
    """Batches ``[i] * 3``, each taking ``fetch_s`` to make; records the thread that made each."""

    def __init__(self, n, fetch_s=0.0, fail_at=None):
        self.n, self.fetch_s, self.fail_at = n, fetch_s, fail_at
        self.threads = []

    def __iter__(self):
        for i in range(self.n):
            if self.fetch_s:
                time.sleep(self.fetch_s)
            if i == self.fail_at:
                raise KeyError(f"bad sample in batch {i}")
            self.threads.append(_on_gpufeed_thread())
            yield {"x": torch.full((3,), i)}


def _on_gpufeed_thread():
    return threading.current_thread().name.startswith("gpufeed")


@pytest.mark.parametrize(("gaps", "fetches", "pays"), [
    ([2 * REAL_COST, 3 * REAL_COST], [2 * REAL_COST], True),  # both leave time to hide
    ([2 * REAL_COST, 1e-5], [2 * REAL_COST], False),  # one step left no time
    ([5 * REAL_COST, 5 * REAL_COST], [5e-5], False),  # fetching takes no time (pinned batches)
    ([1e-5, 1e-5], [5 * REAL_COST], False),  # the loop never waits (no compute, or the GPU is ahead)
    ([0.5 * REAL_COST] * 2, [0.5 * REAL_COST], False),  # less to hide than the thread costs
])
def test_a_thread_pays_only_where_it_hides_more_than_it_costs(real_cost, gaps, fetches, pays):
    assert _thread_pays(gaps, fetches, gpu_busy=False) is pays
    assert not _thread_pays(gaps, fetches, gpu_busy=True)  # the GPU is the bottleneck: inline is free


def test_a_fast_loop_fetches_every_batch_on_its_own_thread(real_cost):
    loader = Loader(12)
    pf = CudaPrefetcher(loader, device="cpu")
    got = [b["x"].tolist() for b in pf]
    assert got == [[i] * 3 for i in range(12)]
    assert not any(loader.threads)
    assert pf.stats.threaded_batches == 0 and "0 fetched on the background thread" in pf.stats.summary()


def test_a_loop_that_leaves_time_moves_the_fetching_to_a_thread(real_cost):
    loader = Loader(8, fetch_s=STEP_S)
    got = []
    pf = CudaPrefetcher(loader, device="cpu", depth=2)
    for b in pf:
        got.append(b["x"].tolist())
        time.sleep(STEP_S)  # a step
    assert got == [[i] * 3 for i in range(8)]
    assert pf.stats.threaded_batches == 8 - PROBE_BATCHES
    # the probe's batches on the loop's thread, the rest on the background thread
    assert loader.threads == [False] * PROBE_BATCHES + [True] * (8 - PROBE_BATCHES)
    assert wait_no_threads() < 5


def test_each_epoch_decides_again(real_cost):
    loader = Loader(6, fetch_s=STEP_S)
    pf = CudaPrefetcher(loader, device="cpu")
    for _ in pf:
        time.sleep(STEP_S)
    assert loader.threads[-1]
    loader.threads.clear()
    loader.fetch_s = 0.0
    assert [b["x"][0].item() for b in pf] == list(range(6))  # no time to hide now
    assert not any(loader.threads)
    pf.close()


@pytest.mark.parametrize("fail_at", [1, PROBE_BATCHES, PROBE_BATCHES + 2])
def test_an_error_arrives_at_its_batch_before_and_after_the_move(real_cost, fail_at):
    loader = Loader(8, fetch_s=STEP_S, fail_at=fail_at)
    got = []
    with pytest.raises(KeyError, match=f"batch {fail_at}"):
        for b in CudaPrefetcher(loader, device="cpu"):
            got.append(b["x"][0].item())
            time.sleep(STEP_S)
    assert got == list(range(fail_at))
    assert wait_no_threads() < 5


def test_break_after_the_move_stops_the_thread(real_cost):
    loader = Loader(1000, fetch_s=STEP_S)
    pf = CudaPrefetcher(loader, device="cpu")
    for i, _ in enumerate(pf):
        time.sleep(STEP_S)
        if i == PROBE_BATCHES + 2:
            assert gpufeed_threads()
            break
    assert wait_no_threads() < 5
    pf.close()


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_cuda_inline_keeps_depth_batches_copied_ahead(monkeypatch, depth):
    monkeypatch.setattr(gpufeed.prefetcher, "THREAD_COST_S", float("inf"))  # never moves
    pulled = []

    def loader():
        for i in range(10):
            pulled.append(i)
            yield {"x": torch.full((1 << 16,), i, dtype=torch.int32)}

    got = []
    with CudaPrefetcher(loader, device="cuda", depth=depth) as pf:
        for b in pf:
            assert len(pulled) == min(10, len(got) + 1 + depth)
            assert not gpufeed_threads()
            got.append(b["x"])
        torch.cuda.synchronize()
    assert [int(t.float().mean().item()) for t in got] == list(range(10))
    assert all(int(t.min()) == int(t.max()) for t in got)


def test_ctrl_c_in_an_inline_read_is_raised_at_once_not_after_the_batches_made_ahead(monkeypatch):
    import _thread

    monkeypatch.setattr(gpufeed.prefetcher, "THREAD_COST_S", float("inf"))  # stays inline

    class Slow:
        closed = False

        def __iter__(self):
            try:
                for i in range(10):
                    if i == 4:  # Ctrl-C lands in this read (inline: on the loop's thread), whatever the load
                        _thread.interrupt_main()
                        time.sleep(0.5)
                    yield {"x": torch.tensor([i])}
            finally:
                Slow.closed = True

    it = iter(CudaPrefetcher(Slow(), device="cpu", depth=2))
    it._keep_ahead = 2  # the CUDA look-ahead: batches made ahead of the one returned
    assert [next(it)["x"].item() for _ in range(2)] == [0, 1]
    with pytest.raises(KeyboardInterrupt):
        next(it)  # makes batch 4 ahead, before returning batch 2
    assert Slow.closed
    with pytest.raises(StopIteration):
        next(it)


def test_close_from_another_thread_while_the_fetch_thread_starts(monkeypatch):
    pf = CudaPrefetcher([{"x": torch.tensor([i])} for i in range(50)], device="cpu", depth=2)
    it = iter(pf)
    next(it), next(it)

    class Slots(gpufeed._worker.Slots):
        def __init__(self, n):  # the close() lands while the epoch hands over to its thread
            super().__init__(n)
            closer = threading.Thread(target=pf.close)
            closer.start()
            closer.join()

    monkeypatch.setattr(gpufeed._worker, "Slots", Slots)
    with pytest.raises(RuntimeError, match="stopped: the CudaPrefetcher was closed"):
        next(it)
    assert wait_no_threads() < 5


def test_a_batch_the_thread_finishes_after_another_thread_closed_is_not_handed_out():
    """As on the loop's thread: the loop gets the stop error, not the batch being made when close() ran."""
    stops = []

    class Waits:
        def __iter__(self):
            for i in range(10):
                if i == 5:
                    assert stops[0].wait(5)  # batch 5 is finished only once close() has stopped the epoch
                yield {"x": torch.tensor([i])}

    pf = CudaPrefetcher(Waits(), device="cpu", depth=1)
    it = iter(pf)
    stops.append(it._stop)
    assert [next(it)["x"].item() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert it._thread is not None  # (the suite's rule: a thread always pays)
    closer = threading.Timer(0.1, pf.close)
    closer.start()
    with pytest.raises(RuntimeError, match="stopped: the CudaPrefetcher was closed"):
        next(it)
    closer.join()
    assert wait_no_threads() < 5
