"""The pinned buffers a SourceLoader reads into: a bounded pool, allocated on demand, reused for its life.

Invariant: a buffer is handed out again only after the event of the last copy that read it has completed
(:meth:`PinnedPool.release`), so a read never overwrites bytes the copy engine has not yet read.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpufeed import _threads
from gpufeed.host_memory import PinnedUnavailable

#: The pinned memory a SourceLoader's reads may hold, by default.
DEFAULT_PINNED_BUDGET = 512 << 20


class Buffer:
    __slots__ = ("event", "tensor", "views")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.views: dict[Any, Any] = {}  # typed views into this buffer, cached by their user
        self.event: Any = None  # the event of the last copy that read this buffer, until seen complete

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def done(self) -> bool:
        if self.event is not None and not self.event.query():
            return False
        self.event = None
        return True


class PinnedPool:
    """A bounded pool of host buffers (pinned where ``pin``), allocated on demand and reused.

    Each buffer is the power of two at or above its request: the block torch's caching host allocator
    takes for it anyway, and one that a smaller request (the epoch's last batch) reuses. The pool never
    holds more than ``budget`` bytes, except that a single request larger than the budget is served by one
    buffer of that size. Pinned allocation can fail (locked-memory limits): ``available`` is then False
    and the caller reads into pageable memory.

    Example:
        >>> pool = PinnedPool(budget=64 << 20, pin=False)
        >>> buf = pool.acquire(1 << 20, stop=threading.Event())
        >>> pool.release(buf, None)
    """

    def __init__(self, budget: int = DEFAULT_PINNED_BUDGET, pin: bool = True) -> None:
        if budget < 0:
            raise ValueError(f"pinned_budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.pin = pin
        self.available = budget > 0
        self.allocated = 0
        self.allocations = 0
        self._free: list[Buffer] = []
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # notified by release()

    def acquire(self, nbytes: int, stop: threading.Event | None) -> Buffer:
        """A buffer of at least ``nbytes`` whose last copy has completed; waits for one if needed.

        Raises:
            PinnedUnavailable: the budget is 0, or pinning memory failed (the caller reads pageable).
        """
        while True:
            if not self.available:
                why = "pinned_budget is 0" if self.budget == 0 else "pinned allocation failed"
                raise PinnedUnavailable(why)
            buf = self.try_acquire(nbytes)
            if buf is not None:
                return buf
            _threads.check(stop)
            self._wait_for_one()

    def _wait_for_one(self) -> None:
        """Block until a returned buffer's copy completes (the GIL released meanwhile) or, where none is
        back yet, until one is returned, at most ``POLL_S`` to look at the stop flag."""
        with self._returned:
            pending = next((b for b in self._free if b.event is not None), None)
            if pending is None:
                self._returned.wait(_threads.POLL_S)
                return
        pending.event.synchronize()

    def try_acquire(self, nbytes: int) -> Buffer | None:
        """A free buffer of at least ``nbytes`` whose copy completed, a new one within budget, or None."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):  # most recently returned first: warm in cache
                buf = self._free[i]
                if buf.nbytes >= nbytes and buf.done():
                    return self._free.pop(i)
            size = 1 << max(12, (nbytes - 1).bit_length())  # torch's pinned blocks are powers of two
            for buf in [b for b in self._free if b.nbytes < nbytes and b.done()]:
                if self.allocated + size <= self.budget:
                    break
                self._free.remove(buf)  # too small for this request: make room for a bigger one
                self.allocated -= buf.nbytes
            fits = self.allocated + size <= self.budget or (self.allocated == 0 and not self._free)
            if self.available and fits:
                return self._allocate(size)
            return None  # every buffer is out; one comes back when its copy completes

    def release(self, buf: Buffer, event: Any) -> None:
        """Return ``buf``; ``event`` is that of the copy that read it (None: nothing reads it)."""
        buf.event = event
        with self._returned:
            self._free.append(buf)
            self._returned.notify_all()

    def _allocate(self, size: int) -> Buffer | None:
        try:
            tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError:  # cudaHostAlloc refused (locked-memory limit, no driver): go pageable
            self.available = False
            return None
        self.allocated += size
        self.allocations += 1
        return Buffer(tensor)

    def clear(self) -> None:
        """Free every buffer that is back in the pool, once its copy completed."""
        with self._lock:
            for buf in self._free:
                if buf.event is not None:
                    buf.event.synchronize()
                self.allocated -= buf.nbytes
            self._free.clear()
