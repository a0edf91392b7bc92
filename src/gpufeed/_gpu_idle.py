"""GpuIdle: how long the GPU idles a step of the loop, from NVML's utilization samples (nvidia-smi's)."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable

import torch

from gpufeed.stats import PrefetchStats

#: Seconds between two readings (NVML samples the utilization every 1/6 s to 1 s, by the card).
EVERY_S = 1.0
#: Where NVML keeps no timestamped samples, its one utilization figure covers at most this much.
LONGEST_SAMPLE_S = 1.0

#: ``(start, end, busy)``: a span of the GPU's timeline (``time.perf_counter`` seconds) and the share of it
#: in which the GPU ran a kernel or a copy (any process's).
Span = tuple[float, float, float]

_READERS: dict[int, Callable[[float], list[Span]] | None] = {}
_READERS_LOCK = threading.Lock()


def busy_reader(device: torch.device) -> Callable[[float], list[Span]] | None:
    """A function returning NVML's utilization samples of ``device`` that begin at or after a given
    ``time.perf_counter`` time, as :data:`Span` s in order; None where NVML cannot say: nvidia-ml-py not
    installed, no NVIDIA driver, a device that does not report it (a MIG instance). Made once a process
    and device. The device is found by its UUID, whatever ``CUDA_VISIBLE_DEVICES`` renumbers
    (``torch.cuda.utilization`` maps it anew at every call: 1.9 ms, against 44 us for a reading alone)."""
    with _READERS_LOCK:
        if device.index not in _READERS:
            _READERS[device.index] = _nvml_reader(device)
        return _READERS[device.index]


def _nvml_reader(device: torch.device) -> Callable[[float], list[Span]] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
    except Exception:  # (ImportError, pynvml's NVMLError, ...: no reading)
        return None

    def sampled(after: float) -> list[Span]:
        """The driver's timestamped samples (its clock: Unix microseconds), each the share of the time since
        the sample before it."""
        offset = time.time() - time.perf_counter()
        since = int((after + offset - LONGEST_SAMPLE_S) * 1e6)  # (from the sample before the first one)
        try:
            _, got = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, since)
        except pynvml.NVMLError_NotFound:  # (no sample since)
            return []
        stamps = sorted((s.timeStamp / 1e6 - offset, s.sampleValue.uiVal / 100.0) for s in got)
        return [(t0, t1, busy) for (t0, _), (t1, busy) in itertools.pairwise(stamps)
                if t0 >= after - 1e-3]  # (1 ms: the two clocks' offset, read anew each call)

    def latest(after: float) -> list[Span]:
        """The utilization of the last sample period, taken as the longest one."""
        now = time.perf_counter()
        if now - LONGEST_SAMPLE_S < after - 1e-3:
            return []
        return [(now - LONGEST_SAMPLE_S, now, pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)]

    for reader in (sampled, latest):
        try:
            reader(time.perf_counter() - 2 * LONGEST_SAMPLE_S)
        except Exception:  # (a driver without timestamped samples: the one figure)
            continue
        return reader
    return None


class GpuIdle:
    """The GPU's idle time a step, besides the copies on the loop's stream.

    Each reading is the GPU's idle share over NVML's samples since the reading before, times ``period``,
    plus those copies' time a step: ``period`` is the loop's mean period over the same time (``stats``: its
    wall time over the batches served). NVML counts a copy as busy time, so the copies the stream choice
    put on the loop's stream (``copy_s`` each, the stream choice's own model of a copy, at the period's
    mean batch size) are added back: moving them there does not shrink the idle time read. (Copies on the
    copy stream that fall in the GPU's idle gaps still count as busy: the reading errs towards the copy
    stream.)

    The time between two epochs is no step: from the end of one (:meth:`epoch_ended`) until the next hands
    over its first batch (:meth:`epoch_started`, then ``stats.startup_s`` later), the loop runs its own
    code between epochs (an evaluation, another loader) and a DataLoader's workers start, and where epochs
    are shorter than a reading every reading would hold such a pause. The time a pause overlaps a sample is
    taken off the sample's idle time and span, as if the GPU had idled all of it; where it ran some of it,
    the reading is lower, towards the copy stream.

    :meth:`read` returns the smaller of the last two readings: a pause inside an epoch (an evaluation, a
    checkpoint) makes NVML's samples idle and one period long, and takes a single reading far above the
    loop's. Read at most once every ``EVERY_S`` (``due``), on the loop's thread. Where the reader fails,
    every reading is 0 from then on: the copy stream's calls alone decide.
    """

    def __init__(self, spans: Callable[[float], list[Span]], stats: PrefetchStats,
                 copy_s: Callable[[float], float]) -> None:
        self._spans = spans
        self.stats = stats
        self.copy_s = copy_s  # the seconds a pinned copy of so many bytes takes on the link
        self.due = 0.0  # perf_counter time of the next call to read (0: at once)
        self._due = 0.0  # ... of the next reading
        self._seen: tuple[int, float, int, int] | None = None  # the counters at the reading before
        self._after = 0.0  # the end of the last sample read: the next reading's samples begin there
        self._last: float | None = None  # the reading before
        self._pauses: list[tuple[float, float]] = []  # (from, to) between epochs, those since ``_after``
        self._ended: float | None = None  # when the last epoch ended (None: none ended since one started)
        self._paused: tuple[float, float, float] | None = None  # a pause: from, an epoch's start, startup_s

    def epoch_ended(self, now: float) -> None:
        """An epoch ended (its first end counts: the loop may ask again after it)."""
        if self._ended is None:
            self._ended = now

    def epoch_started(self, now: float) -> None:
        """An epoch starts: from the last one's end (or a start not yet over: a ``ToDevice`` reset twice)
        until it hands over its first batch, no step."""
        if self.due != math.inf:
            began = self._ended if self._ended is not None else now
            if self._paused is not None:
                began = self._paused[0]
            self._paused, self._ended, self.due = (began, now, self.stats.startup_s), None, 0.0

    def read(self, now: float) -> float | None:
        """The idle seconds a step (the smaller of this reading and the one before); None where there is
        nothing to read: the first call, no batch or sample since (the next reading's samples then begin
        now), less than a step's time of samples outside the pauses, a first reading, not yet due (an
        epoch's start just ended)."""
        if self.due == math.inf:
            return None
        if self._paused is not None:  # (the epoch's second batch is asked: its start is over)
            began, at, startup_s = self._paused
            self._pauses.append((began, at + self.stats.startup_s - startup_s))
            self._paused, self.due = None, self._due
            if now < self._due:
                return None
        s = self.stats
        seen, self._seen = self._seen, (s.batches, s.wall_s, s.bytes, s.loop_stream_batches)
        self.due = self._due = now + EVERY_S
        spans: list[Span] = []
        if seen is not None:
            try:
                spans = self._spans(self._after)
            except Exception:  # (a driver that stopped answering: the reading is off, the calls decide)
                self.due = math.inf
                return 0.0
        if not spans or s.batches <= seen[0] or s.wall_s <= seen[1]:  # the next reading's time starts here
            self._after = now
            self._pauses = [p for p in self._pauses if p[1] > now]
            return None
        self._after = spans[-1][1]
        pauses, self._pauses = self._pauses, [p for p in self._pauses if p[1] > self._after]
        span = idle = 0.0
        for t0, t1, busy in spans:
            paused = min(t1 - t0, sum(max(0.0, min(t1, p1) - max(t0, p0)) for p0, p1 in pauses))
            span += t1 - t0 - paused
            idle += max(0.0, (1.0 - busy) * (t1 - t0) - paused)
        batches = s.batches - seen[0]
        period = (s.wall_s - seen[1]) / batches
        if span < period:  # (less than a step outside the pauses: their edges would decide)
            return None
        inline = (s.loop_stream_batches - seen[3]) / batches
        reading = idle / span * period + inline * self.copy_s((s.bytes - seen[2]) / batches)
        last, self._last = self._last, reading
        return None if last is None else min(reading, last)
