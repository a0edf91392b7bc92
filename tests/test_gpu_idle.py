"""The GPU's idle time a step (``GpuIdle``, from NVML's utilization) and what the stream choice makes of
it (``_Costs``). CPU runs here, with the readings given; the loops on a GPU are in test_cuda.py."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

from gpufeed import PrefetchStats
from gpufeed._device import _Costs
from gpufeed._gpu_idle import EVERY_S, GpuIdle

LINK = (4e-6, 50e9)  # (latency s, bytes a second)
COPY_S = _Costs(LINK).copy_s


def _served(stats: PrefetchStats, batches: int, period_s: float, nbytes: int = 0, inline: int = 0) -> None:
    stats.batches += batches
    stats.wall_s += batches * period_s
    stats.bytes += batches * nbytes
    stats.loop_stream_batches += inline


class _Nvml:
    """NVML's samples, given: ``sample(t, busy)`` adds one ending at ``t`` (each covers the time since the
    one before); the reader returns those that begin at or after its argument, as NVML's reader does."""

    def __init__(self, busy: float = 0.0) -> None:
        self.stamps = [(0.0, busy)]
        self.asked: list[float] = []

    def sample(self, t: float, busy: float) -> None:
        self.stamps.append((t, busy))

    def until(self, t: float, busy: float | Callable[[float, float], float], every: float = 1 / 6) -> None:
        """Samples every ``every`` up to ``t``: ``busy`` each, or ``busy(start, end)``."""
        while self.stamps[-1][0] + every <= t + 1e-9:
            t0 = self.stamps[-1][0]
            self.sample(t0 + every, busy(t0, t0 + every) if callable(busy) else busy)

    def __call__(self, after: float) -> list[tuple[float, float, float]]:
        self.asked.append(after)
        return [(t0, t1, b) for (t0, _), (t1, b) in itertools.pairwise(self.stamps) if t0 >= after - 1e-9]


def _steady(busy: float, step_s: float, **served: int) -> tuple[PrefetchStats, _Nvml, GpuIdle, float | None]:
    """A reader's first call at 0 s, then readings at 1 s and 2 s over 100 steps of ``step_s`` each second,
    the GPU ``busy``: the stats, samples and reader, and the second reading (the smaller of two)."""
    stats = PrefetchStats(device="cuda")
    nvml = _Nvml()
    idle = GpuIdle(nvml, stats, COPY_S)
    idle.read(0.0)
    for t in (1.0, 2.0):
        nvml.until(t, busy)
        _served(stats, 100, step_s, **served)
        got = idle.read(t)
    return stats, nvml, idle, got


def test_the_idle_time_is_the_idle_share_of_the_loop_s_period_the_smaller_of_two_readings():
    stats = PrefetchStats(device="cuda")
    nvml = _Nvml()
    idle = GpuIdle(nvml, stats, COPY_S)
    assert idle.due == 0.0
    assert idle.read(10.0) is None  # (the first call starts the first period)
    assert idle.due == 10.0 + EVERY_S
    nvml.until(10.0, 0.0)
    nvml.until(11.0, 0.25)
    _served(stats, 100, 0.004, nbytes=1 << 20)  # (on the copy stream: its copies are not added back)
    assert idle.read(11.0) is None and nvml.asked == [10.0]  # (a first reading: 3 ms, held for a second)
    nvml.until(12.0, 0.25)
    _served(stats, 100, 0.004)
    assert idle.read(12.0) == pytest.approx(0.75 * 0.004)
    assert nvml.asked[-1] == pytest.approx(11.0)  # (each sample read once: from the last one's end)
    nvml.until(13.0, 1.0)
    _served(stats, 50, 0.002)  # (only the batches since the reading before)
    assert idle.read(13.0) == pytest.approx(0.0)  # (down at once)
    nvml.until(14.0, 1.0)
    assert idle.read(14.0) is None  # no batch served since
    assert idle.due == 14.0 + EVERY_S


def test_a_pause_inside_an_epoch_does_not_move_the_copies():
    """An evaluation of 3 s inside an epoch of 10 ms GPU-bound steps: the period that holds it reads an idle
    GPU over a long mean step, once; the smaller of two readings keeps the loop's figure."""
    stats, nvml, idle, got = _steady(0.99, 0.010)
    assert got == pytest.approx(0.01 * 0.010)
    nvml.until(5.0, 0.0)  # (the pause)
    _served(stats, 75, 0.010 + 3.0 / 75)
    assert idle.read(5.0) == pytest.approx(0.01 * 0.010)
    nvml.until(6.0, 0.99)
    _served(stats, 100, 0.010)
    assert idle.read(6.0) == pytest.approx(0.01 * 0.010)


