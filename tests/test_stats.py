"""The verdict of ``PrefetchStats``: true on the loops the issue saw wrong, silent where it cannot judge, and
the same figures in ``summary()`` and ``as_dict()``. CPU runs here; the GPU's waits are marked ``cuda``."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import sleep_cycles
from gpufeed import CudaPrefetcher, PrefetchStats
from gpufeed import _starvation as starvation
from gpufeed._verdict import INPUT_BOUND_SHARE, MIN_BATCHES, WaitHistogram


def _slow(n, seconds):
    """A loader factory: ``n`` small batches, each ``seconds`` in the making (on the loop's thread)."""
    def batches():
        for i in range(n):
            time.sleep(seconds)
            yield torch.full((4,), float(i))
    return batches


def _run(loader, step_s=0.0, **kw):
    with CudaPrefetcher(loader, device="cpu", **kw) as pf:
        for _ in pf:
            if step_s:
                time.sleep(step_s)
    return pf.stats


def _loader(workers=2, n=512, batch=32):
    return DataLoader(TensorDataset(torch.randn(n, 64), torch.arange(n)), batch_size=batch,
                      num_workers=workers)


# -- the verdict on the CPU ----------------------------------------------------------------------

def test_a_loop_busier_than_its_loader_is_not_input_bound():
    """The issue's CPU loop: 20 ms a batch over a loader that keeps up (1 ms a batch; it said INPUT-BOUND
    5.7%). (A DataLoader's own next() takes 1-3 ms a batch on a loaded 2-core machine, and the end of each
    epoch joins its workers for 15 ms: 10-12% of a 20 ms loop, truly spent waiting.)"""
    s = _run(_slow(16, 0.001), step_s=0.02)
    assert s.waited_batches >= MIN_BATCHES
    assert s.starved_fraction < INPUT_BOUND_SHARE and not s.input_bound
    assert s.summary().startswith("[ok] the loop waited for data")
    assert "next step: none: the loop's own work is the limit" in s.summary()


def test_a_loader_20x_slower_than_its_loop_is_input_bound():
    s = _run(_slow(14, 0.04), step_s=0.002)
    assert s.input_bound and s.starved_fraction > 0.8
    assert s.wait_shares()["fetch"] > 0.9  # the loader's next(), on the loop's thread
    assert s.summary().startswith("[INPUT-BOUND] the loop waited for data")
    assert re.search(r"waits: loader (9\d|100)%", s.summary()), s.summary()
    assert "next step: the loader's next() is the limit" in s.summary()


def test_an_empty_loop_gets_no_verdict():
    """The README quickstart's loop, over a DataLoader with workers: freeing each batch's shared memory
    happens inside next() (the prefetcher drops it there), so the empty body measures microseconds."""
    s = _run(_loader())
    assert s.starved_fraction > 0.5 and not s.loop_did_work and not s.input_bound
    assert s.summary().startswith("[no verdict: the loop did no work (")
    assert "next step" not in s.summary()


def test_too_few_batches_get_no_verdict():
    s = _run(_slow(5, 0.02), step_s=0.001)
    assert s.verdict().label == "no verdict"
    assert s.summary().startswith(f"[no verdict: fewer than {MIN_BATCHES} batches timed after start-up]")


def test_measure_false_drops_the_verdict_and_a_non_bool_raises():
    s = _run(_slow(14, 0.01), step_s=0.002, measure=False)
    assert not s.measure and s.summary().startswith("[no verdict: measuring is off (measure=False)]")
    with pytest.raises(ValueError, match="measure must be True or False, got 'yes'"):
        CudaPrefetcher([], device="cpu", measure="yes")


def test_fields_that_do_not_apply_are_left_out_on_the_cpu():
    s = _run(_loader(), step_s=0.001)
    text = s.summary()
    for absent in ("collated into pinned slots", "H2D 0.0", "(timed batches)", "stage 0.00s", "staging",
                   "copied on the loop's stream"):
        assert absent not in text, (absent, text)
    assert "a CPU run shows no GPU waits and no H2D copy" in text


def test_as_dict_holds_the_summary_figures():
    s = _run(_slow(14, 0.02), step_s=0.004)
    d, text = s.as_dict(), s.summary()
    assert all(isinstance(v, (int, float, str)) for v in d.values()), d
    assert text.startswith(f"[{d['verdict']}]") and d["input_bound"] == 1
    assert f"next step: {d['next_step']}" in text
    waited = re.search(r"waited for data ([\d.]+)% of ([\d.]+)s", text)
    assert float(waited[1]) == pytest.approx(100 * d["starved_fraction"], abs=0.051)
    assert float(waited[2]) == pytest.approx(d["span_s"], abs=0.0051)
    assert f"{d['waited_batches']} batches timed after start-up" in text
    assert f"step {d['step_us']:.0f} us a batch" in text
    assert f"loader {d['share_fetch']:.0%}" in text
    assert f"{d['batches']} batches, {d['bytes'] / 1e9:.2f} GB" in text
    assert d["timeline"] == "loop thread" and d["loader"] == "factory" and d["depth"] == 2


# -- the next step -------------------------------------------------------------------------------

def _judged(waits, span, **kw):
    """Stats as a prefetcher leaves them: each of ``waits`` (seconds, with its ``fetch`` share etc.)."""
    s = PrefetchStats(batches=len(waits), span_s=span, depth=2, **kw)
    for w in waits:
        s.waited(w["s"], fetch=w["s"] * w.get("fetch", 0), stage=w["s"] * w.get("stage", 0),
                 copy=w["s"] * w.get("copy", 0))
    return s


def test_next_step_names_the_stage_that_holds_the_waiting():
    loader = [{"s": 0.004, "fetch": 1.0}] * 100  # 0.4 s of a 1 s span, every batch alike
    assert "raise num_workers (now 2)" in _judged(loader, 1.0, loader="DataLoader", num_workers=2).summary()
    assert "give it num_workers > 0" in _judged(loader, 1.0, loader="DataLoader").summary()
    large = _judged(loader, 1.0, loader="DataLoader", num_workers=4, bytes=100 * (32 << 20))
    assert "read with a SourceLoader" in large.summary() and "(32 MiB)" in large.summary()
    source = _judged(loader, 1.0, loader="SourceLoader")
    assert "source's reads are the limit" in source.summary() and "waits: reads 100%" in source.summary()
    staging = _judged([{"s": 0.004, "stage": 0.8, "fetch": 0.2}] * 100, 1.0, loader="DataLoader")
    assert "pinned on your thread" in staging.summary()
    h2d = _judged([{"s": 0.004, "copy": 0.9}] * 100, 1.0, device="cuda", copy_s=1.0, timed_bytes=20 << 30)
    assert "host-to-device copy is the limit (21.5 GB/s timed)" in h2d.summary()
    assert h2d.summary().startswith("[INPUT-BOUND] the GPU waited for data 40.0% of 1.00s (100 batches")


def test_waits_in_bursts_ask_for_more_depth():
    """Five batches in a hundred hold the waiting: the input keeps up on average, and more batches ahead
    absorb the slow ones."""
    s = _judged([{"s": 0.05, "fetch": 1.0}] * 5 + [{"s": 0.0}] * 95, 1.0, loader="DataLoader", num_workers=8)
    assert s.input_bound and s.burst_share == pytest.approx(1.0)
    assert "next step: raise depth (now 2)" in s.summary()


def test_a_small_share_of_waiting_is_no_verdict_of_input_bound():
    s = _judged([{"s": 0.0009, "fetch": 1.0}] * 100, 1.0, loader="DataLoader", num_workers=2)
    assert s.starved_fraction == pytest.approx(0.09) and not s.input_bound
    assert s.summary().startswith("[ok]")


def test_histogram_top_share():
    h = WaitHistogram()
    for w in [0.0] * 90 + [0.001] * 9 + [1.0]:
        h.add(w)
    assert h.count == 100
    assert h.top_share(0.1) == pytest.approx(1.0)  # the ten longest hold everything
    assert h.top_share(0.01) == pytest.approx(1.0 / 1.009)
    even = WaitHistogram()
    for _ in range(50):
        even.add(0.002)
    assert even.top_share(0.1) == pytest.approx(0.1)


# -- the GPU's waits, on simulated events -------------------------------------------------------

class _Clock:
    """A GPU timeline: events get the time the test says when recorded; ``now`` is how far the GPU ran."""

    def __init__(self):
        self.now = 0.0
        self.at = 0.0
        self.calls = {"record": 0, "query": 0, "elapsed": 0}

    def record(self, event, stream):
        self.calls["record"] += 1
        event.t = self.at

    def query(self, event):
        self.calls["query"] += 1
        return event.t <= self.now

    def elapsed(self, a, b):
        self.calls["elapsed"] += 1
        return (b.t - a.t) * 1e3


class _Event:
    def __init__(self, t=0.0):
        self.t = t

    def synchronize(self):
        pass


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(starvation, "_record", c.record)
    monkeypatch.setattr(starvation, "_query", c.query)
    monkeypatch.setattr(starvation, "_elapsed", c.elapsed)
    monkeypatch.setattr(starvation.GpuWaits, "_take", lambda self: _Event())
    monkeypatch.setattr(starvation, "FULL_BATCHES", 10**9)  # every batch measured (sampling: its own test)
    return c


def _batch(meter, clock, *, asked, handed, copied, gpu_now, fetch_s=0.0):
    """One next(): asked at ``asked`` on the GPU's clock; at the hand-over the GPU has run to ``gpu_now``
    (``handed`` is when the hand-over's event would complete), the copy completes at ``copied``."""
    clock.at, clock.now = asked, gpu_now
    meter.asked(lambda: "s", (time.perf_counter() - 1.0, meter.stats.fetch_s, 0.0))
    meter.stats.fetch_s += fetch_s
    clock.at = handed
    meter.handed("s", _Event(copied))


def test_gpu_bound_steps_wait_for_nothing(clock):
    """The step takes 10 ms on the GPU; the loop queues ahead; copies are done long before."""
    stats = PrefetchStats(device="cuda")
    meter = starvation.GpuWaits(stats)
    meter.new_epoch()
    # (batch 0 is the start-up: no event) asked k completes when step k-1 ends, 10 ms apart; the GPU lags
    for k in range(1, 20):
        _batch(meter, clock, asked=0.01 * k, handed=0.01 * k, copied=0.01 * k - 0.005, gpu_now=0.01 * (k - 2))
    clock.now = 1.0
    meter.refresh()
    assert stats.waited_batches == 18 and stats.waited_s == pytest.approx(0.0)
    assert stats.span_s == pytest.approx(0.18)  # the second step's start to the last's
    assert stats.step_us == pytest.approx(10_000) and stats.verdict().label == "ok"


def test_a_gpu_bound_batch_costs_one_event_and_three_queries(clock):
    """The GPU two steps behind, every copy done by its hand-over: one event, a few queries and one
    elapsed time (its period) a batch."""
    stats = PrefetchStats(device="cuda")
    meter = starvation.GpuWaits(stats)
    meter.new_epoch()
    for k in range(1, 101):
        _batch(meter, clock, asked=0.01 * k, handed=0.01 * k, copied=-1.0, gpu_now=0.01 * (k - 2))
    assert clock.calls["record"] == 100 and clock.calls["query"] <= 300 and clock.calls["elapsed"] <= 100
    assert stats.waited_batches == 96 and stats.waited_s == 0.0  # (two behind, one the span's start)
    meter.refresh()
    assert stats.span_s == pytest.approx(0.96)  # (97th: the GPU is at 98)


def test_past_the_first_batches_pairs_are_measured_about_one_in_sample(clock, monkeypatch):
    """After ``FULL_BATCHES``, two consecutive batches about every ``SAMPLE`` record events: the second's
    wait and period are counted, so the share stays the waits' share of the periods: here each 10 ms
    period waits 3 ms for its copy, over 8000 batches; every 16th period waits 8 ms instead, which random
    gaps sample without aliasing."""
    monkeypatch.setattr(starvation, "FULL_BATCHES", 64)
    stats = PrefetchStats(device="cuda")
    meter = starvation.GpuWaits(stats)
    meter._random.seed(0)  # (the gaps are random: this test's are always the same)
    meter.new_epoch()
    n, t = 8000, 0.0
    for k in range(1, n + 1):
        w = 0.008 if k % 16 == 0 else 0.003
        _batch(meter, clock, asked=t, handed=t, copied=t + w, gpu_now=t - 0.02)
        t += w + 0.007
    clock.now = 1e3
    meter.refresh()
    pairs = (n - 64) / (starvation.SAMPLE + 1)
    assert 64 + 2 * pairs * 0.8 < clock.calls["record"] < 64 + 2 * pairs * 1.2
    assert 63 + pairs * 0.8 < stats.waited_batches < 63 + pairs * 1.2
    truth = (15 * 0.003 + 0.008) / (15 * 0.010 + 0.013)
    assert stats.starved_fraction == pytest.approx(truth, rel=0.1)
    assert stats.step_us == pytest.approx(7000)


def test_an_event_goes_back_to_the_free_list_only_after_its_last_reading(clock, monkeypatch):
    """A refresh on another thread reads events while the loop's thread takes events from the free list:
    an event on that list is never read again. Here the free list is used as it is on CUDA, and every
    reading checks that neither event is on it."""
    monkeypatch.setattr(starvation.GpuWaits, "_take",
                        lambda self: self._free.pop() if self._free else _Event())
    stats = PrefetchStats(device="cuda")
    meter = starvation.GpuWaits(stats)
    elapsed = clock.elapsed

    def checked(a, b):
        assert all(a is not e and b is not e for e in meter._free), "an event read after it was freed"
        return elapsed(a, b)

    monkeypatch.setattr(starvation, "_elapsed", checked)
    meter.new_epoch()
    for k in range(1, 200):
        _batch(meter, clock, asked=0.01 * k, handed=0.01 * k + 0.002, copied=0.01 * k + 0.003,
               gpu_now=0.01 * k + 0.002)
    clock.now = 10.0
    meter.refresh()
    assert stats.waited_batches > 64 and stats.starved_fraction == pytest.approx(0.3)


def test_an_ok_loop_names_what_holds_it_the_gpu_or_its_own_thread():
    """On CUDA an ok verdict says what the limit is: the GPU's work, or the loop's thread where that is
    busy outside next() for nearly all of the GPU's step (a 20 ms CPU step: bench_verdict's cpu_step)."""
    gpu = PrefetchStats(device="cuda", batches=101, waited_batches=100, span_s=1.0, waited_s=0.01,
                        wall_s=0.10, wait_s=0.02)
    assert gpu.verdict().next_step == "none: the GPU's work is the limit, not the input"
    cpu_step = PrefetchStats(device="cuda", batches=101, waited_batches=100, span_s=2.04, waited_s=0.07,
                             wall_s=2.10, wait_s=0.08)
    assert cpu_step.verdict().next_step.startswith("none: the loop's own work on its thread")


def test_gpu_idle_while_the_loader_fetches_is_the_loader_s(clock):
    """Each next() takes the loader 8 ms while the 2 ms step has long finished: the GPU waits 8 ms a
    batch, all of it the loader's (the thread's whole call was a fetch)."""
    stats = PrefetchStats(device="cuda", loader="DataLoader", num_workers=1)
    meter = starvation.GpuWaits(stats)
    meter.new_epoch()
    for k in range(1, 20):
        t = 0.01 * k  # asked when the step ends (2 ms after the last hand-over); handed 8 ms later
        _batch(meter, clock, asked=t, handed=t + 0.008, copied=t - 0.001, gpu_now=t + 0.008, fetch_s=1.0)
    meter.close()
    assert stats.waited_batches == 18 and stats.waited_s == pytest.approx(18 * 0.008)
    assert stats.span_s == pytest.approx(0.18) and stats.starved_fraction == pytest.approx(0.8)
    assert stats.wait_shares()["fetch"] == pytest.approx(1.0, abs=1e-3)
    assert "raise num_workers (now 1)" in stats.summary()


def test_a_copy_not_done_when_the_stream_is_ready_is_the_copy_s(clock):
    """The copy of each batch completes 3 ms after the stream could run the step: 3 ms of a 10 ms period
    waited on the H2D copy; the epochs are measured apart (each one's first batch is its start-up)."""
    stats = PrefetchStats(device="cuda")
    meter = starvation.GpuWaits(stats)
    for _ in range(2):
        meter.new_epoch()
        for k in range(1, 12):
            t = 0.01 * k
            _batch(meter, clock, asked=t, handed=t, copied=t + 0.003, gpu_now=t - 0.02)
    clock.now = 10.0
    meter.refresh()
    assert stats.waited_batches == 2 * 10
    assert stats.waited_copy_s == pytest.approx(2 * 10 * 0.003)
    assert stats.span_s == pytest.approx(2 * 0.10)
    assert stats.wait_shares()["copy"] == pytest.approx(1.0) and stats.input_bound


def test_the_call_that_finds_the_end_pairs_with_no_batch_of_the_next_epoch(clock):
    """The last next() of an epoch records ``asked`` and hands nothing over; the next epoch's first batch
    (its start-up) is not measured against it (that would count the time between epochs)."""
    stats = PrefetchStats(device="cuda")
    meter = starvation.GpuWaits(stats)
    meter.new_epoch()
    for k in range(1, 12):
        _batch(meter, clock, asked=0.01 * k, handed=0.01 * k, copied=-1.0, gpu_now=0.01 * k)
    clock.at = 0.5
    meter.asked(lambda: "s", (time.perf_counter(), 0.0, 0.0))  # the call that finds the end
    meter.new_epoch()
    clock.at, clock.now = 60.0, 60.0  # a validation pass later: the next epoch's first hand-over
    meter.handed("s", _Event(59.0))
    assert [p.epoch for p in meter._pending] == [1]  # (one of the first epoch's, not yet read)
    meter.close()
    assert stats.waited_batches == 10 and stats.waited_s == 0.0 and stats.span_s == pytest.approx(0.1)


def test_the_gpu_readings_wait_for_a_later_event_of_the_stream(clock):
    """On the loop's thread a batch is read once the next one's ``asked`` has completed: one query, and
    never a wait for the GPU."""
    stats = PrefetchStats(device="cuda")
    meter = starvation.GpuWaits(stats)
    meter.new_epoch()
    for k in range(6):
        _batch(meter, clock, asked=float(k), handed=float(k), copied=0.0, gpu_now=-1.0)  # the GPU lags
    assert stats.waited_batches == 0 and len(meter._pending) == 6
    clock.now = 3.0  # the GPU reached the fourth batch's asked: the three before it can be read
    meter.refresh()
    assert len(meter._pending) == 3 and stats.waited_batches == 2  # (the first is the span's start)


# -- the GPU's waits, measured (run on the GPU machine: pytest -m cuda) ----------------------------

def _gpu_run(loader, step_ms, epochs=1, **kw):
    cycles = sleep_cycles(step_ms)
    with CudaPrefetcher(loader, **kw) as pf:
        for _ in range(epochs):
            for b in pf:
                torch.cuda._sleep(cycles)
                b.add_(1)
        torch.cuda.synchronize()
        s = pf.stats
        s.summary()  # reads every event the GPU reached
    return s


@pytest.mark.cuda
def test_cuda_a_gpu_bound_loop_with_a_fast_loader_is_not_input_bound():
    data = [torch.randn(64, 64).pin_memory() for _ in range(40)]
    s = _gpu_run(data, step_ms=5, epochs=2)
    assert s.waited_batches >= 64 - 2 and s.starved_fraction < 0.03, s.summary()  # (the first 64: all)
    assert s.verdict().label == "ok" and s.step_us > 4000, s.summary()


@pytest.mark.cuda
def test_cuda_a_slow_loader_is_input_bound_and_the_gaps_add_up():
    """The loader takes 10 ms a batch on the loop's thread, the GPU's step 4 ms: the GPU waits about 6 ms
    of every 10, in the loader's next()."""
    s = _gpu_run(_slow(40, 0.010), step_ms=4)
    assert s.waited_batches == 38, s.summary()
    assert s.input_bound and 0.45 < s.starved_fraction < 0.75, s.summary()
    assert 0.35 < s.span_s < 0.5 and s.waited_s <= s.span_s, s.summary()
    assert s.wait_shares()["fetch"] > 0.8, s.summary()
    assert 3000 < s.step_us < 6000, s.summary()


@pytest.mark.cuda
def test_cuda_an_empty_loop_gets_no_verdict():
    loader = DataLoader(TensorDataset(torch.randn(4096, 512)), batch_size=128, num_workers=2)
    with CudaPrefetcher(loader) as pf:
        for _ in range(2):
            for _b in pf:
                pass
    assert pf.stats.summary().startswith("[no verdict: the loop did no work ("), pf.stats.summary()


@pytest.mark.cuda
def test_cuda_measure_false_records_no_event():
    with CudaPrefetcher([torch.randn(8, 8) for _ in range(20)], measure=False) as pf:
        for _ in pf:
            pass
        assert pf._stage.meter is None and pf.stats.waited_batches == 0
    assert pf.stats.summary().startswith("[no verdict: measuring is off (measure=False)]")
