"""Host memory: every byte gpufeed pins, shares with workers or reuses on the host, and when it goes back.

This package is the only place gpufeed pins memory:

* :func:`pin`, :func:`pin_one_thread` and :func:`pinned_empty`: blocks of torch's caching host allocator,
  for staging pageable tensors (a block is handed out again only once the copy that read it completed:
  torch records an event on it at every ``non_blocking`` copy);
* :class:`~gpufeed.host_memory.pinned_pool.PinnedPool`: the bounded buffers a ``SourceLoader`` reads into;
* :class:`~gpufeed.host_memory.worker_arena.WorkerArena`: shared memory a DataLoader's workers collate
  into, registered with CUDA once;
* :func:`~gpufeed.host_memory.pinned_collate.pinned_collate`: ``default_collate`` stacking into blocks of
  torch's caching host allocator, for a pipeline that collates in the main process;
* :class:`~gpufeed.host_memory.cpu_buffers.CpuBuffers`: reused pageable tensors for batches read on the CPU.

A host batch carries a *lease*: a function the device stage calls with the event of the copy that read
the batch, after which its memory goes back to its owner once that event completed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

#: A lease: called once with the event of the copy that read the batch (None: nothing is in flight).
Lease = Callable[[Any], None]


class HostBatch(NamedTuple):
    """What a loader hands the device stage: a batch of host (or device) tensors, the lease of its memory
    (None where the memory is not gpufeed's), and the loader's state right after this batch."""

    batch: Any
    lease: Lease | None = None
    state: Any = None


class PinnedUnavailable(RuntimeError):
    """Pinned memory is not available (a budget of 0, or the allocation failed): copy from pageable memory."""


def pin(t: Any) -> Any:
    """``t`` copied into a pinned block of torch's caching host allocator (or a batch type of its own that
    pins itself, by its ``pin_memory()``)."""
    try:
        return t.pin_memory()
    except RuntimeError as exc:  # cudaHostAlloc refused (locked-memory limit)
        raise PinnedUnavailable(f"pinned allocation failed: {exc}") from exc


def pin_one_thread(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a pinned block of torch's caching host allocator by one thread (numpy's copy, the
    GIL released), where :func:`pin` runs torch's parallel copy. For a thread beside others busy with torch
    ops: a parallel copy ends only once each of its threads had a core (docs/design.md, "Threads beside the
    loop: a parallel copy waits for cores"). What numpy cannot read as plain bytes (not :func:`plain`, a
    zero tensor, not contiguous, requiring grad, with a conjugate or negative bit) is pinned by
    :func:`pin`."""
    if (not plain(t) or t._is_zerotensor() or not t.is_contiguous() or t.requires_grad or t.is_conj()
            or t.is_neg()):
        return pin(t)
    out = pinned_empty(t.nbytes)
    np.copyto(out.numpy(), t.reshape(-1).view(torch.uint8).numpy())
    return out.view(t.dtype).reshape(t.shape)


def plain(t: torch.Tensor) -> bool:
    """A plain strided CPU tensor: one whose bytes memory of gpufeed's can hold as they are (a subclass, such
    as torchvision's ``tv_tensors``, would come back a plain tensor; a nested one has no single shape)."""
    return (type(t) is torch.Tensor and t.is_cpu and t.layout == torch.strided and not t.is_quantized
            and not t.is_nested)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised pinned block of ``nbytes`` from torch's caching host allocator."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        raise PinnedUnavailable(f"pinned allocation failed: {exc}") from exc


def register(t: torch.Tensor) -> None:
    """Pin the memory of an existing host tensor in place (``cudaHostRegister``)."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0))


def unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def warn_pageable(reason: str, fix: str = "raise the locked-memory limit (ulimit -l)") -> None:
    """Say that copies fall back to pageable memory (slower, and they may stall); each owner says it once."""
    warnings.warn(f"gpufeed: pinned memory is unavailable ({reason}); copying from pageable memory, which "
                  f"is slower and may stall the loop: {fix}", RuntimeWarning, stacklevel=3)