def _loop(epochs: int, start_s: float, steps: int, step_s: float, busy: float,
          between_s: float = 0.0) -> list[float]:
    """The readings of a loop of ``epochs`` epochs of ``steps`` steps, each epoch started for ``start_s`` and
    followed by ``between_s`` of the loop's own code; the GPU idle in both, ``busy`` in the steps; NVML
    sampling every 1/6 s."""
    stats = PrefetchStats(device="cuda")
    idle_gpu: list[tuple[float, float]] = []

    def truth(t0: float, t1: float) -> float:
        return busy * (1 - sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in idle_gpu) / (t1 - t0))

    nvml = _Nvml()
    idle = GpuIdle(nvml, stats, COPY_S)
    now, readings = 0.0, []
    for _epoch in range(epochs):
        idle.epoch_started(now)
        idle_gpu.append((now, now + start_s))
        now += start_s
        stats.startup_s += start_s
        for step in range(steps):
            now += step_s
            if step > 0:  # (the second batch asked, and every one after)
                if now >= idle.due:
                    nvml.until(now, truth)
                    readings.append(idle.read(now))
                _served(stats, 1, step_s)
        idle.epoch_ended(now)
        idle_gpu.append((now, now + between_s))
        now += between_s
    return [r for r in readings if r is not None]


@pytest.mark.parametrize("start_s", [0.4, 0.04])
def test_an_epoch_s_start_is_taken_off_the_samples_it_overlaps(start_s):
    """Epochs of 13 GPU-bound steps of 60 ms (1% idle), each started by a DataLoader's workers, new (0.4 s)
    or persistent (40 ms, shorter than a step), the GPU idle meanwhile. The starts are taken off the
    samples they overlap: every reading is the steps' 0.6 ms, where the samples read as they come make it
    5x (40 ms) and 35x (0.4 s) that."""
    got = _loop(8, start_s, 13, 0.060, 0.99)
    assert len(got) >= 4 and got == pytest.approx([0.01 * 0.060] * len(got), rel=0.2), got


def test_the_time_between_two_epochs_is_no_step():
    """Epochs of 0.5 s of thread-bound steps (the GPU 50% busy), each followed by 0.7 s of the loop's own
    code with the GPU idle (an evaluation on the CPU, another loader) and a start of 10 ms: every reading
    is the steps' own, half of a 4 ms step. With only the starts taken off they read 78%."""
    got = _loop(10, 0.010, 125, 0.004, 0.5, between_s=0.7)
    assert len(got) >= 4 and got == pytest.approx([0.5 * 0.004] * len(got), rel=0.1), got


def test_a_pause_runs_from_an_epoch_s_first_end_through_starts_not_yet_over_to_its_first_batch():
    """The GPU idles from 5.0 s to 6.5 s, between 10 ms steps at 50%: an epoch ends at 5.0 (the loop asks
    again at 5.5), starts at 6.0 and again at 6.2 (a ``ToDevice`` reset twice), its first batch handed over
    0.3 s later. The reading is the steps' own; a pause from any later end or start would leak idle time."""
    stats = PrefetchStats(device="cuda")
    nvml = _Nvml()
    idle = GpuIdle(nvml, stats, COPY_S)
    idle.read(0.0)
    nvml.until(4.0, 0.5)
    _served(stats, 400, 0.010)
    assert idle.read(4.0) is None and idle._last == pytest.approx(0.5 * 0.010)  # (a first reading)
    _served(stats, 100, 0.010)
    idle.epoch_ended(5.0)
    idle.epoch_ended(5.5)
    idle.epoch_started(6.0)
    idle.epoch_started(6.2)
    stats.startup_s += 0.3
    nvml.until(5.0, 0.5)
    nvml.until(6.5, 0.0)
    nvml.until(8.0, 0.5)
    _served(stats, 150, 0.010)
    idle.read(8.0)
    assert idle._last == pytest.approx(0.5 * 0.010)


def test_a_reading_with_less_than_a_step_outside_the_pauses_is_not_taken():
    """An epoch of 10 ms steps whose start fills 1.995 s of the 2 s since the reading before: the 5 ms left
    would decide alone (read as all idle here); the reading before stays in force."""
    stats, nvml, idle, got = _steady(0.5, 0.010)
    assert got == pytest.approx(0.5 * 0.010)
    idle.epoch_started(2.0)
    stats.startup_s += 1.995
    nvml.until(4.0, 0.0)
    _served(stats, 1, 0.010)
    assert idle.read(4.0) is None and idle._last == pytest.approx(0.5 * 0.010)
    nvml.until(5.0, 0.5)
    _served(stats, 100, 0.010)
    assert idle.read(5.0) == pytest.approx(0.5 * 0.010)


def test_an_epoch_s_start_that_ends_before_the_reading_is_due_waits_for_it():
    """The start's end is taken at the next call (the epoch's second batch asked); the reading waits until
    it is due, a second after the one before."""
    stats = PrefetchStats(device="cuda")
    nvml = _Nvml()
    idle = GpuIdle(nvml, stats, COPY_S)
    idle.read(0.0)
    _served(stats, 10, 0.01)
    idle.epoch_started(0.2)
    stats.startup_s += 0.1
    assert idle.due == 0.0
    assert idle.read(0.4) is None and idle.due == EVERY_S and nvml.asked == []
    assert idle._pauses == [(0.2, pytest.approx(0.3))]


