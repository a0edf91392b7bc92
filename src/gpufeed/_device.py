"""The device stage: copies host batches to the device on one copy stream and hands them over.

Every CUDA call here runs on the loop's thread, once or a few times a batch: the stream calls go straight
to ``torch._C`` (``torch.cuda.current_stream()`` builds a new object at every call, and the context
manager ``torch.cuda.stream`` costs more than a small batch's copy; docs/design.md, "The hot path").
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from gpufeed import _forks, _nvtx, host_memory
from gpufeed._gpu_idle import GpuIdle, busy_reader
from gpufeed._staging import Stager
from gpufeed._starvation import GpuWaits
from gpufeed._tree import flatten
from gpufeed.host_memory import HostBatch, PinnedUnavailable, warn_pageable
from gpufeed.stats import PrefetchStats

#: One batch in this many of those on the copy stream has its copies timed with CUDA events
#: (``PrefetchStats.copy_s``, a sampled rate) and its calls timed on the loop's clock (``_Costs``): a timed
#: batch costs two more events.
TIME_EVERY = 16
#: Of the batches that go on the loop's stream, one in this many goes on the copy stream instead, to
#: measure its calls again (they change with the loop's load); it costs the loop about one hand-over more.
RECHECK_EVERY = 256


class DeviceBatch(NamedTuple):
    """A batch whose copies are issued: ready once the consumer's stream waits on ``event``."""

    batch: Any
    event: Any  # torch.cuda.Event, or None on the CPU
    state: Any
    stream: Any  # the stream the batch's device tensors were allocated on (the consumer's then)
    fresh: list[torch.Tensor] | None  # those device tensors (None: every device tensor of ``batch``)
    timed: bool = False  # its copies and calls were timed: so is its hand-over's wait (``_Costs``)


