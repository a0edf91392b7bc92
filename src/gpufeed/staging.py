"""Staging through pinned memory: pageable batches chunk by chunk, and the pinned pool of source reads.

:class:`Stager` moves a pageable tensor to the device: copied into pinned memory from torch's caching
host allocator (torch's parallel copy, GIL released) and sent on the current (copy) stream; a tensor
larger than a chunk goes chunk by chunk, so chunk ``i + 1`` fills while chunk ``i`` crosses the link.

:class:`PinnedPool` holds the pinned buffers that a :class:`~gpufeed.BatchSource` reads into: a
bounded set, allocated on demand and reused for the prefetcher's life.

Invariant, for both: pinned memory is written again only after the event recorded behind the last
copy that read it has completed, so a fill never overwrites bytes the copy engine has not yet read.
torch's allocator keeps it for the chunks (a ``non_blocking`` copy records an event on its block); the
pool keeps it for its buffers (:meth:`PinnedPool.release`). Only the background thread records and
queries those events.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from gpufeed._worker import Stopped

MiB = 1 << 20
#: One staging chunk: the unit filled into pinned memory and sent to the device (docs/design.md says why 32).
DEFAULT_CHUNK_BYTES = 32 * MiB
DEFAULT_PINNED_BUDGET = 512 * MiB


class PinnedUnavailable(RuntimeError):
    """The pool cannot pin memory (budget 0, or the allocation failed): copy from pageable memory."""


class _Buffer:
    __slots__ = ("busy", "event", "tensor", "views")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.views: dict[Any, Any] = {}  # typed views into this buffer, cached by their user
        self.event: torch.cuda.Event | None = None  # recorded behind the last copy that read this buffer
        self.busy = False  # an event was recorded and has not been seen complete

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def done(self) -> bool:
        if self.busy and self.event is not None and not self.event.query():
            return False
        self.busy = False
        return True


class PinnedPool:
    """A bounded pool of pinned host buffers, allocated on demand and reused for the prefetcher's life.

    Buffers are allocated lazily (so the pool is sized to the batches seen) in multiples of
    ``chunk_bytes``; the pool never holds more than ``budget`` bytes, except that a single request
    larger than the budget is served by one buffer of that size. A buffer is handed out again only
    after the CUDA event recorded behind its last copy completed (see :meth:`release`).

    Pinned allocation can fail (locked-memory limits, a budget of zero): ``available`` is then False
    and the prefetcher falls back to pageable copies with one warning.

    Example:
        >>> pool = PinnedPool(budget=64 << 20, pin=False)
        >>> buf = pool.acquire(1 << 20, stop=threading.Event())
        >>> pool.release(buf, record_on=None)
    """

    def __init__(self, budget: int = DEFAULT_PINNED_BUDGET, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 pin: bool = True) -> None:
        if budget < 0:
            raise ValueError(f"pinned_budget must be >= 0 bytes, got {budget}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {chunk_bytes}")
        self.budget = budget
        self.chunk_bytes = chunk_bytes
        self.fill_bytes = max(64 << 10, chunk_bytes // 4)  # one worker's share of a chunk
        self.pin = pin
        self.available = budget > 0
        self.warned = False  # the prefetcher said once that it falls back to pageable copies
        self.allocated = 0
        self.allocations = 0
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, stop: threading.Event) -> _Buffer:
        """A buffer of at least ``nbytes`` whose previous copy has completed; waits for one if needed.

        Raises:
            PinnedUnavailable: the budget is 0, or pinning memory failed (the caller copies pageable).
        """
        delay = 20e-6
        while True:
            if not self.available:
                why = "pinned_budget is 0" if self.budget == 0 else "pinned allocation failed"
                raise PinnedUnavailable(why)
            buf = self.try_acquire(nbytes)
            if buf is not None:
                return buf
            if stop.is_set():
                raise Stopped
            # Back off to 1 ms: each poll takes the GIL (and queries events) and the training thread
            # waits behind it; a 32 MiB copy takes about 0.6 ms at 55 GB/s.
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def try_acquire(self, nbytes: int) -> _Buffer | None:
        """A free buffer of at least ``nbytes`` whose copy completed, a new one within budget, or None."""
        with self._lock:
            # Most recently returned first: a small set of buffers stays in cache and TLB.
            for i in range(len(self._free) - 1, -1, -1):
                buf = self._free[i]
                if buf.nbytes >= nbytes and buf.done():
                    return self._free.pop(i)
            size = -(-nbytes // self.chunk_bytes) * self.chunk_bytes
            for buf in [b for b in self._free if b.nbytes < nbytes and b.done()]:
                if self.allocated + size <= self.budget:
                    break
                self._free.remove(buf)  # too small for this request: make room for a bigger one
                self.allocated -= buf.nbytes
            if not self.available:
                return None
            if self.allocated + size <= self.budget or (self.allocated == 0 and not self._free):
                return self._allocate(size)
            return None  # every buffer is out; one comes back when its copy completes

    def release(self, buf: _Buffer, record_on: torch.cuda.Stream | None) -> None:
        """Return ``buf``; with ``record_on``, its event is recorded there, behind the copies that read it."""
        if record_on is not None:
            if buf.event is None:
                buf.event = torch.cuda.Event()
            buf.event.record(record_on)
            buf.busy = True
        with self._lock:
            self._free.append(buf)

    def _allocate(self, size: int) -> _Buffer | None:
        try:
            tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError:  # cudaHostAlloc refused (locked-memory limit, no driver): go pageable
            self.available = False
            return None
        self.allocated += size
        self.allocations += 1
        return _Buffer(tensor)

    def clear(self) -> None:
        """Free every buffer that is back in the pool, once its copy completed."""
        with self._lock:
            for buf in self._free:
                if buf.event is not None:
                    buf.event.synchronize()
                self.allocated -= buf.nbytes
            self._free.clear()




def align(n: int) -> int:
    """``n`` rounded up to a multiple of 64 bytes (a cache line; every dtype's alignment)."""
    return -(-n // 64) * 64


def layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``nbytes`` laid end to end at 64-byte boundaries, and the bytes they span:
    the layout :func:`plan_chunks` stages them in (its chunk size is a multiple of 64)."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end = align(end + n)
    return offsets, (offsets[-1] + nbytes[-1]) if nbytes else 0



def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)


def split(total: int, piece: int) -> list[tuple[int, int]]:
    """``[(offset, n), ...]`` covering ``range(total)`` in pieces of at most ``piece``."""
    return [(off, min(piece, total - off)) for off in range(0, total, piece)]


#: A source read this small (a small batch's one read) runs on the background thread itself: handing it
#: to a worker costs GIL handoffs (submit, wake, result, wake), and each can delay the training thread's
#: next torch call.
INLINE_BYTES = 1 << 20


def run_now(job: Callable[[], Any]) -> Future:
    """Run ``job`` on this thread; a done Future with its result or exception (as a worker's would be)."""
    fut: Future = Future()
    try:
        fut.set_result(job())
    except BaseException as exc:  # delivered through the future, as from a worker thread
        fut.set_exception(exc)
    return fut





class Stager:
    """Copies a pageable host tensor to the device through pinned memory, on the current stream.

    A tensor of at most ``chunk_bytes`` is pinned whole (``pin_memory()``: torch's caching host
    allocator and its parallel copy) and sent with one ``non_blocking`` copy. A larger one is cut into
    chunks of ``chunk_bytes``, each pinned and sent in turn, so the fill of chunk ``i + 1`` overlaps the
    copy of chunk ``i`` on the link. torch's allocator hands a pinned block out again only after the
    event that its ``non_blocking`` copy recorded has completed.

    Example:
        >>> stager = Stager(chunk_bytes=4096, pin=False)
        >>> stager.to(torch.arange(3000), torch.device("cpu")).sum().item()
        4498500
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin: bool = True) -> None:
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.pin = pin

    def to(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` on ``device``, staged through pinned memory.

        Raises:
            PinnedUnavailable: pinned memory could not be allocated (the caller copies from pageable).
        """
        t = t.contiguous()  # a staged leaf arrives contiguous, whatever its strides on the host
        if t.nbytes <= self.chunk_bytes:
            return self._pinned(t).to(device, non_blocking=True)
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        src, dst = byte_view(t), byte_view(out)
        for a in range(0, src.numel(), self.chunk_bytes):
            piece = src[a : a + self.chunk_bytes]
            dst[a : a + piece.numel()].copy_(self._pinned(piece), non_blocking=True)
        return out

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        if not self.pin:
            return t.clone()
        try:
            return t.pin_memory()
        except RuntimeError as exc:  # cudaHostAlloc refused (locked-memory limit)
            raise PinnedUnavailable(f"pinned allocation failed: {exc}") from exc


def _traced(trace: Any, job: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        t0 = time.perf_counter_ns()
        job()
        trace.add("fill", t0, time.perf_counter_ns())

    return run


def _result(fut: Future, stop: threading.Event | None, swallow: bool = False) -> object:
    while True:
        try:
            return fut.result(timeout=0.05)
        except FutureTimeout:
            if stop is not None and stop.is_set():
                raise Stopped from None
        except BaseException:
            if swallow:
                return None
            raise


def warn_pageable(reason: str) -> None:
    warnings.warn(
        f"gpufeed: pinned staging is off ({reason}); falling back to pageable host-to-device copies, "
        "which are slower and may stall. Raise the locked-memory limit (ulimit -l) or pinned_budget.",
        RuntimeWarning,
        stacklevel=3,
    )
