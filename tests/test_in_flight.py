"""InFlight: the copies of a prefetcher not yet seen complete, over its epochs (events faked on the CPU)."""

import gc
import weakref

import torch

from gpufeed._copier import InFlight
from gpufeed.stats import PrefetchStats


class FakeEvent:
    """A CUDA event stand-in: complete once ``done`` is set; ``synchronize`` completes it."""

    def __init__(self, at_ms=0.0):
        self.done, self.at_ms, self.waited = False, at_ms, False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = self.done = True

    def elapsed_time(self, end):
        return end.at_ms - self.at_ms


def test_collect_lets_go_of_completed_copies_in_order_and_times_the_sampled_ones():
    stats = PrefetchStats()
    flight = InFlight(stats)
    ends = [FakeEvent(at_ms=10.0 * (i + 1)) for i in range(3)]
    host = [torch.ones(4) for _ in range(3)]
    refs = [weakref.ref(t) for t in host]
    flight.add(FakeEvent(at_ms=0.0), ends[0], [host[0]], 1000)  # timed
    flight.add(None, ends[1], [host[1]], 0)
    flight.add(None, ends[2], [host[2]], 0)
    del host
    ends[1].done = True  # out of order: the first is still running, so nothing is let go of
    flight.collect()
    gc.collect()
    assert [r() is not None for r in refs] == [True, True, True] and stats.copy_s == 0
    ends[0].done = True
    flight.collect()
    gc.collect()
    assert [r() is not None for r in refs] == [False, False, True]
    assert stats.copy_s == 0.01 and stats.timed_bytes == 1000
    assert not any(e.waited for e in ends)  # collect() never waits


def test_collect_with_wait_waits_for_every_copy():
    flight = InFlight(PrefetchStats())
    ends = [FakeEvent() for _ in range(4)]
    for e in ends:
        flight.add(None, e, [torch.ones(1)], 0)
    flight.collect(wait=True)
    assert all(e.waited for e in ends) and not flight._queue


def test_close_waits_for_every_copy_and_for_one_added_after_it():
    """A copy issued while close() runs on another thread is waited for as it is added, not left behind."""
    flight = InFlight(PrefetchStats())
    before = FakeEvent()
    flight.add(None, before, [torch.ones(1)], 0)
    flight.close()
    assert before.waited and not flight._queue
    after = FakeEvent()
    flight.add(None, after, [torch.ones(1)], 0)
    assert after.waited and not flight._queue


def test_a_worker_slot_is_released_only_once_the_copy_that_read_it_completed():
    flight = InFlight(PrefetchStats())
    released = []
    ends = [FakeEvent() for _ in range(3)]
    for i, e in enumerate(ends):
        flight.add(None, e, [], 0, lambda i=i: released.append(i))
    ends[1].done = True
    flight.collect()
    assert released == []  # in order: the first copy still runs
    ends[0].done = True
    flight.collect()
    assert released == [0, 1]
    flight.close()  # waits for the last
    assert released == [0, 1, 2] and ends[2].waited
    late = FakeEvent()
    flight.add(None, late, [], 0, lambda: released.append(3))  # after close(): waited for, then released
    assert late.waited and released == [0, 1, 2, 3]
