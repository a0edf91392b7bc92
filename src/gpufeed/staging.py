"""Staging a pageable tensor through pinned memory to the device: :class:`Stager`.

The tensor is copied into pinned memory from torch's caching host allocator (torch's parallel copy, GIL
released) and sent on the current (copy) stream; a tensor larger than a chunk goes chunk by chunk, so
chunk ``i + 1`` fills while chunk ``i`` crosses the link.

Invariant: pinned memory is written again only after the event recorded behind the copy that read it has
completed; torch's allocator keeps it (a ``non_blocking`` copy from a pinned block records an event on
it). A BatchSource's reads use :class:`~gpufeed.pinned_pool.PinnedPool` instead.
"""

from __future__ import annotations

import warnings

import torch

MiB = 1 << 20
#: One staging chunk: the unit filled into pinned memory and sent to the device (docs/design.md says why 32).
DEFAULT_CHUNK_BYTES = 32 * MiB
#: The pinned memory a BatchSource's reads may hold (``PinnedPool``).
DEFAULT_PINNED_BUDGET = 512 * MiB


class PinnedUnavailable(RuntimeError):
    """Pinned memory is not available (a budget of 0, or the allocation failed): copy from pageable memory."""


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