def test_the_copies_on_the_loop_s_stream_are_added_back_to_the_idle_time():
    """NVML counts a copy as busy: moving copies onto the loop's stream does not shrink the idle time read.
    Here half the batches (10 MB, 204 us a copy on the link) went on the loop's stream."""
    got = _steady(0.5, 0.002, nbytes=10_000_000, inline=50)[3]
    assert got == pytest.approx(0.5 * 0.002 + 0.5 * (4e-6 + 10_000_000 / 50e9))


def test_a_reader_that_fails_reads_no_idle_time_and_is_not_called_again():
    stats = PrefetchStats(device="cuda")
    calls = []

    def broken(after: float) -> list[tuple[float, float, float]]:
        calls.append(1)
        raise RuntimeError("NVML: driver not loaded")

    idle = GpuIdle(broken, stats, COPY_S)
    idle.read(0.0)
    _served(stats, 10, 0.01)
    assert idle.read(1.0) == 0.0 and idle.due == math.inf
    idle.epoch_started(1.5)  # (an epoch's start: still not read)
    _served(stats, 10, 0.01)
    assert idle.due == math.inf and idle.read(2.0) is None and calls == [1]


def test_a_copy_goes_on_the_loop_s_stream_where_it_takes_less_than_the_calls_or_half_the_idle_time():
    """``loop_bytes``: what the link (a 4 us latency, 50 GB/s) crosses in the copy stream's calls (20 us),
    or in half the GPU's idle time a step once that is read; nothing before the calls are known."""
    costs = _Costs(LINK)
    costs.spare(1e-3)
    assert costs.loop_bytes == 0.0  # (every batch on the copy stream until its calls are measured)
    costs.side_calls(12e-6)
    costs.side_wait(8e-6)
    assert costs.loop_bytes == pytest.approx((500e-6 - 4e-6) * 50e9)
    costs.spare(10e-6)  # the GPU the bound: the calls decide again
    assert costs.loop_bytes == pytest.approx((20e-6 - 4e-6) * 50e9)
    assert _Costs(None).loop_bytes == 0.0


class _StubIdle:
    """A GpuIdle stand-in: reads ``value`` at every call, and records the epochs' starts and ends."""

    def __init__(self, value: float) -> None:
        self.value, self.reads, self.due = value, 0, 0.0
        self.epochs: list[str] = []

    def epoch_started(self, now: float) -> None:
        self.epochs.append("start")

    def epoch_ended(self, now: float) -> None:
        self.epochs.append("end")

    def read(self, now: float) -> float:
        self.reads += 1
        return self.value


def test_each_next_reads_the_idle_time_when_due_and_applies_it_across_epochs():
    from gpufeed import CudaPrefetcher

    data = [torch.full((4,), float(i)) for i in range(5)]
    with CudaPrefetcher(data, device="cpu") as pf:
        stub = pf._stage.idle = _StubIdle(0.004)
        for _ in range(2):
            assert [float(b[0]) for b in pf] == [float(i) for i in range(5)]
        assert stub.reads == 2 * 5  # (every next() but an epoch's first: its start-up)
        assert pf._stage.costs.idle_s == 0.004
        assert stub.epochs == ["start", "end"] * 2
        stub.due = float("inf")  # (not due: not read)
        assert len(list(pf)) == 5 and stub.reads == 10
        for _ in pf:  # an epoch left after a break ends (here once its iterator is collected)
            break
        list(pf)
        assert stub.epochs == ["start", "end"] * 5


def test_a_todevice_reset_starts_an_epoch_of_the_stage():
    """Each reset starts an epoch for the stage's verdict: a batch before it and one after are no period."""
    tn = pytest.importorskip("torchdata.nodes", reason="torchdata >= 0.10 is not installed")
    from gpufeed.nodes import ToDevice

    node = ToDevice(tn.IterableWrapper([torch.ones(2)] * 3), device="cpu")
    starts = []
    node._stage.new_epoch = lambda: starts.append(1)
    node.reset()
    assert len(list(tn.Loader(node))) == 3
    assert len(starts) >= 2  # (this reset, and the Loader's at iter())


def test_a_todevice_epoch_ends_at_its_end_and_at_a_reset_after_a_break():
    """The stage's idle reading sees a ``ToDevice`` epoch end where its upstream ends, and where a reset
    follows a break; each reset starts one."""
    tn = pytest.importorskip("torchdata.nodes", reason="torchdata >= 0.10 is not installed")
    from gpufeed.nodes import ToDevice

    node = ToDevice(tn.IterableWrapper([torch.ones(2)] * 3), device="cpu")
    stub = node._stage.idle = _StubIdle(0.0)
    node.reset()
    assert stub.epochs == ["end", "start"]  # (a reset ends what came before it: here nothing)
    assert len([node.next() for _ in range(3)]) == 3
    with pytest.raises(StopIteration):
        node.next()
    assert stub.epochs == ["end", "start", "end"]
    node.reset()
    node.next()  # (then a break)
    node.reset()
    assert stub.epochs == ["end", "start", "end", "end", "start", "end", "start"]
