"""Staging pageable tensors through pinned memory to the device: :class:`Stager`.

A batch's pageable tensors are copied into pinned buffers from torch's caching host allocator (torch's
parallel copy, GIL released), packed so that each buffer crosses the link in one copy, and sent on the
current (copy) stream; a tensor larger than a chunk goes alone, chunk by chunk, so chunk ``i + 1`` fills
while chunk ``i`` crosses the link.

Invariant: pinned memory is written again only after the event recorded behind the copy that read it has
completed; torch's allocator keeps it (a ``non_blocking`` copy from a pinned block records an event on
it). A BatchSource's reads use :class:`~gpufeed.pinned_pool.PinnedPool` instead.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch._utils import _unflatten_dense_tensors

MiB = 1 << 20
#: One staging chunk: the unit filled into pinned memory and sent to the device (docs/design.md says why 32).
DEFAULT_CHUNK_BYTES = 32 * MiB
#: The pinned memory a BatchSource's reads may hold (``PinnedPool``).
DEFAULT_PINNED_BUDGET = 512 * MiB


class PinnedUnavailable(RuntimeError):
    """Pinned memory is not available (a budget of 0, or the allocation failed): copy from pageable memory."""


class Stager:
    """Copies pageable host tensors to the device through pinned memory, on the current stream.

    :meth:`stage` packs a batch's tensors of at most ``PACK_LEAF_BYTES`` into pinned buffers of up to
    ``PACK_BYTES`` and sends each buffer with one ``non_blocking`` copy; those device tensors are views of
    one device allocation per buffer. Every torch call costs microseconds, so a batch of many small
    tensors pays one allocation and one copy per buffer instead of one each per tensor. Larger tensors,
    and a tensor alone in its buffer, go one by one through ``pin_memory()``; one larger than
    ``chunk_bytes`` is cut into chunks of ``chunk_bytes``, each pinned and sent in turn, so the fill of
    chunk ``i + 1`` overlaps the copy of chunk ``i`` on the link. torch's allocator hands a pinned block
    out again only after the event that its ``non_blocking`` copy recorded has completed.

    Example:
        >>> stager = Stager(chunk_bytes=4096, pin=False)
        >>> stager.to(torch.arange(3000), torch.device("cpu")).sum().item()
        4498500
        >>> moved, allocations = stager.stage([torch.ones(2, 3), torch.arange(5)], torch.device("cpu"))
        >>> [t.tolist() for t in moved], len(allocations)
        ([[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [0, 1, 2, 3, 4]], 1)
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin: bool = True) -> None:
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.pin = pin

    def stage(self, tensors: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor],
                                                                               list[torch.Tensor]]:
        """``tensors`` on ``device`` (contiguous, whatever their strides on the host), and the device
        allocations they are views of (what the caller records on the streams that use them).

        Raises:
            PinnedUnavailable: pinned memory could not be allocated (the caller copies from pageable).
        """
        moved: list[torch.Tensor] = list(tensors)
        allocations: list[torch.Tensor] = []
        limit = min(self.chunk_bytes, PACK_BYTES)
        pack: list[int] = []  # the tensors of the next buffer
        size = 0  # their bytes, each rounded up to ALIGN
        for i, t in enumerate(tensors):
            if t.numel() == 0:  # no bytes to send (and _unflatten_dense_tensors would drop its shape)
                moved[i] = torch.empty(t.shape, dtype=t.dtype, device=device)
                continue
            if t.nbytes > min(PACK_LEAF_BYTES, limit):
                moved[i] = self.to(t, device)
                allocations.append(moved[i])
                continue
            slot = aligned(t.nbytes)
            if pack and size + slot > limit:
                allocations.append(self._send(tensors, pack, device, moved))
                pack, size = [], 0
            pack.append(i)
            size += slot
        if pack:
            allocations.append(self._send(tensors, pack, device, moved))
        return moved, allocations

    def _send(self, tensors: list[torch.Tensor], pack: list[int], device: torch.device,
              moved: list[torch.Tensor]) -> torch.Tensor:
        """Copy the tensors of ``pack`` into one pinned buffer, send it, and set their device views. The
        tensors of one dtype lie in a region of their own, each at an ``ALIGN``-aligned offset (padding
        between them is described by meta tensors), so that each region's views and copies are one torch
        call for all its tensors (``_unflatten_dense_tensors``, ``_foreach_copy_``, as DDP's gradient
        buckets do), not a few per tensor."""
        if len(pack) == 1:  # alone in its buffer: pin_memory() allocates and copies in one call
            moved[pack[0]] = self.to(tensors[pack[0]], device)
            return moved[pack[0]]
        regions: dict[torch.dtype, list[int]] = {}
        for i in pack:
            regions.setdefault(tensors[i].dtype, []).append(i)
        spans, end = [], 0
        for dtype, members in regions.items():
            layout: list[torch.Tensor] = []  # each tensor, then the padding to the next aligned offset
            at: list[int] = []  # where each tensor is in ``layout``
            for i in members:
                at.append(len(layout))
                layout.append(tensors[i])
                pad = aligned(tensors[i].nbytes) - tensors[i].nbytes
                if pad:
                    layout.append(_padding(pad // tensors[i].element_size(), dtype))
            nbytes = sum(t.nbytes for t in layout)
            spans.append((dtype, members, layout, at, end, nbytes))
            end += nbytes
        host = self._pinned_empty(max(1, end))
        for dtype, members, layout, at, off, nbytes in spans:
            views = _unflatten_dense_tensors(host[off : off + nbytes].view(dtype), layout)
            torch._foreach_copy_([views[j] for j in at], [tensors[i] for i in members])
        dev = host.to(device, non_blocking=True)
        for dtype, members, layout, at, off, nbytes in spans:
            views = _unflatten_dense_tensors(dev[off : off + nbytes].view(dtype), layout)
            for i, j in zip(members, at, strict=True):
                moved[i] = views[j]
        return dev

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

    def _pinned_empty(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as exc:  # cudaHostAlloc refused (locked-memory limit)
            raise PinnedUnavailable(f"pinned allocation failed: {exc}") from exc


#: Each packed tensor, and each field's region in a source's staging buffer, starts on a cache line (a
#: multiple of any dtype's size, and of 16-byte loads).
ALIGN = 64
#: Tensors of at most this many bytes are packed: their time on the link is a small part of what the torch
#: calls of a copy of their own cost (docs/design.md, "Staging pageable tensors").
PACK_LEAF_BYTES = 64 << 10
#: A packed buffer's size at most: a packed tensor the loop keeps (targets gathered for a metric) keeps the
#: whole buffer alive on the device, so at most this much beside it.
PACK_BYTES = 1 << 20


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


@functools.lru_cache(maxsize=256)
def _padding(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor without storage describing ``numel`` elements of padding in a packed region."""
    return torch.empty(numel, dtype=dtype, device="meta")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)


def warn_pageable(reason: str) -> None:
    warnings.warn(
        f"gpufeed: pinned staging is off ({reason}); falling back to pageable host-to-device copies, "
        "which are slower and may stall. Raise the locked-memory limit (ulimit -l) or pinned_budget.",
        RuntimeWarning,
        stacklevel=3,
    )
