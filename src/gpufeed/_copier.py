"""The background thread's per-batch work: move every leaf of a batch to the device."""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from gpufeed import _driver, _nvtx, staging
from gpufeed._tracing import TraceRecorder
from gpufeed._tree import flatten
from gpufeed.staging import (
    Chunk,
    ChunkPipeline,
    PinnedPool,
    PinnedUnavailable,
    RawChunk,
    align,
    layout,
    plan_chunks,
    plan_raw,
    warn_pageable,
)
from gpufeed.stats import PrefetchStats


@dataclass
class WithState:
    """A batch fetched from a stateful loader, with the loader's state right after fetching it."""

    batch: Any
    state: Any


@dataclass
class Delivered:
    """A batch on the device, ready to hand over once the consumer's stream waits on ``event``."""

    batch: Any
    event: torch.cuda.Event | None = None
    fresh: list[torch.Tensor] = field(default_factory=list)  # device tensors this prefetcher allocated
    state: Any = None
    event_device: torch.device | None = None
    handed: bool = False  # the consumer's stream waits on ``event``: the copier may record it again
    recorded: Any = None  # a tensor of ``fresh`` recorded on the consumer's stream already (a prebuilt block)

    def handover(self, expected: torch.cuda.Stream | None) -> Any:
        """Make the consumer's current stream wait on this batch's event only, then return the batch."""
        if self.event is not None:
            index = self.event_device.index
            raw = _raw_stream(index)
            if raw == expected.cuda_stream:  # the usual case: no Stream object built
                if not _driver.wait_event(raw, self.event.cuda_event):  # keeps the GIL (see _driver)
                    self.event.wait(expected)
            else:  # consumer switched streams since the epoch started: wait and fence there too
                stream = torch.cuda.current_stream(index)
                self.event.wait(stream)
                for t in self.fresh:
                    t.record_stream(stream)
            self.handed = True
        return self.batch


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _OnStream:
    """``with torch.cuda.stream(stream)`` for the background thread, in two C calls instead of a dozen
    Python ones (a Stream object built per call): the stream's (id, device, type) is kept once."""

    __slots__ = ("_prev", "_stream", "_to")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._to = (stream.stream_id, stream.device_index, stream.device_type)
        self._prev: Any = None

    def __enter__(self) -> None:
        if _get_stream is None or _set_stream is None:
            self._prev = torch.cuda.stream(self._stream)
            self._prev.__enter__()
            return
        self._prev = _get_stream(self._to[1])
        _set_stream(stream_id=self._to[0], device_index=self._to[1], device_type=self._to[2])

    def __exit__(self, *exc: Any) -> None:
        prev, self._prev = self._prev, None
        if isinstance(prev, tuple):
            _set_stream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
        else:
            prev.__exit__(*exc)


_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)


@dataclass
class _Block:
    """One device allocation for a batch's staged leaves of ``signature`` and their views into it."""

    signature: tuple[tuple[torch.Size, torch.dtype], ...]
    block: torch.Tensor
    views: list[torch.Tensor]
    sizes: list[int]


