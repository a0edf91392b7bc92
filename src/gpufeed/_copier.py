"""An epoch's per-batch work: move every leaf of a batch to the device."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpufeed import _nvtx
from gpufeed._host_buffers import HostBuffers
from gpufeed._tracing import TraceRecorder
from gpufeed._tree import Rebuild, flatten
from gpufeed._worker_slots import SlotBatch, WorkerSlots
from gpufeed.pinned_pool import PinnedPool
from gpufeed.source_loader import ReadRequest
from gpufeed.staging import PinnedUnavailable, Stager, warn_pageable
from gpufeed.stats import PrefetchStats

#: One batch in this many has its copies timed with CUDA events (``PrefetchStats.copy_s``): each CUDA call is
#: time the fetching thread spends on every batch (docs/design.md), and a rate needs only a sample.
TIME_EVERY = 16


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
    consumer: torch.cuda.Stream | None = None  # the stream ``fresh`` is recorded on

    def handover(self, stream: torch.cuda.Stream | None) -> Any:
        """Make ``stream`` (the consumer's current stream) wait on this batch's event only, then return
        the batch."""
        if self.event is not None:
            self.event.wait(stream)
            if stream is not self.consumer and stream != self.consumer:  # the loop switched streams
                for t in self.fresh:
                    t.record_stream(stream)
        return self.batch


#: A copy in flight: start event, end event, host tensors read, bytes timed, release of its worker slot.
_Copy = tuple[torch.cuda.Event | None, torch.cuda.Event, list[torch.Tensor], int, Callable[[], None] | None]


class InFlight:
    """The copies of one prefetcher not yet seen complete, over all its epochs.

    Holds, for each timed batch or batch read from pinned host tensors, its start event (None when not
    timed), its end event, the pinned host tensors its copies read, the bytes it copied, and what releases
    the worker slot it was read from. Invariant: those host tensors stay referenced, and the slot leased,
    until the end event has completed. An epoch's end does not wait for its
    last copies (the loop would spin until every copy it queued ahead had landed): the next epoch's
    batches, or the prefetcher's ``close()``, let go of them once complete.
    """

    def __init__(self, stats: PrefetchStats) -> None:
        self.stats = stats
        self._queue: collections.deque[_Copy] = collections.deque()
        self._lock = threading.Lock()  # a stopped epoch's thread may still collect beside the next epoch
        self._closed = False

    def add(self, start: torch.cuda.Event | None, end: torch.cuda.Event, read: list[torch.Tensor],
            nbytes: int, release: Callable[[], None] | None = None) -> None:
        with self._lock:
            if not self._closed:
                self._queue.append((start, end, read, nbytes, release))
                return
        end.synchronize()  # closed (a copy issued while close() ran on another thread): nothing collects it
        if release is not None:
            release()

    def close(self) -> None:
        """Wait for every copy, and for those added from now on as they are added."""
        with self._lock:
            self._closed = True
        self.collect(wait=True)

    def collect(self, wait: bool = False) -> None:
        """Account the copy time of the batches whose copies completed (all of them, waiting, with
        ``wait``), and let go of the host tensors they read."""
        with self._lock:
            while self._queue and (wait or self._queue[0][1].query()):
                start, end, _, nbytes, release = self._queue.popleft()
                if wait:
                    end.synchronize()
                if release is not None:
                    release()
                if start is not None:
                    self.stats.add(copy_s=start.elapsed_time(end) / 1e3, timed_bytes=nbytes)


class Copier:
    """Moves batches to ``device``: pinned tensors directly, pageable ones pinned first (``Stager``).

    Belongs to one epoch, used by one thread at a time (the loop's, then maybe the epoch's fetch
    thread), with the copy stream current. Every copy (and the transform) runs on the copy stream, and
    one event recorded after them is what the consumer's stream waits on. Device tensors are allocated
    on the copy stream and recorded on the consumer's stream (``record_stream``) before the batch is
    handed over, so the caching allocator never gives their memory to a later copy while the
    consumer's kernels may still read it. Host tensors that the copy engine reads directly (pinned
    leaves) are kept alive until their copy completed.

    A :class:`~gpufeed.ReadRequest` (a batch of a :class:`~gpufeed.SourceLoader`) reads itself through
    the members its protocol names (:meth:`begin`, :meth:`seal`, ``pool`` ...). A batch that DataLoader
    workers collated into a slot (:mod:`gpufeed._worker_slots`) is copied from its slot, which is released
    once that copy completed (on the CPU: copied out, then released).
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None, pool: PinnedPool,
                 stats: PrefetchStats, transform: Callable[[Any], Any] | None,
                 trace: TraceRecorder | None = None, host: HostBuffers | None = None,
                 in_flight: InFlight | None = None, slots: WorkerSlots | None = None) -> None:
        self.device = device
        self.stream = stream
        self.pool = pool
        self.host = host if host is not None else HostBuffers(slots=4)  # a prefetcher passes its own
        self.stats = stats
        self.transform = transform
        self.trace = trace
        self.stager = Stager(pool.chunk_bytes)  # used only when there is a copy stream
        self.in_flight = in_flight if in_flight is not None else InFlight(stats)  # a prefetcher: its own
        self.slots = slots
        self._count = 0

    def deliver(self, raw: Any, index: int, stop: threading.Event,
                consumer: torch.cuda.Stream | None) -> Delivered:
        state = None
        if isinstance(raw, WithState):
            raw, state = raw.batch, raw.state
        t0 = time.perf_counter()
        request = isinstance(raw, ReadRequest)
        if request:  # a SourceLoader's batch: the source reads into our buffers
            out = raw.read(self, stop)
        elif isinstance(raw, SlotBatch):
            out = self._from_slot(raw)
        elif self.stream is None:
            out = self._to_cpu(*flatten(raw))
        else:
            out = self._to_cuda(*flatten(raw))
        if self.trace is not None:
            name = "read+copy" if request else "stage+copy"
            self.trace.add(name, int(t0 * 1e9), int(time.perf_counter() * 1e9), "gpufeed-fetch", batch=index)
        out.state = state
        if self.stream is not None:
            out.consumer = consumer
            for t in out.fresh:
                t.record_stream(consumer)
        return out

    def _from_slot(self, sb: SlotBatch) -> Delivered:
        assert self.slots is not None  # a SlotBatch comes only from workers handed this prefetcher's slots
        views, rebuild, release = self.slots.open(sb)
        try:
            if self.stream is None:
                out = self._to_cpu([t.clone() for t in views], rebuild)
                release()
            else:
                out = self._to_cuda(views, rebuild, release)
        except BaseException:  # the batch is never handed out: what its copies read no longer matters
            release()
            raise
        self.stats.add(slot_batches=1)
        return out

    def _to_cpu(self, leaves: list[torch.Tensor], rebuild: Rebuild) -> Delivered:
        moved = [t if t.device.type == "cpu" else t.cpu() for t in leaves]
        self.stats.add(bytes=sum(t.nbytes for t in moved))
        return self.seal(rebuild(moved), [], None)

    def _to_cuda(self, leaves: list[torch.Tensor], rebuild: Rebuild,
                 release: Callable[[], None] | None = None) -> Delivered:
        """Issue the copies of a batch's ``leaves`` on the copy stream (current on this thread for its whole
        life); ``release`` frees the worker slot they are views of, once the copies completed."""
        out: list[Any] = list(leaves)
        fresh: list[torch.Tensor] = []
        read: list[torch.Tensor] = []  # pinned host tensors the copy engine reads
        nbytes = staged = 0
        stage_s = 0.0
        pageable: list[int] = []
        with _nvtx.range("gpufeed.copy"):
            start = self.begin()
            for i, t in enumerate(leaves):
                if t.device == self.device:
                    continue  # already there: not copied again
                nbytes += t.nbytes
                if t.is_cuda or t.is_pinned():
                    out[i] = t.to(self.device, non_blocking=True)
                    fresh.append(out[i])
                    if not t.is_cuda:
                        read.append(t)
                else:
                    pageable.append(i)
            if pageable:  # staged together: packed into pinned buffers, one copy each
                t0 = time.perf_counter()
                moved, allocations = self._stage([leaves[i] for i in pageable])
                stage_s = time.perf_counter() - t0
                for i, t in zip(pageable, moved, strict=True):
                    out[i] = t
                    staged += t.nbytes
                fresh += allocations
            delivered = self.seal(rebuild(out), fresh, start, read, release)
        self.stats.add(bytes=nbytes, staged_bytes=staged, stage_s=stage_s)
        return delivered

    def _stage(self, leaves: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The pageable ``leaves`` on the device, and the device allocations they are views of."""
        if self.pinned_ok():
            try:
                return self.stager.stage(leaves, self.device)
            except PinnedUnavailable:  # pinning failed: these leaves and the rest go pageable
                self.pool.available = False
                self.pinned_ok()
        moved = [t.to(self.device) for t in leaves]
        return moved, moved

    def begin(self) -> torch.cuda.Event | None:
        """Account the batches whose copies completed; for a timed batch, record the start of its copies."""
        self.in_flight.collect()
        timed = self._count % TIME_EVERY == 1  # not an epoch's first batch, which pays the start-up
        self._count += 1
        if not timed:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.stream)  # the current stream: given, as looking it up costs a few microseconds
        return start

    def seal(self, batch: Any, fresh: list[torch.Tensor], start: torch.cuda.Event | None,
             read: list[torch.Tensor] | None = None, release: Callable[[], None] | None = None) -> Delivered:
        """Apply the transform (on the copy stream, when called inside it) and record the batch's event.

        With a transform, the device tensors to fence are those of its output, whatever its structure.
        ``start`` is :meth:`begin`'s event (None for a batch that is not timed); ``release`` frees the
        worker slot the copies read, once they completed.
        """
        timed = 0 if start is None else sum(t.nbytes for t in fresh)
        if self.transform is not None:
            with _nvtx.range("gpufeed.transform"):
                batch = self.transform(batch)
            fresh = [t for t in flatten(batch)[0] if t.device == self.device]
        if self.stream is None:
            return Delivered(batch, None, fresh)
        end = torch.cuda.Event(enable_timing=start is not None)
        end.record(self.stream)
        if start is not None or read or release is not None:
            self.in_flight.add(start, end, read or [], timed, release)
        return Delivered(batch, end, fresh)

    def pinned_ok(self) -> bool:
        """Whether pageable leaves are staged through pinned memory (warns once when they cannot be)."""
        if self.pool.available:
            return True
        if not self.pool.warned:  # once per prefetcher (the pool lives as long as it; copiers are per epoch)
            self.pool.warned = True
            warn_pageable("pinned_budget is 0" if self.pool.budget == 0 else "pinned allocation failed")
        return False
