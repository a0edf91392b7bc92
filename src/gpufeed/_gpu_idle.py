"""GpuIdle: how long the GPU idles a step of the loop, from NVML's utilization (what nvidia-smi reads)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from gpufeed.stats import PrefetchStats

#: Seconds between two readings: NVML's utilization covers its last sample period, 1/6 s to 1 s by the card.
EVERY_S = 1.0

_READERS: dict[int, Callable[[], float] | None] = {}
_READERS_LOCK = threading.Lock()


def busy_reader(device: torch.device) -> Callable[[], float] | None:
    """A function returning the share (0 to 1) of NVML's last sample period in which ``device`` ran a
    kernel or a copy (any process's); None where NVML cannot say: nvidia-ml-py not installed, no NVIDIA
    driver, a device that does not report it (a MIG instance). Made once a process and device. The device
    is found by its UUID, whatever ``CUDA_VISIBLE_DEVICES`` renumbers (``torch.cuda.utilization`` maps it
    anew at every call: 1.9 ms, against 44 us for the reading alone)."""
    with _READERS_LOCK:
        if device.index not in _READERS:
            _READERS[device.index] = _nvml_reader(device)
        return _READERS[device.index]


def _nvml_reader(device: torch.device) -> Callable[[], float] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")

        def busy() -> float:
            return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0

        busy()
    except Exception:  # (ImportError, pynvml's NVMLError, ...: no reading)
        return None
    return busy


class GpuIdle:
    """The GPU's idle time a step, besides the copies on the loop's stream.

    Each reading is ``(1 - busy) x period`` plus those copies' time a step: ``period`` is the loop's mean
    period since the reading before (``stats``: its wall time over the batches served), ``busy`` the share
    of NVML's last sample period in which the GPU ran a kernel or a copy. NVML counts a copy as busy time,
    so the copies the stream choice put on the loop's stream (``copy_s`` each, the stream choice's own
    model of a copy, at the period's mean batch size) are added back: moving them there does not shrink
    the idle time read. (Copies on the copy stream that fall in the GPU's idle gaps still count as busy:
    the reading errs towards the copy stream.)

    :meth:`read` returns the smaller of the last two readings: a pause (an evaluation, a checkpoint, the
    time between epochs) makes NVML's sample idle, and one period long where it falls inside an epoch,
    and takes a single reading far above the loop's. The readings run on across epochs (the periods count
    only the batches served). A reading is skipped where the epochs' start-ups since the one before
    (``stats.startup_s``: a DataLoader's workers starting) add up to more than the loop's mean step: NVML's
    sample may hold that pause, and where epochs are shorter than two readings every reading would; the
    reading before stays in force. Read at most once every ``EVERY_S`` (``due``), on the loop's thread.
    Where the reader fails, every reading is 0 from then on: the copy stream's calls alone decide.
    """

    def __init__(self, busy: Callable[[], float], stats: PrefetchStats,
                 copy_s: Callable[[float], float]) -> None:
        self._busy = busy
        self.stats = stats
        self.copy_s = copy_s  # the seconds a pinned copy of so many bytes takes on the link
        self.due = 0.0  # perf_counter time of the next reading
        self._seen: tuple[int, float, int, int, float] | None = None  # the counters at the reading before
        self._last: float | None = None  # the reading before

    def read(self, now: float) -> float | None:
        """The idle seconds a step (the smaller of this reading and the one before); None where there is
        nothing new: the first call, no batch served since, a reading skipped for a start-up, a first
        reading."""
        s = self.stats
        seen, self._seen = self._seen, (s.batches, s.wall_s, s.bytes, s.loop_stream_batches, s.startup_s)
        if self.due == math.inf:
            return None
        self.due = now + EVERY_S
        if seen is None or s.batches <= seen[0] or s.wall_s <= seen[1]:
            return None
        batches = s.batches - seen[0]
        period = (s.wall_s - seen[1]) / batches
        if s.startup_s - seen[4] > period:  # start-ups since, longer than a step: a pause
            return None
        try:
            busy = self._busy()
        except Exception:  # (a driver that stopped answering: the reading is off, the calls decide)
            self.due = math.inf
            return 0.0
        inline = (s.loop_stream_batches - seen[3]) / batches
        idle = max(0.0, 1.0 - busy) * period + inline * self.copy_s((s.bytes - seen[2]) / batches)
        last, self._last = self._last, idle
        return None if last is None else min(idle, last)
