"""GpuIdle: how long the GPU idles a step of the loop, from NVML's utilization (what nvidia-smi reads)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpufeed.stats import PrefetchStats

#: Seconds between two readings: NVML's utilization covers its last sample period, 1/6 s to 1 s by the card.
EVERY_S = 1.0


def busy_reader(device: torch.device) -> Callable[[], float] | None:
    """A function returning the share (0 to 1) of NVML's last sample period in which ``device`` ran a
    kernel or a copy (any process's); None where NVML cannot say: nvidia-ml-py not installed, no NVIDIA
    driver, a device that does not report it (a MIG instance). The device is found by its UUID, whatever
    ``CUDA_VISIBLE_DEVICES`` renumbers (``torch.cuda.utilization`` maps it anew at every call: 1.9 ms)."""
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
    """The GPU's idle time a step, besides the copies on the loop's stream: ``(1 - busy) x period`` plus
    those copies' time a step. ``period`` is the loop's mean period since the reading before (``stats``:
    its wall time over the batches served), ``busy`` the share of NVML's last sample period in which the GPU
    ran a kernel or a copy. NVML counts a copy as busy time, so the copies the stream choice put on the
    loop's stream (``latency + bytes / rate`` each, from ``link``) are added back: the idle time read is
    then the same whichever stream they went on. Read at most once every ``EVERY_S``, on the loop's thread
    (:meth:`read`, when ``due``); never again once the reader failed.
    """

    def __init__(self, busy: Callable[[], float], stats: PrefetchStats, link: tuple[float, float]) -> None:
        self._busy: Callable[[], float] | None = busy
        self.stats = stats
        self.link = link  # (latency s, bytes a second) of a pinned copy
        self.due = 0.0  # perf_counter time of the next reading
        self._seen: tuple[int, float, int, int] | None = None  # the counters at the reading before

    def restart(self) -> None:
        """An epoch starts: the next reading starts a period (NVML's last sample period then covers the
        pause between epochs, not the loop)."""
        self._seen = None
        if self._busy is not None:
            self.due = 0.0

    def read(self, now: float) -> float | None:
        """The idle seconds a step since the reading before; None at the first call (it starts the first
        period), where no batch was served since, or where NVML failed."""
        s = self.stats
        seen, self._seen = self._seen, (s.batches, s.wall_s, s.bytes, s.loop_stream_batches)
        self.due = now + EVERY_S if self._busy is not None else math.inf
        if seen is None or self._busy is None or s.batches <= seen[0] or s.wall_s <= seen[1]:
            return None
        try:
            busy = self._busy()
        except Exception:  # (a driver that stopped answering: the reading is off)
            self._busy, self.due = None, math.inf
            return None
        batches = s.batches - seen[0]
        latency, rate = self.link
        copy = latency + (s.bytes - seen[2]) / batches / rate
        inline = (s.loop_stream_batches - seen[3]) / batches
        return max(0.0, 1.0 - busy) * (s.wall_s - seen[1]) / batches + inline * copy