class DeviceStage:
    """Copies host batches to ``device`` and hands them to the consumer's stream.

    A batch is copied on the copy stream, overlapping the loop's kernels, unless its copy takes less time
    than the copy stream's own calls cost the loop's thread, or than half the GPU's idle time a step: then
    on the loop's own stream, in line with its kernels, as ``.to(non_blocking=True)`` in the loop would
    (:class:`_Costs` decides, from the link's latency and rate, :func:`link_cost`, the calls measured as
    the loop runs, and :class:`~gpufeed._gpu_idle.GpuIdle`).

    Invariants (CUDA):

    * One copy stream for the stage's whole life (one a device for the process: :func:`copy_stream`).
    * A batch's device tensors are allocated on the consumer's current stream. On the copy stream, the
      copies wait on an event recorded there after those allocations: memory the caching allocator hands
      out again was freed by the consumer, so every kernel that read it was queued before that event, and
      the copy cannot overwrite it early. No ``record_stream`` is needed for the consumer, and freeing a
      batch makes no CUDA call (safe in a forked DataLoader worker too).
    * One event is recorded on the copy stream after a batch's copies (and ``transform``);
      :meth:`hand_over` makes the consumer's current stream wait on that event only.
    * A batch's host memory is leased: its lease is called with the event of the copies that read it
      right after they are issued, and the memory's owner reuses it only once that event completed.

    * Measuring (``meter``), every batch's copy event is a timing event, and :meth:`hand_over` records
      the meter's events on the consumer's stream before it waits (:class:`~gpufeed._starvation.GpuWaits`).

    Without CUDA the stage hands host batches over as they are (memory with a lease is copied out first).
    With ``parallel_pin=False`` pageable tensors sent alone are pinned by one thread's copy, not torch's
    parallel one: for a stage whose thread runs beside threads busy with torch ops (``ToDevice``'s, in a
    nodes pipeline).
    """

    def __init__(self, device: torch.device, transform: Callable[[Any], Any] | None,
                 stats: PrefetchStats, measure: bool = True, parallel_pin: bool = True) -> None:
        self.device = device
        self._pid = os.getpid()  # (a forked child inherits the stage, and must make no CUDA call)
        self.transform = transform
        self.stats = stats
        self.cuda = device.type == "cuda"
        if self.cuda:  # (its events and streams, left in a cycle, must never be collected in a forked child)
            _forks.guard_every_fork()
        self.stream = copy_stream(device) if self.cuda else None
        self.streams = _Streams(device, self.stream) if self.cuda else None
        self.stager = Stager(pin=self.cuda, parallel=parallel_pin)
        self.pinning = self.cuda  # pageable tensors are staged through pinned memory (until it fails)
        self._fence = torch.cuda.Event() if self.cuda else None
        link = link_cost(device) if self.cuda else None
        self.costs = _Costs(link)
        busy = busy_reader(device) if link is not None else None
        self.idle = GpuIdle(busy, stats, self.costs.copy_s) if busy is not None else None
        self.meter = GpuWaits(stats) if self.cuda and measure else None
        if self.meter is not None:  # (weak: the meter holds the stats, and no cycle may hold CUDA objects)
            stats._refresh = weakref.WeakMethod(self.meter.refresh)
        self._timed: list[tuple[Any, Any, int]] = []  # (start, end, bytes) of sampled batches in flight
        self._count = 0

    # -- copy ------------------------------------------------------------------------------------

    @_nvtx.ranged("gpufeed.copy")
    def copy(self, hb: HostBatch) -> DeviceBatch:
        """Issue the copies of ``hb`` (its host memory goes back once they complete). On CUDA, runs on the
        consumer's thread, whose current stream is the consumer's."""
        try:
            return self._to_cuda(hb) if self.cuda else self._to_cpu(hb)
        except BaseException as exc:  # the batch is never handed out: its memory goes back once no copy
            if hb.lease is not None:  # reads it (a lease already called ignores this call)
                if self.stream is not None:
                    self.stream.synchronize()
                hb.lease(None)
            if isinstance(exc, StopIteration):  # (a transform's, or a batch's .to()): an error, not the
                raise RuntimeError("the transform (or a batch's .to()) raised StopIteration") from exc
            raise  # end of the loader's epoch (PEP 479)

    def _to_cpu(self, hb: HostBatch) -> DeviceBatch:
        leaves, rebuild = flatten(hb.batch)
        moved = [_to(t, self.device) if not isinstance(t, torch.Tensor) else t if t.device.type == "cpu"
                 else t.cpu() for t in leaves]
        if hb.lease is not None:  # the memory goes back: the batch is copied out of it
            moved = [t.clone() if isinstance(t, torch.Tensor) else t for t in moved]
        batch = rebuild(moved)
        if self.transform is not None:
            batch = self.transform(batch)
        if hb.lease is not None:
            hb.lease(None)
        self.stats.add(bytes=sum(t.nbytes for t in moved if isinstance(t, torch.Tensor)))
        return DeviceBatch(batch, None, hb.state, None, [])

    def _to_cuda(self, hb: HostBatch) -> DeviceBatch:
        self._count += 1
        if self._count % RECHECK_EVERY and self.costs.loop_bytes > 0:
            flat = self._flat_on_loop_stream(hb)
            if flat is not None:
                return flat
        leaves, rebuild = flatten(hb.batch)
        device = self.device
        out: list[Any] = list(leaves)
        pinned: list[int] = []
        pageable: list[int] = []
        nbytes = 0
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):  # a batch type that moves itself: on the loop's stream, in
                out[i] = _to(t, device)  # its order, as torch's pin-memory loop and `.to()` would
            elif not t.is_cuda:  # (is_cuda first: a tensor's .device makes a new object at every call)
                nbytes += t.nbytes
                (pinned if t.is_pinned() else pageable).append(i)
            elif t.device != device:  # (a tensor already there, read by a source to the device, stays)
                nbytes += t.nbytes
                pinned.append(i)
        self.stats.bytes += nbytes
        consumer = self.streams.current()
        if nbytes < self.costs.loop_bytes and self._count % RECHECK_EVERY:
            return self._on_loop_stream(hb, leaves, rebuild, out, pinned, pageable, consumer)
        copies = []
        for i in pinned:
            t = leaves[i]
            out[i] = torch.empty(t.shape, dtype=t.dtype, device=device)
            copies.append((out[i], t))
        staging = self._staging(leaves, out, pageable)
        fresh = [o for o, t in zip(out, leaves, strict=True) if o is not t and isinstance(o, torch.Tensor)]
        start, end = self._issue(consumer, copies, staging)
        batch = rebuild(out)
        if self.transform is not None:
            batch, fresh = self._transform(batch, fresh, consumer)
            end.record(self.stream)
        if hb.lease is not None:
            hb.lease(end)
        if start is not None:
            self._timed.append((start, end, nbytes))
        self._collect_timing()
        return DeviceBatch(batch, end, hb.state, consumer, fresh, start is not None)

    def _staging(self, leaves: list[Any], out: list[Any], pageable: list[int]) -> Callable[[], Any] | None:
        """Allocate the device tensors of the pageable ``leaves`` (into ``out``); the job that stages them."""
        if not pageable:
            return None
        host = [leaves[i] for i in pageable]
        staged, jobs = self.stager.prepare(host, self.device)
        for i, t in zip(pageable, staged, strict=True):
            out[i] = t
        return functools.partial(self._staged, functools.partial(_run_all, jobs), host)

    def _flat_on_loop_stream(self, hb: HostBatch) -> DeviceBatch | None:
        """The common small batch, a plain CPU tensor or a tuple, list or dict of them (no transform), copied
        on the loop's stream in one pass over its tensors; None where the batch is not one, or is too large
        for the loop's stream (:meth:`_to_cuda` then takes it). The same copies as :meth:`_on_loop_stream`,
        without the index lists and the rebuild a batch of any structure needs: this is the loop's every
        batch."""
        batch = hb.batch
        kind = type(batch)
        if kind is torch.Tensor:
            leaves = [batch]
        elif kind is tuple or kind is list:
            leaves = batch
        elif kind is dict:
            leaves = list(batch.values())
        else:
            return None
        if self.transform is not None:
            return None
        nbytes = 0
        for t in leaves:
            if type(t) is not torch.Tensor or t.is_cuda:
                return None
            nbytes += t.nbytes
        if nbytes >= self.costs.loop_bytes:
            return None
        pinned = [t.is_pinned() for t in leaves]
        if False not in pinned:
            device = self.device
            out = [t.to(device, non_blocking=True) for t in leaves]
        else:
            out = self._pageable_on_loop_stream(leaves, pinned)
        consumer = self.streams.current()
        if hb.lease is not None:  # the host memory goes back once the loop's stream has read it
            end = torch.cuda.Event()
            end.record(consumer)
            hb.lease(end)
        stats = self.stats
        stats.bytes += nbytes
        stats.loop_stream_batches += 1
        if self.meter is not None:
            self.meter.inline = True
        if kind is torch.Tensor or kind is list:
            moved: Any = out[0] if kind is torch.Tensor else out
        else:
            moved = dict(zip(batch, out, strict=True)) if kind is dict else tuple(out)
        return DeviceBatch(moved, None, hb.state, consumer, None)

    def _pageable_on_loop_stream(self, leaves: list[torch.Tensor], pinned: list[bool]) -> list[torch.Tensor]:
        """Every leaf copied with ``.to(non_blocking=True)``, the pageable ones staged first: where the stager
        would send each alone, pinned one by one as a loop that pins its batch does, without the staging's
        grouping (:meth:`~gpufeed._staging.Stager.each_alone`); else by :meth:`Stager.send` (packed). Both
        through :meth:`_staged`: its accounting, and its one fallback where pinning fails."""
        device = self.device
        host = [t for t, p in zip(leaves, pinned, strict=True) if not p]
        if self.stager.each_alone(host):
            pin = self.stager.pinned  # (contiguous first: a view pinned as it is pins the span it covers)
            held = self._staged(lambda: [t if p else pin(t.contiguous())
                                         for t, p in zip(leaves, pinned, strict=True)], host)
            return [h.to(device, non_blocking=True) for h in held]
        sent = iter(self._staged(functools.partial(self.stager.send, host, device), host))
        return [t.to(device, non_blocking=True) if p else next(sent)
                for t, p in zip(leaves, pinned, strict=True)]

    def _on_loop_stream(self, hb: HostBatch, leaves: list[Any], rebuild: Any, out: list[Any],
                        pinned: list[int], pageable: list[int], consumer: Any) -> DeviceBatch:
        """Copy on the loop's own stream, in its order, as ``.to(non_blocking=True)`` in the loop: nothing to
        fence, nothing to wait for at the hand-over. A pageable leaf is pinned first (``Stager.send``): a
        copy from pageable memory waits for the loop's stream to drain, as a blocking ``.to()`` does, so the
        loop could no longer run ahead of the GPU (docs/design.md, "Staging pageable tensors")."""
        device = self.device
        for i in pinned:
            out[i] = leaves[i].to(device, non_blocking=True)
        if pageable:
            host = [leaves[i] for i in pageable]
            sent = self._staged(functools.partial(self.stager.send, host, device), host)
            for i, t in zip(pageable, sent, strict=True):
                out[i] = t
        batch = rebuild(out)
        if self.transform is not None:
            with _nvtx.range("gpufeed.transform"):
                batch = self.transform(batch)
        if hb.lease is not None:  # the host memory goes back once the loop's stream has read it
            end = torch.cuda.Event()
            end.record(consumer)
            hb.lease(end)
        self.stats.loop_stream_batches += 1
        if self.meter is not None:
            self.meter.inline = True
        return DeviceBatch(batch, None, hb.state, consumer, None)  # (its device tensors: found if needed)

    def _issue(self, consumer: Any, copies: list[tuple[torch.Tensor, torch.Tensor]],
               staging: Callable[[], Any] | None) -> tuple[Any, Any]:
        """Fence the copy stream behind the consumer's allocations, issue the copies and staging there, and
        record the batch's event; the consumer's stream is current again after. Measures what the copy
        stream's own calls cost the loop's thread (``costs``)."""
        streams = self.streams
        t0 = time.perf_counter()
        self._fence.record(consumer)
        timed = self.costs.timed(self._count)
        end = torch.cuda.Event(enable_timing=timed or self.meter is not None)
        start = torch.cuda.Event(enable_timing=True) if timed else None
        device = streams.enter_copy()
        try:
            self.stream.wait_event(self._fence)
            if start is not None:
                start.record(self.stream)
            t1 = time.perf_counter()
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            if staging is not None:
                staging()
            t2 = time.perf_counter()
            end.record(self.stream)
        finally:
            streams.leave_copy(device)
        if timed:
            self.costs.side_calls(time.perf_counter() - t2 + t1 - t0)
        return start, end

    def _staged(self, run: Callable[[], Any], host: list[torch.Tensor]) -> Any:
        """``run()``, which stages the pageable ``host`` tensors through pinned memory (counted in the
        stats); where pinned memory cannot be had, pinning is turned off (said once) and ``run()`` runs
        again from pageable memory: correct, synchronous (copies it issued before read memory kept until
        they complete)."""
        t0 = time.perf_counter()
        if self.pinning:
            try:
                out = run()
                self.stats.add(staged_bytes=sum([t.nbytes for t in host]), stage_s=time.perf_counter() - t0)
                return out
            except PinnedUnavailable:
                self.pinning = False
                self.stager.pin = False
                warn_pageable("pinned allocation failed")
        return run()

    def _transform(self, batch: Any, fresh: list[torch.Tensor],
                   consumer: Any) -> tuple[Any, list[torch.Tensor]]:
        """Apply the transform on the copy stream. Its inputs were allocated on the consumer's stream and
        are read here on the copy stream; its outputs are allocated on the copy stream and read by the
        consumer: both are recorded on the stream that reads them."""
        device = self.streams.enter_copy()
        try:
            with _nvtx.range("gpufeed.transform"):
                result = self.transform(batch)
        finally:
            self.streams.leave_copy(device)
        outs = [t for t in flatten(result)[0] if t.device == self.device]
        kept = {id(t) for t in outs}
        for t in fresh:
            if id(t) not in kept:
                t.record_stream(self.stream)
        for t in outs:
            t.record_stream(consumer)
        return result, outs

    def _collect_timing(self) -> None:
        while self._timed and self._timed[0][1].query():
            start, end, nbytes = self._timed.pop(0)
            self.stats.add(copy_s=start.elapsed_time(end) / 1e3, timed_bytes=nbytes)

    # -- hand-over ---------------------------------------------------------------------------------

    def new_epoch(self) -> None:
        """An epoch starts (or a ``ToDevice`` resets): its first batch is its start-up for the verdict."""
        if self.idle is not None:
            self.idle.epoch_started(time.perf_counter())
        if self.meter is not None:
            self.meter.new_epoch()

    def end_epoch(self) -> None:
        """An epoch ended (its loader's end, or its iterator closed): until the next one starts, no step."""
        if self.idle is not None:
            self.idle.epoch_ended(time.perf_counter())

    def asked(self, mark: tuple[float, float, float]) -> None:
        """The loop asked for its next batch (``mark``: when, and ``fetch_s``, ``stage_s`` then)."""
        if self.idle is not None and mark[0] >= self.idle.due:
            idle = self.idle.read(mark[0])
            if idle is not None:
                self.costs.spare(idle)
        if self.meter is not None:
            self.meter.asked(self.streams.current, mark)

    def hand_over(self, item: DeviceBatch) -> Any:
        """The batch, once the consumer's current stream waits on its copies."""
        if item.stream is None:  # (the CPU)
            return item.batch
        stream = self.streams.current()
        if self.meter is not None:
            self.meter.handed(stream, item.event)
        if item.event is not None:
            if item.timed:  # (the batches timed on the copy stream time their hand-over too)
                t0 = time.perf_counter()
                item.event.wait(stream)
                self.costs.side_wait(time.perf_counter() - t0)
            else:
                item.event.wait(stream)
        if stream is not item.stream:  # the loop switched streams since: guard the memory on this one too
            if item.event is None:
                stream.wait_stream(item.stream)
            fresh = item.fresh
            if fresh is None:
                fresh = [t for t in flatten(item.batch)[0] if isinstance(t, torch.Tensor) and t.is_cuda]
            for t in fresh:
                t.record_stream(stream)
        return item.batch

    def drop(self, ahead: collections.deque[Any]) -> None:
        """Let go of the batches in ``ahead``, never handed over (``ahead`` is emptied): the stream their
        tensors were allocated on waits on their copies first, so the allocator cannot hand that memory to
        the loop while a copy still writes it. Not in a forked child, where CUDA cannot be called."""
        items = list(ahead)
        ahead.clear()
        if os.getpid() != self._pid:
            return
        for item in items:
            if type(item) is DeviceBatch and item.event is not None:
                item.event.wait(item.stream)

    def close(self) -> None:
        """Wait for the copies in flight (their host memory is then free)."""
        if self.stream is not None:
            self.stream.synchronize()
            self._collect_timing()
        if self.meter is not None:
            self.meter.close()


