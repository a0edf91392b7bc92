"""Host tensors for batches read on the CPU, reused once nothing outside the pool references them."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np
import torch


class _Slot:
    """One batch's host memory: a byte array per field, big enough for ``rows`` rows.

    Each batch is made by ``torch.from_numpy`` over these arrays, so every tensor, view, storage, numpy
    array or DLPack capsule that can reach a batch's bytes keeps a reference to its array alive: the
    slot is free exactly when each array's reference count is back to what it was when the slot was made.
    """

    __slots__ = ("arrays", "counts", "layout", "rows")

    def __init__(self, layout: tuple[Any, ...], fields: Any, rows: int) -> None:
        self.layout, self.rows = layout, rows
        self.arrays = {k: np.empty(rows * f.sample_nbytes, dtype=np.uint8) for k, f in fields.items()}
        self.counts = [sys.getrefcount(a) for a in self.arrays.values()]

    def free(self) -> bool:
        return [sys.getrefcount(a) for a in self.arrays.values()] == self.counts

    def views(self, fields: Any, n: int) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(self.arrays[k][: n * f.sample_nbytes]).view(f.dtype).view(n, *f.shape)
                for k, f in fields.items()}


class CpuBuffers:
    """A bounded set of host tensors that batches read on the CPU land in, reused across batches.

    A fresh ``torch.empty`` per batch pays a page fault for every page on its first write; reused
    tensors have their pages mapped already (docs/design.md, "Batches on the CPU").

    Invariant: a slot is handed out again only when nothing but the pool references its memory
    (:meth:`_Slot.free`): while the user holds a batch, any tensor of it, a view, a storage or a numpy
    array made from it, its slot stays busy, so a kept batch is never overwritten. When every slot is
    busy a batch gets fresh tensors, which the pool does not keep; the pool holds at most ``slots``
    batches of memory beyond what its users hold.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"CpuBuffers: slots must be >= 1, got {slots}")
        self.slots = slots
        self._all: list[_Slot] = []
        self._lock = threading.Lock()  # epochs of one prefetcher may overlap while one shuts down
        self._pid = os.getpid()

    def take(self, fields: Any, n: int) -> dict[str, torch.Tensor]:
        """Tensors of ``n`` rows for every field of ``fields`` (name -> ``.shape``, ``.dtype``)."""
        layout = tuple((k, f.dtype, tuple(f.shape)) for k, f in fields.items())
        with self._guard():  # the views are made inside: they are what marks the slot busy
            slot = self._find(layout, n, fields)
            if slot is not None:
                return slot.views(fields, n)
        return {k: torch.empty((n, *f.shape), dtype=f.dtype) for k, f in fields.items()}

    def _find(self, layout: tuple[Any, ...], n: int, fields: Any) -> _Slot | None:
        free = [s for s in self._all if s.free()]
        for s in free:
            if s.layout == layout and s.rows >= n:
                return s
        if len(self._all) >= self.slots:
            if not free:
                return None
            self._all.remove(free[0])  # a free slot of another size or layout makes room
        slot = _Slot(layout, fields, n)
        self._all.append(slot)
        return slot

    def _guard(self) -> threading.Lock:
        if self._pid != os.getpid():  # a forked child: the lock may be held by a thread it does not have
            self._pid, self._lock, self._all = os.getpid(), threading.Lock(), []
        return self._lock

    def clear(self) -> None:
        self._all = []  # no lock: a forked child's atexit close must not wait on its parent's threads
