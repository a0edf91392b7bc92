"""``default_collate`` into pinned memory: :func:`pinned_collate`, for pipelines that collate in the main
process (a torchdata ``nodes`` pipeline's ``Mapper``).

``default_collate`` stacks each field's samples into a new pageable tensor; pinning that batch before its
copy to the GPU then copies every byte again, with torch's parallel copy, on whichever thread pins it.
Stacked straight into a block of torch's caching host allocator, the batch is pinned with no copy of its
own: the stack ``default_collate`` makes anyway writes the pinned block (docs/design.md, "Threads beside
the loop"). A block is handed out again only once the ``non_blocking`` copy that read it completed (torch
records an event on it at every such copy).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
)

from gpufeed import host_memory
from gpufeed.host_memory import plain

__all__ = ["pinned_collate"]


def pinned_collate(samples: Any) -> Any:
    """``default_collate(samples)``, its stacked tensors already in pinned memory.

    The same batch as ``default_collate`` (structure, dtypes, values), and the same errors where it raises;
    a stacked tensor is contiguous (as ``default_collate`` makes it in a DataLoader worker: in the main
    process it keeps a ``channels_last`` layout of its samples). Where pinning cannot be had it is
    ``default_collate``: without CUDA, inside a DataLoader worker (which collates into shared memory, and
    must not touch CUDA) or a child forked after CUDA was initialised, or after a pinned allocation failed
    (said once, as a ``RuntimeWarning``). Use it where the main process collates: in a process worker the
    pinning would be lost on the way to the main process. Fields it does not stack into a block (numbers,
    strings, tensors that require grad in grad mode) come out as ``default_collate`` makes them, and tensors
    of different shapes raise its error.

    Example:
        >>> batch = pinned_collate([{"x": torch.ones(2), "y": 0}, {"x": torch.zeros(2), "y": 1}])
        >>> batch["x"].tolist(), batch["y"].tolist()
        ([[1.0, 1.0], [0.0, 0.0]], [0, 1])
    """
    if not _can_pin():
        return default_collate(samples)
    return collate(samples, collate_fn_map={**default_collate_fn_map, torch.Tensor: _stack_pinned})


def _stack_pinned(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """``default_collate``'s rule for tensors, stacking into a pinned block. ``torch.stack`` checks the
    samples' shapes, devices and layouts (and autograd, in grad mode), and raises where it cannot stack
    them into the block: ``default_collate``'s own stack then makes the field, or raises its error. What it
    would let through is checked first (:func:`_one_kind`). The check is per sample, on the thread that
    collates, which in a nodes pipeline shares the GIL with the threads that set its rate: torch checks
    the rest in C++. (Whether this process can pin at all is asked once a batch, by ``pinned_collate``;
    only a failed allocation, in an earlier field, changes it within one.)"""
    if _failed or not _one_kind(batch):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    elem = batch[0]
    try:
        block = host_memory.pinned_empty(len(batch) * elem.nbytes)
    except host_memory.PinnedUnavailable as exc:
        _pinning_failed(str(exc))
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    out = block.view(elem.dtype).view(len(batch), *elem.shape)
    try:
        return torch.stack(batch, 0, out=out)
    except Exception:  # whatever it refuses, default_collate's stack decides (the block goes back)
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def _one_kind(batch: list[torch.Tensor]) -> bool:
    """Whether the first sample is a :func:`~gpufeed.host_memory.plain` tensor with bytes, not requiring
    grad, and every sample a ``torch.Tensor`` of its dtype: what ``torch.stack`` into its block would not
    refuse by itself. A sample of another dtype would be cast into the block's, where ``default_collate``
    promotes; a subclass's own ``__torch_function__`` may treat ``out=`` its own way, so its field is
    collated as ``default_collate`` collates it. A sample of another shape, device or layout, quantized or
    nested, torch refuses, and one requiring grad in grad mode (outside it, the stack makes what
    ``default_collate``'s does: no grad)."""
    elem = batch[0]
    if not (plain(elem) and elem.nbytes) or elem.requires_grad:
        return False
    tensor, dtype = torch.Tensor, elem.dtype
    for t in batch:  # noqa: SIM110 (a loop: 0.08 us a sample, where all() over a generator takes 0.2)
        if type(t) is not tensor or t.dtype is not dtype:
            return False
    return True


_failed = False  # a pinned allocation failed in this process: collate as default_collate from then on


def _can_pin() -> bool:
    """Not after a failed allocation, nor in a DataLoader worker, nor without CUDA, nor in a child forked
    after CUDA was initialised (a torchdata ``ParallelMapper``'s process worker), where CUDA cannot run."""
    return (not _failed and get_worker_info() is None and _cuda_available()
            and not torch.cuda._is_in_bad_fork())


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _pinning_failed(reason: str) -> None:
    global _failed
    if not _failed:
        _failed = True
        host_memory.warn_pageable(reason)
