"""Reading one batch of a BatchSource into gpufeed's buffers, with the next batch's reads started early.

A batch is planned as chunks, each staged through one pinned buffer, and pieces, each one
``source.read`` (:mod:`gpufeed._read_plan`). :meth:`SourceBatch.start` takes pinned buffers, binds every
piece to its views and submits the reads; :meth:`SourceBatch.read` waits for them chunk by chunk and
copies each chunk to the device on the copy stream. Once a batch has all its reads submitted it starts
the reads of the ``READS_AHEAD`` batches after it, so the readers never idle while the fetching thread
finishes a batch (docs/design.md, "Reading a BatchSource").

A source that reads into device memory (``reads_to == "device"``: nvCOMP decoding, GPUDirect Storage) is
read one batch per read instead, since it spreads a read over the device or its own threads, and up to
``threads`` batches are read at once (:meth:`SourceBatch.start_device`).

Invariants: a batch starts its successors only after all of its own chunks hold buffers, each only after
the one before it holds all of its own, and a start that finds the pool empty stops (it never blocks), so
a successor can never hold buffers an earlier batch is waiting for. At most ``READS_AHEAD`` batches are
read ahead into pinned memory beyond ``depth``, and at most ``threads - 1`` into device memory (beyond
``depth``: such a source holds up to ``threads - 1`` more batches on the device). A successor's read that
cannot start fails at that batch, not at this one.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from gpufeed import _read_plan
from gpufeed._copier import Copier, Delivered
from gpufeed._worker import Stopped
from gpufeed.source_loader import ReadRequest
from gpufeed.staging import PinnedUnavailable

#: Batches whose reads start while the fetching thread finishes the one before them. With one, the reads
#: run one batch at a time; a batch read in a fraction of a millisecond needs the next ones in flight
#: too (docs/design.md, "Reading a BatchSource").
READS_AHEAD = 2


def run_now(job: Callable[[], Any]) -> Future:
    """Run ``job`` on this thread; a done Future with its result or exception (as a worker's would be)."""
    fut: Future = Future()
    try:
        fut.set_result(job())
    except BaseException as exc:  # delivered through the future, as from a worker thread
        fut.set_exception(exc)
    return fut


def _failed(exc: BaseException) -> Future:
    """A done Future holding ``exc``."""
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


def _traced(trace: Any, job: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        t0 = time.perf_counter_ns()
        job()
        trace.add("fill", t0, time.perf_counter_ns())

    return run


def _result(fut: Future, stop: threading.Event | None, swallow: bool = False) -> object:
    while True:
        try:
            return fut.result(timeout=0.05)
        except FutureTimeout:
            if stop is not None and stop.is_set():
                raise Stopped from None
        except BaseException:
            if swallow:
                return None
            raise


class _TracedRead:
    """A read started on a source's own threads, traced as a ``read`` span from its start until the
    fetching thread finds it done (there is no reader thread to record a ``fill``)."""

    def __init__(self, pending: Any, trace: Any) -> None:
        self.pending, self.trace, self.t0 = pending, trace, time.perf_counter_ns()

    def result(self, timeout: float | None = None) -> Any:
        try:
            out = self.pending.result(timeout)
        except FutureTimeout:
            raise
        except BaseException:
            self._record()
            raise
        self._record()
        return out

    def _record(self) -> None:
        if self.t0 is not None:
            self.trace.add("read", self.t0, time.perf_counter_ns(), "gpufeed-read")
            self.t0 = None

    def cancel(self) -> bool:
        return bool(self.pending.cancel())


class EpochReads:
    """The SourceBatch objects of one epoch, made on demand so a batch can reach its successor, and the
    reader threads they share (started on first use, stopped by :meth:`cancel`)."""

    def __init__(self, source: Any, plan: list[Any], threads: int) -> None:
        self.source, self.plan, self.threads = source, plan, threads
        # The reads one batch (or staging chunk) is cut into: one per reader thread, or one for a source
        # that spreads a read over threads of its own.
        parallel = bool(getattr(source, "parallel_reads", False))
        self.read_threads = 1 if parallel else threads
        self.submits = parallel and callable(getattr(source, "submit", None))  # reads started threadless
        self._made: dict[int, SourceBatch] = {}
        self._chunks: dict[tuple[int, int, int], list[_read_plan.Chunk]] = {}
        self._executor: ThreadPoolExecutor | None = None

    def read_plan(self, nrows: int, pool: Any) -> list[_read_plan.Chunk]:
        """How a batch of ``nrows`` rows is read through ``pool``'s buffers (:func:`_read_plan.plan`), made
        once per batch size: every batch of that size shares the list, which no one changes."""
        key = (nrows, pool.chunk_bytes, pool.fill_bytes)
        plan = self._chunks.get(key)
        if plan is None:
            plan = self._chunks[key] = _read_plan.plan(self.source.fields, nrows, self.read_threads,
                                                       pool.chunk_bytes, pool.fill_bytes)
        return plan

    @property
    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-read")
        return self._executor

    def get(self, i: int) -> SourceBatch | None:
        """Batch ``i`` (None past the end), made when the epoch or an earlier batch first asks."""
        if i >= len(self.plan):
            return None
        if i not in self._made:
            self._made[i] = SourceBatch(self.source, self.plan[i], self, i)
        return self._made[i]

    def take(self, i: int) -> SourceBatch:
        """Batch ``i`` for the epoch to hand out; the batches before the previous one are read and dropped."""
        self._made = {k: v for k, v in self._made.items() if k >= i - 1}
        batch = self.get(i)
        assert batch is not None, "take() is called for the batches of the plan only"
        return batch

    def cancel(self) -> None:
        """End the epoch: let reads started ahead finish, return their buffers, drop the batches (each
        references this object: clearing breaks the cycle, so the source is freed with its files) and stop
        the reader threads."""
        for b in self._made.values():
            b.cancel()
            b.chain = None
        self._made.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class SourceBatch(ReadRequest):
    """One batch of a BatchSource: the rows ``rows`` of every field, read by :meth:`read`."""

    def __init__(self, source: Any, rows: Any, chain: EpochReads, index: int = 0) -> None:
        self.source, self.rows, self.chain, self.index = source, rows, chain, index
        self._plan: list[_read_plan.Chunk] | None = None
        self._next = 0  # chunks of the plan that have a buffer and submitted reads
        self._entries: collections.deque[tuple[Any, Any, list[Any]]] = collections.deque()
        self._copier: Copier | None = None
        self._device_read: Future | None = None  # a device read (``start_device``), and its output
        self._device_out: dict[str, torch.Tensor] = {}

    # -- reads -------------------------------------------------------------------------------------

    def start(self, copier: Copier, stop: threading.Event, block: bool = False) -> bool:
        """Submit the reads of every chunk a buffer is free for; True when every chunk is submitted."""
        self._copier = copier
        if self._plan is None:
            self._plan = self.chain.read_plan(len(self.rows), copier.pool)
        pool = copier.pool
        while self._next < len(self._plan):
            r0, _, offsets, nbytes, pieces = self._plan[self._next]
            buf = pool.acquire(nbytes, stop) if block and not self._entries else pool.try_acquire(nbytes)
            if buf is None:
                return False
            reads = self._bind(buf, offsets, r0, pieces)  # every view made before any read starts
            if self._one_small_read():  # one small read: here, no handoff
                futs = [run_now(functools.partial(self.source.read, *r)) for r in reads]
            else:
                futs = [self._submit(copier, *r) for r in reads]
            self._entries.append((self._plan[self._next], buf, futs))
            self._next += 1
        return True

    def _submit(self, copier: Copier, rows: Any, views: Any) -> Any:
        """Start one read: on the source's own threads where it takes it (``submit``), else on a reader
        thread; a Future-like object either way."""
        if self.chain.submits:
            try:
                pending = self.source.submit(rows, views)
            except Exception as exc:  # (a file that cannot open ...) raised by this batch's read, in turn
                pending = _failed(exc)
            if pending is not None:
                return pending if copier.trace is None else _TracedRead(pending, copier.trace)
        job = functools.partial(self.source.read, rows, views)
        return self.chain.executor.submit(job if copier.trace is None else _traced(copier.trace, job))

    def read(self, copier: Copier, stop: threading.Event) -> Delivered:
        """Read this batch into the device (or host) tensors it returns; the copy stream is the calling
        (fetch) thread's current stream."""
        t0 = time.perf_counter()
        fields = self.source.fields
        n = len(self.rows)
        start = copier.begin() if copier.stream is not None else None
        if copier.stream is None:  # the CPU path: reused host tensors, their pages are mapped already
            out = copier.host.take(fields, n)
            self._read_direct(copier, out, stop)
        elif getattr(self.source, "reads_to", "host") == "device":
            out = self._read_device(copier, stop)
        else:
            out = {k: torch.empty((n, *f.shape), dtype=f.dtype, device=copier.device)
                   for k, f in fields.items()}
            self._read_to_host(copier, out, stop)
        delivered = copier.seal(out, list(out.values()), start)
        nbytes = n * sum(f.sample_nbytes for f in fields.values())
        copier.stats.add(bytes=nbytes, staged_bytes=nbytes, stage_s=time.perf_counter() - t0)
        return delivered

    def _read_to_host(self, copier: Copier, out: dict[str, torch.Tensor], stop: threading.Event) -> None:
        """Read through pinned staging buffers, or through pageable host tensors where no pinned memory is."""
        if copier.pinned_ok():
            try:
                self._read_staged(copier, out, stop)
                return
            except PinnedUnavailable:
                self.cancel()
                copier.pinned_ok()  # warns once
        self._read_pageable(copier, out, stop)

    def _read_staged(self, copier: Copier, out: dict[str, torch.Tensor], stop: threading.Event) -> None:
        started = self.start(copier, stop, block=True)
        if started and not self._one_small_read():  # (a small one is read already)
            for i in range(self.index + 1, self.index + 1 + READS_AHEAD):  # read while this batch finishes
                succ = self.chain.get(i)
                if succ is None or not succ.start(copier, stop):
                    break
        n = len(self.rows)
        while self._entries or self._next < len(self._plan or ()):
            if not self._entries:
                self.start(copier, stop, block=True)
            (r0, r1, offsets, _, _), buf, futs = self._entries.popleft()
            try:
                for fut in futs:
                    _result(fut, stop)
            except BaseException:
                self._finish(futs)
                copier.pool.release(buf, None)
                raise
            for k, v in self._views(buf, offsets, r0, [(r0, r1)])[0].items():  # (a whole batch: no slice)
                (out[k] if r1 - r0 == n else out[k][r0:r1]).copy_(v, non_blocking=True)
            copier.pool.release(buf, copier.stream)
            if self._next < len(self._plan or ()):
                self.start(copier, stop)  # a chunk's buffer came back: top up this batch's reads

    def _read_device(self, copier: Copier, stop: threading.Event) -> dict[str, torch.Tensor]:
        """A source that reads into device memory (nvCOMP decoding, GPUDirect Storage) spreads one read over
        the device (every chunk in one nvCOMP call) or its own threads (kvikio's): it is read one batch per
        read, and up to ``threads`` batches at once, this one and its successors, on the reader threads."""
        self.start_device(copier)
        for i in range(self.index + 1, self.index + self.chain.threads):
            succ = self.chain.get(i)
            if succ is None:
                break
            try:
                succ.start_device(copier)
            except Exception:  # (out of device memory ...) raised again by that batch's own start, in turn
                break
        try:
            _result(self._device_read, stop)
        except BaseException:
            self.cancel()
            raise
        out, self._device_out = self._device_out, {}  # the consumer's from now on: not kept here
        return out

    def start_device(self, copier: Copier) -> None:
        """Submit this batch's one read into device tensors allocated now (on the copy stream, current on
        the calling thread), unless it was submitted already."""
        if self._device_read is not None:
            return
        fields, n = self.source.fields, len(self.rows)
        self._device_out = {k: torch.empty((n, *f.shape), dtype=f.dtype, device=copier.device)
                            for k, f in fields.items()}
        copier.stream.synchronize()  # fence: no queued copy-stream work touches these blocks
        self._device_read = self.chain.executor.submit(self.source.read, self.rows, self._device_out)

    def _read_pageable(self, copier: Copier, out: dict[str, torch.Tensor], stop: threading.Event) -> None:
        """No pinned memory: read into pageable host tensors, then copy them (slower, still off the
        consumer's thread)."""
        host = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in out.items()}
        self._read_direct(copier, host, stop)
        for k, t in out.items():
            t.copy_(host[k])

    def _read_direct(self, copier: Copier, out: dict[str, torch.Tensor], stop: threading.Event) -> None:
        n, row = len(self.rows), _read_plan.row_bytes(self.source.fields)
        pieces = _read_plan.pieces(0, n, n, self.chain.read_threads, row, None)  # no staging buffer to fit
        jobs = [functools.partial(self.source.read, self.rows[a:b], {k: t[a:b] for k, t in out.items()})
                for a, b in pieces]
        futs = [self.chain.executor.submit(j) for j in jobs[1:]]
        futs.insert(0, run_now(jobs[0]))  # the calling thread reads a piece too: one thread handoff fewer
        try:
            for f in futs:
                _result(f, stop)
        except BaseException:
            self._finish(futs)
            raise

    # -- planning ----------------------------------------------------------------------------------

    def _one_small_read(self) -> bool:
        """A staged batch read on the fetching thread itself (``_read_plan.INLINE_BYTES``)."""
        return _read_plan.one_small_read(self._plan or [])

    def _bind(self, buf: Any, offsets: dict[str, int], r0: int, pieces: list[tuple[int, int]]) -> list[Any]:
        """One read job per piece, each with its views into ``buf``."""
        views = self._views(buf, offsets, r0, pieces)
        return [(self.rows[a:b], v) for (a, b), v in zip(pieces, views, strict=True)]

    def _views(self, buf: Any, offsets: dict[str, int], r0: int, spans: list[tuple[int, int]]) -> list[Any]:
        """For each span of rows ``[a, b)`` of the chunk that starts at row ``r0``, a typed view of every
        field's rows in ``buf``. The views are cached on the buffer per layout: consecutive batches of one
        size reuse them, so binding and copying cost no torch call for them (each drops and retakes the
        GIL that the readers and the training loop want)."""
        fields = self.source.fields
        key = (tuple(offsets.values()), tuple((a - r0, b - a) for a, b in spans),
               tuple((k, f.dtype, f.shape) for k, f in fields.items()))
        views = buf.views.get(key)
        if views is None:
            views = []
            for a, b in spans:
                piece = {}
                for k, f in fields.items():
                    base = offsets[k] + (a - r0) * f.sample_nbytes
                    t = buf.tensor[base : base + (b - a) * f.sample_nbytes]
                    piece[k] = t.view(f.dtype).view(b - a, *f.shape)
                views.append(piece)
            if len(buf.views) >= 8:  # a few layouts (full batch, last batch; reads and copies) at most
                buf.views.clear()
            buf.views[key] = views
        return views

    # -- shutdown ----------------------------------------------------------------------------------

    @staticmethod
    def _finish(futs: list[Any]) -> None:
        for fut in futs:
            fut.cancel()
        for fut in futs:
            _result(fut, None, swallow=True)

    def cancel(self) -> None:
        """Let submitted reads end and return their buffers (an epoch stopped or failed)."""
        if self._device_read is not None:
            self._finish([self._device_read])
        while self._entries:
            _, buf, futs = self._entries.popleft()
            self._finish(futs)
            if self._copier is not None:
                self._copier.pool.release(buf, None)