class _Costs:
    """Where a batch's copies cost the loop least: on the copy stream, or on the loop's own stream.

    The copy stream lets a copy overlap the loop's kernels, and costs the loop's thread its own calls (a
    fence, an event, the hand-over's wait: tens of microseconds, more while the GPU is busy). The loop's
    stream costs none of them, and puts the copy in line with the loop's kernels. So a batch goes on the
    loop's stream when its copy takes less time on the GPU than the copy stream's calls take the loop's
    thread: the copy's time from the link's latency and rate (:func:`link_cost`, measured once), the calls
    on the timed batches copied on the copy stream (every batch until known, then one in ``TIME_EVERY``;
    of the batches that would go on the loop's stream, one in ``RECHECK_EVERY``), as a moving average, so
    the choice follows the loop's load.

    A copy also goes on the loop's stream where it takes less than half the time the GPU idles a step
    besides it (``idle_s``, where NVML reads it): a loop bound by the thread that launches its kernels
    leaves the GPU idle between them, and that idle time absorbs the copy, while the copy stream's calls
    would lengthen the step. Half: the idle time before the copy is issued (while the loop is in
    ``next()``, all of it in a loop that synchronizes each step) absorbs none of it. Nothing is tuned to a
    card.
    """

    def __init__(self, link: tuple[float, float] | None) -> None:
        self.link = link  # (latency s, bytes a second) of a pinned copy; None: not known, no loop stream
        self.calls_s: float | None = None  # the copy stream's calls, a batch (issue and hand-over)
        #: A batch of fewer bytes goes on the loop's stream: its copy, ``latency + bytes / rate``, takes less
        #: than ``calls_s`` or ``idle_s / 2`` (0 until ``calls_s`` and the link are known: every batch on the
        #: copy stream)
        self.loop_bytes = 0.0
        self.idle_s = 0.0  # the GPU's idle time a step, where NVML reads it (0: not known)
        self._issue_s: float | None = None
        self._wait_s: float | None = None

    def timed(self, count: int) -> bool:
        return self.calls_s is None or count % TIME_EVERY == 0

    def side_calls(self, seconds: float) -> None:
        self._issue_s = _average(self._issue_s, seconds)
        self._update()

    def side_wait(self, seconds: float) -> None:
        self._wait_s = _average(self._wait_s, seconds)
        self._update()

    def copy_s(self, nbytes: float) -> float:
        """The seconds a pinned copy of ``nbytes`` takes on the link, ``latency + bytes / rate`` (the link
        is known wherever there is a :class:`~gpufeed._gpu_idle.GpuIdle` to ask)."""
        latency, rate = self.link
        return latency + nbytes / rate

    def spare(self, idle_s: float) -> None:
        """The GPU idles ``idle_s`` a step (:class:`~gpufeed._gpu_idle.GpuIdle`)."""
        self.idle_s = idle_s
        self._update()

    def _update(self) -> None:
        if self._issue_s is not None and self._wait_s is not None:
            self.calls_s = self._issue_s + self._wait_s
        if self.calls_s is not None and self.link is not None:
            latency, rate = self.link
            self.loop_bytes = (max(self.calls_s, self.idle_s / 2) - latency) * rate


