"""Staging pageable tensors through pinned memory to the device: :class:`Stager`.

A batch's small pageable tensors are packed into one pinned block of torch's caching host allocator and
cross the link in one copy, into one device block they are views of; a tensor larger than a chunk is
pinned and sent chunk by chunk, so chunk ``i + 1`` fills while chunk ``i`` crosses the link.

On the copy stream staging is two steps, so that the device stage can fence the copies once for the
whole batch: :meth:`Stager.prepare` allocates the device tensors (on the current stream, the consumer's)
and returns the jobs that fill pinned memory and issue the copies, which the device stage runs on its copy
stream. On the loop's own stream it is one: :meth:`Stager.send` pins and copies at once, in the loop's
order.
Pinned blocks are written again only after the copy that read them completed: torch's caching host
allocator records an event on a block at every ``non_blocking`` copy from it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _unflatten_dense_tensors

from gpufeed import host_memory

MiB = 1 << 20
#: One staging chunk: the unit pinned and sent to the device (docs/design.md says why 32).
CHUNK_BYTES = 32 * MiB
#: Each packed tensor starts on a cache line (a multiple of any dtype's size, and of 16-byte loads).
ALIGN = 64
#: Tensors of at most this many bytes are packed: their time on the link is a small part of what the torch
#: calls of a copy of their own cost (docs/design.md, "Staging pageable tensors").
PACK_LEAF_BYTES = 64 << 10
#: A packed block's size at most: a packed tensor the loop keeps (targets gathered for a metric) keeps the
#: whole block alive on the device, so at most this much beside it.
PACK_BYTES = 1 << 20

Job = Callable[[], None]


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


class Stager:
    """Copies pageable host tensors to the device through pinned memory.

    Example:
        >>> outs, jobs = Stager(chunk_bytes=4096, pin=False).prepare([torch.arange(3000), torch.ones(2)],
        ...                                                           torch.device("cpu"))
        >>> for job in jobs:
        ...     job()
        >>> outs[0].sum().item(), outs[1].tolist()
        (4498500, [1.0, 1.0])
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, pin: bool = True, parallel: bool = True) -> None:
        self.chunk_bytes = chunk_bytes
        self.pin = pin
        # torch's parallel copy pins a tensor fastest where the cores are free; one thread's copy
        # (host_memory.pin_one_thread) waits for no core where the pipeline's threads hold them. Packed
        # tensors (64 KiB at most) and a non-contiguous one's .contiguous() are copied by torch either way.
        self.parallel = parallel

    def prepare(self, tensors: list[torch.Tensor],
                device: torch.device) -> tuple[list[torch.Tensor], list[Job]]:
        """The device tensors ``tensors`` will be copied into (allocated now, contiguous), and the jobs that
        fill pinned memory and issue those copies on the then current stream.

        A job raises :class:`~gpufeed.host_memory.PinnedUnavailable` where pinned memory cannot be had.
        """
        outs: list[Any] = [None] * len(tensors)
        jobs = [self._job(group, tensors, outs, device) for group in self._groups(tensors)]
        return outs, [job for job in jobs if job is not None]

    def send(self, tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """The device copies of ``tensors``, issued now on the current stream: a tensor of its own as
        pinned, then ``.to(device, non_blocking=True)`` (one call that allocates and copies, as a loop
        without gpufeed does), small ones packed as :meth:`prepare` packs them.

        Raises :class:`~gpufeed.host_memory.PinnedUnavailable` where pinned memory cannot be had.
        """
        outs: list[Any] = [None] * len(tensors)
        for group in self._groups(tensors):
            t = tensors[group[0]]
            if len(group) == 1 and 0 < t.nbytes <= self.chunk_bytes:
                outs[group[0]] = self.pinned(t.contiguous()).to(device, non_blocking=True)
                continue
            job = self._job(group, tensors, outs, device)  # (packed, or sent chunk by chunk, as prepare's)
            if job is not None:
                job()
        return outs

    def each_alone(self, tensors: list[torch.Tensor]) -> bool:
        """Whether :meth:`send` would send each of ``tensors`` alone, in one copy: no two pack together
        (:meth:`_groups`) and none is larger than a chunk. Each is then :meth:`pinned`, then copied."""
        packed, small = self._packed_at_most(), 0
        for t in tensors:
            n = t.nbytes
            if n > self.chunk_bytes:
                return False
            small += 0 < n <= packed
        return small < 2

    def _packed_at_most(self) -> int:
        """A tensor of more bytes than this is sent by itself (a packed block holds PACK_BYTES at most)."""
        return min(PACK_LEAF_BYTES, self.chunk_bytes, PACK_BYTES)

    def _job(self, group: list[int], tensors: list[torch.Tensor], outs: list[Any],
             device: torch.device) -> Job | None:
        """Allocate the device tensors of ``group`` (into ``outs``); the job that copies them, packed or a
        tensor alone (None for an empty one)."""
        if len(group) > 1:
            return self._pack([tensors[j] for j in group], group, outs, device)
        t = tensors[group[0]]
        outs[group[0]] = torch.empty(t.shape, dtype=t.dtype, device=device)
        return functools.partial(self._send, t, outs[group[0]]) if t.numel() else None

    def _groups(self, tensors: list[torch.Tensor]) -> list[list[int]]:
        """The indices of ``tensors`` in the order they are sent: a tensor alone (larger than
        ``PACK_LEAF_BYTES``, or empty), or small ones packed together, up to ``PACK_BYTES`` a pack."""
        limit = min(self.chunk_bytes, PACK_BYTES)  # a packed block's size at most
        alone = self._packed_at_most()
        groups: list[list[int]] = []
        pack: list[int] = []  # the tensors of the next packed block
        size = 0  # their bytes, each rounded up to ALIGN
        for i, t in enumerate(tensors):
            if t.nbytes > alone or t.numel() == 0:
                groups.append([i])
                continue
            if pack and size + aligned(t.nbytes) > limit:
                groups.append(pack)
                pack, size = [], 0
            pack.append(i)
            size += aligned(t.nbytes)
        if pack:
            groups.append(pack)
        return groups

    def _pack(self, members: list[torch.Tensor], where: list[int], outs: list[torch.Tensor],
              device: torch.device) -> Job:
        """One device block for ``members``, their outputs views of it; the job fills one pinned block the
        same way and copies it whole. The tensors of one dtype lie in a region of their own, each at an
        ``ALIGN``-aligned offset (padding between them described by meta tensors), so that each region's
        views and copies are one torch call for all its tensors (``_unflatten_dense_tensors``,
        ``_foreach_copy_``, as DDP's gradient buckets do), not a few per tensor."""
        regions: dict[torch.dtype, list[int]] = {}
        for k, t in enumerate(members):
            regions.setdefault(t.dtype, []).append(k)
        spans, end = [], 0
        for dtype, ks in regions.items():
            layout: list[torch.Tensor] = []  # each tensor, then the padding to the next aligned offset
            at: list[int] = []  # where each tensor is in ``layout``
            for k in ks:
                at.append(len(layout))
                layout.append(members[k])
                pad = aligned(members[k].nbytes) - members[k].nbytes
                if pad:
                    layout.append(_padding(pad // members[k].element_size(), dtype))
            nbytes = sum(t.nbytes for t in layout)
            spans.append((dtype, ks, layout, at, end, nbytes))
            end += nbytes
        dev = torch.empty(end, dtype=torch.uint8, device=device)
        for dtype, ks, layout, at, off, nbytes in spans:
            views = _unflatten_dense_tensors(dev[off : off + nbytes].view(dtype), layout)
            for k, j in zip(ks, at, strict=True):
                outs[where[k]] = views[j]

        def job() -> None:
            host = self._empty(end)
            for dtype, ks, layout, at, off, nbytes in spans:
                views = _unflatten_dense_tensors(host[off : off + nbytes].view(dtype), layout)
                torch._foreach_copy_([views[j] for j in at], [members[k] for k in ks])
            dev.copy_(host, non_blocking=True)

        return job

    def _send(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """Pin ``t`` (chunk by chunk when larger than a chunk) and copy it into ``out``."""
        t = t.contiguous()
        if t.nbytes <= self.chunk_bytes:
            out.copy_(self.pinned(t), non_blocking=True)
            return
        src, dst = byte_view(t), byte_view(out)
        for a in range(0, src.numel(), self.chunk_bytes):
            piece = src[a : a + self.chunk_bytes]
            dst[a : a + piece.numel()].copy_(self.pinned(piece), non_blocking=True)

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in pinned memory (a copy from pageable memory where pinning is off)."""
        if not self.pin:
            return t.clone()
        return host_memory.pin(t) if self.parallel else host_memory.pin_one_thread(t)

    def _empty(self, nbytes: int) -> torch.Tensor:
        return host_memory.pinned_empty(nbytes) if self.pin else torch.empty(nbytes, dtype=torch.uint8)