def _make_block(signature: tuple[tuple[torch.Size, torch.dtype], ...], device: torch.device,
                consumer: torch.cuda.Stream | None) -> _Block:
    """The device block and views for staged leaves of ``signature``, allocated on the current stream.

    The leaves lie end to end as the chunks stage them (``staging.layout``), each a contiguous view of
    the block seen as its dtype. With ``consumer``, the block is recorded on it now (``record_stream``
    may come before the block's use: its effect is at the free).
    """
    sizes = [shape.numel() * dtype.itemsize for shape, dtype in signature]
    offsets, total = layout(sizes)
    block = torch.empty(align(total), dtype=torch.uint8, device=device)
    typed: dict[torch.dtype, torch.Tensor] = {}  # the block seen as each dtype, once per block
    views = []
    for (shape, dtype), off in zip(signature, offsets, strict=True):
        view = typed.get(dtype)
        if view is None:
            view = typed[dtype] = block.view(dtype)
        views.append(view.as_strided(shape, _contiguous_strides(shape), off // dtype.itemsize))
    if consumer is not None:
        block.record_stream(consumer)
    return _Block(signature, block, views, sizes)


def _is_pinned(t: torch.Tensor) -> bool:
    """``t.is_pinned()``, asked of the driver without releasing the GIL where it can."""
    pinned = _driver.is_pinned(t.data_ptr())
    return t.is_pinned() if pinned is None else pinned


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class Copier:
    """Moves batches to ``device``: pinned tensors directly, pageable ones through the pinned pool.

    Lives in the background thread. Device tensors are allocated on the copy stream and recorded
    on the consumer's stream before the batch is handed over (see :class:`CudaPrefetcher`).
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None, pipeline: ChunkPipeline,
                 pool: PinnedPool, stats: PrefetchStats, transform: Callable[[Any], Any] | None,
                 trace: TraceRecorder | None = None) -> None:
        self.device = device
        self.stream = stream
        self._stream_handle = stream.cuda_stream if stream is not None else 0
        self._on_stream = _OnStream(stream) if stream is not None else None
        self._consumer: torch.cuda.Stream | None = None
        # The next batch's device block, made on a worker thread while this batch stages (see _block)
        self._next_block: Future | None = None
        self.pipeline = pipeline
        self.pool = pool
        self.stats = stats
        self.transform = transform
        self.trace = trace
        # GPUFEED_STAGE_COPY=threads: pageable leaves are filled by worker memmoves of this size
        self._leaf_fill = pool.fill_bytes if staging.STAGE_COPY == "threads" else None
        # Per batch, (start, end, the Delivered that carries end): the copy's timing events. Events are
        # reused (recorded again through the driver, which keeps the GIL): a start event once its batch's
        # copies completed, an end event once the consumer's stream also waits on it (or never will).
        self._timings: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event, Any]] = collections.deque()
        self._handing: collections.deque[tuple[torch.cuda.Event, Any]] = collections.deque()
        self._events: list[torch.cuda.Event] = []
        self._retire: collections.deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = collections.deque()

    def deliver(self, raw: Any, index: int, stop: threading.Event,
                consumer: torch.cuda.Stream | None) -> Delivered:
        state = None
        self._consumer = consumer
        if isinstance(raw, WithState):
            raw, state = raw.batch, raw.state
        t0 = time.perf_counter()
        read = getattr(raw, "gpufeed_read", None)
        if read is not None:  # a source-mode batch: the source reads into our buffers
            out = read(self, stop)
        elif self.stream is None:
            out = self._to_cpu(raw)
        else:
            out = self._to_cuda(raw, stop)
        if self.trace is not None:
            name = "read+copy" if read is not None else "stage+copy"
            self.trace.add(name, int(t0 * 1e9), int(time.perf_counter() * 1e9), "gpufeed-fetch", batch=index)
        out.state = state
        if self.stream is not None:
            out.event_device = self.device
            for t in out.fresh:
                if t is not out.recorded:
                    t.record_stream(consumer)
        return out

    # -- CPU path ----------------------------------------------------------------------------------

    def _to_cpu(self, raw: Any) -> Delivered:
        leaves, rebuild = flatten(raw)
        moved = [t if t.device.type == "cpu" else t.cpu() for t in leaves]
        self.stats.add(bytes=sum(t.numel() * t.element_size() for t in moved))
        return self.seal(rebuild(moved), [], None)

    # -- CUDA path ---------------------------------------------------------------------------------

    def _to_cuda(self, raw: Any, stop: threading.Event) -> Delivered:
        leaves, rebuild = flatten(raw)
        out: list[torch.Tensor | None] = []
        fresh: list[torch.Tensor] = []
        keep: list[torch.Tensor] = []
        staged_at: list[int] = []  # indices in ``out`` of the leaves staged through pinned buffers
        nbytes = staged = 0
        block: _Block | None = None
        with self._on_stream, _nvtx.range("gpufeed.copy"):
            start = self._begin()
            pinned_ok: bool | None = None  # asked at the first pageable leaf (it warns once when False)
            device = self.device
            for t in leaves:
                if t.is_cuda and t.device == device:
                    out.append(t)  # already there: not copied again
                    continue
                n = t.nbytes
                nbytes += n
                pageable = n > 0 and not t.is_cuda and not _is_pinned(t)
                if pageable and (pinned_ok if pinned_ok is not None else (pinned_ok := self._pinned_ok())):
                    staged_at.append(len(out))
                    out.append(None)  # a view of the batch's device block, below
                    continue
                dst = torch.empty(t.shape, dtype=t.dtype, device=device)
                out.append(dst)
                fresh.append(dst)
                if pageable:
                    dst.copy_(t)  # pinned staging is off: pageable copy, still off the consumer's thread
                elif n:
                    dst.copy_(t, non_blocking=True)
                    keep.append(t)
            chunks: list[Chunk] | list[RawChunk] = []
            lib = None
            if staged_at:
                # The staged leaves share one device allocation, laid out as the chunks are: one
                # allocation, one host-to-device copy per chunk and one record_stream per batch.
                # (srcs need not outlive the call: staging reads them to the end first.)
                srcs = [leaves[i].contiguous() for i in staged_at]
                block = self._block(tuple((src.shape, src.dtype) for src in srcs))
                fresh.append(block.block)
                for i, view in zip(staged_at, block.views, strict=True):
                    out[i] = view
                staged = sum(block.sizes)
                lib = self.pipeline.staged_lib() if self._leaf_fill is None else None
                cb = self.pool.chunk_bytes
                if lib is not None:  # addresses only: the whole batch in one or two GIL-free calls
                    leaves_at = [(src.data_ptr(), n) for src, n in zip(srcs, block.sizes, strict=True)]
                    chunks = plan_raw(leaves_at, cb, block.block.data_ptr())
                    self._prepare(block.signature)
                else:
                    chunks = plan_chunks([(src, None) for src in srcs], cb, self._leaf_fill, block.block)
            t0 = time.perf_counter()
            with _nvtx.range("gpufeed.stage"):
                try:
                    if lib is not None:
                        self.pipeline.run_raw(lib, chunks, stop)
                    else:
                        self.pipeline.run(chunks, stop)
                except PinnedUnavailable:  # pinning failed mid-way: copy this batch from pageable memory
                    self._pinned_ok()
                    for i in staged_at:
                        out[i].copy_(leaves[i])
            stage_s = time.perf_counter() - t0
            delivered = self.seal(rebuild(out), fresh, start, keep)
            if block is not None:
                delivered.recorded = block.block
        self.stats.add(bytes=nbytes, staged_bytes=staged, stage_s=stage_s if chunks else 0.0)
        return delivered

    def seal(self, batch: Any, fresh: list[torch.Tensor], start: torch.cuda.Event | None,
             keep: list[torch.Tensor] | None = None) -> Delivered:
        """Apply the transform (on the copy stream, when called inside it) and record the batch's event.

        With a transform, the device tensors to fence are those of its output, whatever its structure.
        """
        if self.transform is not None:
            with _nvtx.range("gpufeed.transform"):
                batch = self.transform(batch)
            fresh = [t for t in flatten(batch)[0] if t.device == self.device]
        if start is None:
            return Delivered(batch, None, fresh)
        end = self._event()
        delivered = Delivered(batch, end, fresh)
        self._timings.append((start, end, weakref.ref(delivered)))
        if keep:  # host tensors the copy engine reads: alive until the copy completed
            self._retire.append((end, keep))
        return delivered

    def _block(self, signature: tuple[tuple[torch.Size, torch.dtype], ...]) -> _Block:
        """The device block for staged leaves of ``signature``: the one made ahead when it fits, else now.

        Each torch call releases the GIL, and while the training thread runs Python each one costs the
        background thread a wait to take it back (``torch.empty`` and the views took about 130 us per
        batch beside a training step on an H200 machine). So the next batch's block is made, for the
        same signature, on a worker thread while this batch stages in C with the GIL released.
        """
        fut, self._next_block = self._next_block, None
        if fut is not None:
            try:
                made = fut.result()
            except Exception:  # made again below, on this thread, where its error is raised
                made = None
            if made is not None and made.signature == signature:
                return made
        return _make_block(signature, self.device, self._consumer)

    def _prepare(self, signature: tuple[tuple[torch.Size, torch.dtype], ...]) -> None:
        """Start making a block of ``signature`` for the next batch (a loader's batches mostly share one)."""
        self._next_block = self.pipeline.executor.submit(self._make_ahead, signature)

    def _make_ahead(self, signature: tuple[tuple[torch.Size, torch.dtype], ...]) -> _Block:
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream):  # allocated on the copy stream, as in the background thread
            return _make_block(signature, self.device, self._consumer)

    def _pinned_ok(self) -> bool:
        if self.pool.available:
            return True
        if not self.pool.warned:  # once per prefetcher (the pool lives as long as it; copiers are per epoch)
            self.pool.warned = True
            warn_pageable("pinned_budget is 0" if self.pool.budget == 0 else "pinned allocation failed")
        return False

    def _begin(self) -> torch.cuda.Event:
        self._collect()
        return self._event()

    def _event(self) -> torch.cuda.Event:
        """A timing event recorded on the copy stream now: a free one recorded again, or a new one."""
        while self._events:
            event = self._events.pop()
            if _driver.record(event.cuda_event, self._stream_handle):
                return event
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def _collect(self, wait: bool = False) -> None:
        """Account copy times of batches whose copies completed; free host tensors they read."""
        # No synchronize() where the driver already said done (torch's calls would release the GIL).
        while self._timings and (wait or _driver.done(self._timings[0][1])):
            start, end, delivered = self._timings.popleft()
            if wait:
                end.synchronize()
            ms = _driver.elapsed_ms(start.cuda_event, end.cuda_event)
            self.stats.add(copy_s=(start.elapsed_time(end) if ms is None else ms) / 1e3)
            self._events.append(start)
            self._handing.append((end, delivered))
        while self._handing and ((d := self._handing[0][1]()) is None or d.handed):
            self._events.append(self._handing.popleft()[0])
        while self._retire and (wait or _driver.done(self._retire[0][0])):
            end = self._retire.popleft()[0]
            if wait:
                end.synchronize()

    def finish(self) -> None:
        """The epoch's fetch thread is ending: account the last copies and stop the worker threads."""
        if self.stream is not None:
            try:
                self._collect(wait=True)
            except Exception:
                pass
        self.pipeline.executor.shutdown(wait=True, cancel_futures=True)