_LINKS: dict[int, tuple[float, float]] = {}
_LINKS_LOCK = threading.Lock()  # (the first probes of two threads would share the copy stream)


def link_cost(device: torch.device) -> tuple[float, float] | None:
    """The latency (s) and rate (bytes a second) of a pinned host-to-device copy to ``device``, measured
    once a process on the copy stream: a small and a large copy, each timed three times on the GPU alone
    (queued behind a sleep kernel, so the CPU's calls are not in it), their best times fitted to
    ``latency + bytes / rate``. A copy timed inside a loop would count the loop thread's calls between
    its events, which the same copy on the loop's stream does not cost the GPU. None where it cannot be
    measured (no pinned memory, no room for the buffers, a fit without a positive slope): every batch
    then goes on the copy stream, as before there was a choice; the next stage tries again."""
    with _LINKS_LOCK:
        cost = _LINKS.get(device.index)
        if cost is None:
            try:
                cost = _probe_link(device)
            except (PinnedUnavailable, RuntimeError):  # (an out-of-memory is a RuntimeError too)
                return None
            if cost is not None:
                _LINKS[device.index] = cost
        return cost


def _probe_link(device: torch.device) -> tuple[float, float] | None:
    small, large = 64 << 10, 4 << 20
    host = host_memory.pinned_empty(large)
    stream = copy_stream(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(6)]
    with torch.cuda.stream(stream):  # (the device buffer allocated on the stream that writes it)
        dev = torch.empty(large, dtype=torch.uint8, device=device)
        torch.cuda._sleep(1 << 20)  # (about half a millisecond: the copies below queue behind it)
        for k, (start, end) in enumerate(events):
            n = small if k % 2 == 0 else large
            start.record(stream)
            dev[:n].copy_(host[:n], non_blocking=True)
            end.record(stream)
    stream.synchronize()
    best = {n: min(s.elapsed_time(e) / 1e3 for s, e in events[k::2]) for k, n in enumerate((small, large))}
    if best[large] <= best[small]:  # (no slope to fit: a timing gone wrong)
        return None
    rate = (large - small) / (best[large] - best[small])
    return max(best[small] - small / rate, 0.0), rate


