"""The pinned buffers a BatchSource reads into: a bounded pool, allocated on demand, reused for the
prefetcher's life.

Invariant: a buffer is handed out again only after the event recorded behind the last copy that read it
has completed (:meth:`PinnedPool.release`), so a read never overwrites bytes the copy engine has not yet
read. Only the epoch's fetching thread (the loop's, or its fetch thread) records and queries those
events, one thread at a time.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpufeed._worker import POLL_S, Stopped
from gpufeed.staging import DEFAULT_CHUNK_BYTES, DEFAULT_PINNED_BUDGET, PinnedUnavailable


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

    Buffers are allocated lazily (so the pool is sized to the batches seen), each the power of two at
    or above its request: the block torch's caching host allocator takes for it anyway, and one that a
    smaller request (a batch's last chunk, the epoch's last batch) reuses. The pool never holds more than
    ``budget`` bytes, except that a single request larger than the budget is served by one buffer of that
    size. A buffer is handed out again only after the CUDA event recorded behind its last copy completed
    (see :meth:`release`).

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
        self._returned = threading.Condition(self._lock)  # notified by release()

    def acquire(self, nbytes: int, stop: threading.Event) -> _Buffer:
        """A buffer of at least ``nbytes`` whose previous copy has completed; waits for one if needed.

        Raises:
            PinnedUnavailable: the budget is 0, or pinning memory failed (the caller copies pageable).
        """
        while True:
            if not self.available:
                why = "pinned_budget is 0" if self.budget == 0 else "pinned allocation failed"
                raise PinnedUnavailable(why)
            buf = self.try_acquire(nbytes)
            if buf is not None:
                return buf
            if stop.is_set():
                raise Stopped
            self._wait_for_one()

    def _wait_for_one(self) -> None:
        """Block until a returned buffer's copy completes (its event, the GIL released meanwhile) or, where
        none is back yet, until one is returned (``release`` notifies), at most ``POLL_S`` to look at the
        stop flag."""
        with self._returned:
            pending = next((b for b in self._free if b.busy and b.event is not None), None)
            if pending is None:
                self._returned.wait(POLL_S)
                return
        pending.event.synchronize()

    def try_acquire(self, nbytes: int) -> _Buffer | None:
        """A free buffer of at least ``nbytes`` whose copy completed, a new one within budget, or None."""
        with self._lock:
            # Most recently returned first: a small set of buffers stays in cache and TLB.
            for i in range(len(self._free) - 1, -1, -1):
                buf = self._free[i]
                if buf.nbytes >= nbytes and buf.done():
                    return self._free.pop(i)
            size = 1 << max(12, (nbytes - 1).bit_length())  # torch's pinned blocks are powers of two
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
        with self._returned:
            self._free.append(buf)
            self._returned.notify_all()

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
