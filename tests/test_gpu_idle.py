"""The GPU's idle time a step (``GpuIdle``, from NVML's utilization) and what the stream choice makes of
it (``_Costs``). CPU runs here, with the readings given; the loops on a GPU are in test_cuda.py."""

from __future__ import annotations

import math

import pytest

from gpufeed import PrefetchStats
from gpufeed._device import _Costs
from gpufeed._gpu_idle import EVERY_S, GpuIdle

LINK = (4e-6, 50e9)  # (latency s, bytes a second)


def _served(stats: PrefetchStats, batches: int, period_s: float, nbytes: int = 0, inline: int = 0) -> None:
    stats.batches += batches
    stats.wall_s += batches * period_s
    stats.bytes += batches * nbytes
    stats.loop_stream_batches += inline


def test_the_idle_time_is_the_idle_share_of_the_loop_s_period_since_the_reading_before():
    stats = PrefetchStats(device="cuda")
    busy = [0.25]
    idle = GpuIdle(lambda: busy[0], stats, LINK)
    assert idle.due == 0.0
    assert idle.read(10.0) is None  # (the first call starts the first period)
    assert idle.due == 10.0 + EVERY_S
    _served(stats, 100, 0.004, nbytes=1 << 20)  # (on the copy stream: its copies overlap, not added)
    assert idle.read(11.0) == pytest.approx(0.75 * 0.004)
    busy[0] = 1.0
    _served(stats, 50, 0.002)  # (only the batches since the reading before)
    assert idle.read(12.0) == pytest.approx(0.0)
    assert idle.read(13.0) is None  # no batch served since
    assert idle.due == 13.0 + EVERY_S


def test_the_copies_on_the_loop_s_stream_are_added_back_to_the_idle_time():
    """NVML counts a copy as busy: the idle time is the same whichever stream the copies went on. Here half
    the batches (10 MB, 204 us a copy on the link) went on the loop's stream."""
    stats = PrefetchStats(device="cuda")
    idle = GpuIdle(lambda: 0.5, stats, LINK)
    idle.read(0.0)
    _served(stats, 100, 0.002, nbytes=10_000_000, inline=50)
    assert idle.read(1.0) == pytest.approx(0.5 * 0.002 + 0.5 * (4e-6 + 10_000_000 / 50e9))


def test_a_reader_that_fails_turns_the_reading_off_for_good():
    stats = PrefetchStats(device="cuda")
    calls = []

    def broken() -> float:
        calls.append(1)
        raise RuntimeError("NVML: driver not loaded")

    idle = GpuIdle(broken, stats, LINK)
    idle.read(0.0)
    _served(stats, 10, 0.01)
    assert idle.read(1.0) is None and idle.due == math.inf
    _served(stats, 10, 0.01)
    assert idle.read(2.0) is None and calls == [1]


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


def test_an_epoch_s_first_reading_starts_a_period_and_reads_nothing():
    """Between epochs the loop is away: NVML's last sample period then covers the pause, not the loop."""
    stats = PrefetchStats(device="cuda")
    idle = GpuIdle(lambda: 0.0, stats, LINK)
    idle.read(0.0)
    _served(stats, 10, 0.01)
    idle.restart()
    assert idle.due == 0.0
    assert idle.read(5.0) is None and idle.due == 5.0 + EVERY_S
    _served(stats, 10, 0.02)
    assert idle.read(6.0) == pytest.approx(0.02)