_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy stream of ``device``, one for the process: every prefetcher (one an epoch, too) and every
    ``ToDevice`` copies on it, so no stream is made per epoch (a stream per epoch grows reserved memory,
    as the allocator reuses a block only on the stream it was made on: timm#2781, FFCV#308)."""
    stream = _COPY_STREAMS.get(device.index)
    if stream is None:
        stream = _COPY_STREAMS[device.index] = torch.cuda.Stream(device)
    return stream


def _to(obj: Any, device: torch.device) -> Any:
    """A batch type that moves itself, pinned first where it can pin itself (as torch's pin-memory loop)."""
    if device.type == "cuda" and callable(getattr(obj, "pin_memory", None)):
        obj = host_memory.pin(obj)
    return obj.to(device, non_blocking=True)


def _run_all(jobs: list[Callable[[], None]]) -> None:
    for job in jobs:
        job()


def _average(old: float | None, new: float) -> float:
    return new if old is None else 0.75 * old + 0.25 * new


class _Streams:
    """The loop's current stream on ``device``, and switches between it and the ``copy`` stream, one C call
    each. Invariant: :meth:`current` returns the same object while the loop's current stream stays the
    same, so callers compare streams with ``is``."""

    def __init__(self, device: torch.device, copy: torch.cuda.Stream) -> None:
        self.index = device.index  # (a CUDA device here always names its index)
        self._get = torch._C._cuda_getCurrentStream
        self._get_device = torch._C._cuda_getDevice
        self._key: Any = None
        self._current: torch.cuda.Stream | None = None
        self._make_current: Callable[[], None] = lambda: None
        self._make_copy_current = _setter(copy)

    def current(self) -> torch.cuda.Stream:
        key = self._get(self.index)
        if key != self._key:
            self._current = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._make_current = _setter(self._current)
            self._key = key
        return self._current

    def enter_copy(self) -> int:
        """Make the copy stream (and its device) current; returns the device that was current. The caller
        looked the loop's stream up for this batch (:meth:`current`): :meth:`leave_copy` restores it."""
        device = self._get_device()
        self._make_copy_current()
        return device

    def leave_copy(self, device: int) -> None:
        self._make_current()
        if device != self.index:
            torch._C._cuda_setDevice(device)


def _setter(stream: torch.cuda.Stream) -> Callable[[], None]:
    return functools.partial(torch._C._cuda_setStream, stream_id=stream.stream_id,
                             device_index=stream.device_index, device_type=stream.device_type)


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asks for CUDA, but CUDA is not available; use device='cpu'")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"device must be a CUDA device or 'cpu', got {device!r}")
    return dev
