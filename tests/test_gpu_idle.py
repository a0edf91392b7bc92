"""The GPU's idle time a step (``GpuIdle``, from NVML's utilization) and what the stream choice makes of
it (``_Costs``). CPU runs here, with the readings given; the loops on a GPU are in test_cuda.py."""

from __future__ import annotations

import math

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


def test_the_idle_time_is_the_idle_share_of_the_loop_s_period_the_smaller_of_two_readings():
    stats = PrefetchStats(device="cuda")
    busy = [0.25]
    idle = GpuIdle(lambda: busy[0], stats, COPY_S)
    assert idle.due == 0.0
    assert idle.read(10.0) is None  # (the first call starts the first period)
    assert idle.due == 10.0 + EVERY_S
    _served(stats, 100, 0.004, nbytes=1 << 20)  # (on the copy stream: its copies are not added back)
    assert idle.read(11.0) is None  # (a first reading: 3 ms, held until a second one)
    _served(stats, 100, 0.004)
    assert idle.read(12.0) == pytest.approx(0.75 * 0.004)
    busy[0] = 1.0
    _served(stats, 50, 0.002)  # (only the batches since the reading before)
    assert idle.read(13.0) == pytest.approx(0.0)  # (down at once)
    assert idle.read(14.0) is None  # no batch served since
    assert idle.due == 14.0 + EVERY_S


def test_a_pause_inside_an_epoch_does_not_move_the_copies():
    """An evaluation of 3 s inside an epoch of 10 ms GPU-bound steps: the period that holds it reads an idle
    GPU over a long mean step, once; the smaller of two readings keeps the loop's figure."""
    stats = PrefetchStats(device="cuda")
    busy = [0.99]
    idle = GpuIdle(lambda: busy[0], stats, COPY_S)
    idle.read(0.0)
    _served(stats, 100, 0.010)
    idle.read(1.0)
    _served(stats, 100, 0.010)
    assert idle.read(2.0) == pytest.approx(0.01 * 0.010)
    busy[0] = 0.0  # (NVML's last sample: the pause)
    _served(stats, 75, 0.010 + 3.0 / 75)
    assert idle.read(5.0) == pytest.approx(0.01 * 0.010)
    busy[0] = 0.99
    _served(stats, 100, 0.010)
    assert idle.read(6.0) == pytest.approx(0.01 * 0.010)


def test_a_reading_after_an_epoch_s_start_up_longer_than_a_step_is_skipped():
    """Epochs of 13 GPU-bound steps of 60 ms, each started by a DataLoader's workers (0.4 s): NVML's sample
    at the next reading holds the start-up, an idle GPU. That reading is skipped, not kept as the reading
    before; a start-up shorter than a step (a list's) is read as any step boundary."""
    stats = PrefetchStats(device="cuda")
    busy = [0.99]
    idle = GpuIdle(lambda: busy[0], stats, COPY_S)
    idle.read(0.0)
    for t in (1.0, 2.0):
        _served(stats, 16, 0.060)
        got = idle.read(t)
    assert got == pytest.approx(0.01 * 0.060)
    busy[0] = 0.3  # (NVML's last sample: mostly the workers starting)
    stats.startup_s += 0.4
    _served(stats, 13, 0.060)
    assert idle.read(3.0) is None and idle.due == 3.0 + EVERY_S
    busy[0] = 0.5
    _served(stats, 16, 0.060)
    assert idle.read(4.0) == pytest.approx(0.01 * 0.060)  # (the smaller of this and 2.0's, not 3.0's)
    stats.startup_s += 0.001  # a start-up shorter than a step: read
    _served(stats, 16, 0.060)
    assert idle.read(5.0) == pytest.approx(0.5 * 0.060)


def test_the_copies_on_the_loop_s_stream_are_added_back_to_the_idle_time():
    """NVML counts a copy as busy: moving copies onto the loop's stream does not shrink the idle time read.
    Here half the batches (10 MB, 204 us a copy on the link) went on the loop's stream."""
    stats = PrefetchStats(device="cuda")
    idle = GpuIdle(lambda: 0.5, stats, COPY_S)
    idle.read(0.0)
    for t in (1.0, 2.0):
        _served(stats, 100, 0.002, nbytes=10_000_000, inline=50)
        got = idle.read(t)
    assert got == pytest.approx(0.5 * 0.002 + 0.5 * (4e-6 + 10_000_000 / 50e9))


def test_a_reader_that_fails_reads_no_idle_time_and_is_not_called_again():
    stats = PrefetchStats(device="cuda")
    calls = []

    def broken() -> float:
        calls.append(1)
        raise RuntimeError("NVML: driver not loaded")

    idle = GpuIdle(broken, stats, COPY_S)
    idle.read(0.0)
    _served(stats, 10, 0.01)
    assert idle.read(1.0) == 0.0 and idle.due == math.inf
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


class _StubIdle:
    """A GpuIdle stand-in: reads ``value`` at every call."""

    def __init__(self, value: float) -> None:
        self.value, self.reads, self.due = value, 0, 0.0

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
        stub.due = float("inf")  # (not due: not read)
        assert len(list(pf)) == 5 and stub.reads == 10


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
