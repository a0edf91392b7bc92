"""Reading an epoch of a BatchSource into host memory, a few batches ahead, on reader threads.

Each batch is read whole into one buffer of the SourceLoader's pinned pool (every field in a region of its
own), cut into pieces that reader threads read at once; the reads of the ``READS_AHEAD`` batches after the
one being handed over run meanwhile, so the readers never idle while the device stage copies. A source that
spreads a read over threads of its own (``parallel_reads``, with ``submit``) gets the whole batch as one
read, started without a Python thread. Without CUDA, batches are read into reused pageable tensors
(:class:`~gpufeed.host_memory.cpu_buffers.CpuBuffers`). A source that reads into device memory
(``reads_to == "device"``: nvCOMP decoding, GPUDirect Storage) gets device tensors, up to ``threads``
batches at once.

Invariants: a read-ahead never blocks for a buffer (it stops where the pool is empty), so it never holds a
buffer the batch being handed over waits for; a batch's buffer goes back to the pool with the event of the
copy that read it (its lease); an epoch that ends (done, failed or stopped) lets its started reads finish
and returns their buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gpufeed import _threads
from gpufeed.host_memory import HostBatch, PinnedUnavailable
from gpufeed.host_memory.cpu_buffers import CpuBuffers
from gpufeed.host_memory.pinned_pool import Buffer, PinnedPool
from gpufeed.loaders import _read_plan

#: Batches whose reads start while the one before them is handed over (docs/design.md, "Reading a
#: BatchSource").
READS_AHEAD = 2


class EpochReads:
    """The reads of one epoch: :meth:`take` returns batch ``i`` read, and starts the reads after it.

    ``pool`` is None on the CPU (``cpu`` buffers instead); ``device`` is the device that sources reading to
    the device read into.
    """

    def __init__(self, source: Any, plan: list[Any], threads: int, pool: PinnedPool | None,
                 cpu: CpuBuffers | None, device: torch.device, stop: Any) -> None:
        self.source, self.plan, self.threads = source, plan, threads
        self.pool, self.cpu, self.device, self.stop = pool, cpu, device, stop
        self.fields = source.fields
        self.to_device = getattr(source, "reads_to", "host") == "device" and device.type == "cuda"
        parallel = bool(getattr(source, "parallel_reads", False))
        self.read_threads = 1 if parallel else threads  # the pieces a batch is cut into
        self.submits = parallel and callable(getattr(source, "submit", None))
        self._started: dict[int, _Batch] = {}
        self._executor: ThreadPoolExecutor | None = None

    @property
    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-read")
        return self._executor

    def take(self, i: int) -> HostBatch:
        """Batch ``i``, read (its lease returns its buffer), with the reads of those after it started. A read
        ahead that cannot start is started again in its own turn, and fails there."""
        batch = self._started.pop(i, None) or self._start(i, block=True)
        try:
            ahead = self.threads - 1 if self.to_device else READS_AHEAD
            for j in range(i + 1, min(i + 1 + ahead, len(self.plan))):
                if j not in self._started:
                    try:
                        started = self._start(j, block=False)
                    except Exception:  # (out of device memory ...) raised again by batch j's own start
                        break
                    if started is None:
                        break
                    self._started[j] = started
        except BaseException:  # Ctrl-C in a read ahead run on this thread: this batch ends too
            batch.cancel()
            raise
        return batch.finish(self.stop)

    def _start(self, i: int, block: bool) -> _Batch | None:
        rows = self.plan[i]
        n = len(rows)
        if self.to_device:
            return self._start_device(rows)
        if self.pool is None:
            out = self.cpu.take(self.fields, n)
            return _Batch(self._submit_pieces(rows, out, first_here=True), out, None, None)
        if self.pool.available:
            offsets, nbytes = _read_plan.regions(self.fields, n)
            try:
                buf = self.pool.acquire(nbytes, self.stop) if block else self.pool.try_acquire(nbytes)
            except PinnedUnavailable:
                buf = None
            if buf is not None:
                out = _views(buf, self.fields, offsets, n)
                try:
                    return _Batch(self._submit_pieces(rows, out), out, self.pool, buf)
                except BaseException:  # (Ctrl-C in a read run on this thread) the buffer goes back
                    self.pool.release(buf, None)
                    raise
            if not block:
                return None
        out = {k: torch.empty((n, *f.shape), dtype=f.dtype) for k, f in self.fields.items()}  # pageable
        return _Batch(self._submit_pieces(rows, out), out, None, None)

    def _submit_pieces(self, rows: Any, out: dict[str, torch.Tensor], first_here: bool = False) -> list[Any]:
        """Start the reads of a batch: one small read on this thread (a handoff to a thread costs more than
        it), a source's own threads where it starts them itself, else pieces on the reader threads (on the
        CPU this thread reads the first piece: one handoff fewer)."""
        n = len(rows)
        row = _read_plan.row_bytes(self.fields)
        pieces = _read_plan.pieces(0, n, n, self.read_threads, row, None)
        jobs = [functools.partial(self.source.read, rows[a:b], {k: t[a:b] for k, t in out.items()})
                for a, b in pieces]
        if len(jobs) == 1 and n * row <= _read_plan.INLINE_BYTES:
            return [_threads.run_now(jobs[0])]
        if self.submits and not first_here:
            try:
                pending = self.source.submit(rows, out)
            except Exception as exc:  # raised by this batch's read, in its turn
                pending = _threads.failed(exc)
            if pending is not None:
                return [pending]
        if first_here:
            return [_threads.run_now(jobs[0]), *(self.executor.submit(j) for j in jobs[1:])]
        return [self.executor.submit(j) for j in jobs]

    def _start_device(self, rows: Any) -> _Batch:
        """One read of the whole batch into device tensors allocated now, on the loop's thread and stream;
        the reader waits for an event recorded behind them, so the memory the allocator hands out again is
        no longer read by the loop's kernels when the read writes it."""
        n = len(rows)
        out = {k: torch.empty((n, *f.shape), dtype=f.dtype, device=self.device)
               for k, f in self.fields.items()}
        allocated = torch.cuda.Event()
        allocated.record()

        def job() -> None:
            allocated.synchronize()
            self.source.read(rows, out)

        return _Batch([self.executor.submit(job)], out, None, None)

    def cancel(self) -> None:
        """End the epoch: let the reads started ahead finish, return their buffers, stop the threads."""
        for batch in self._started.values():
            batch.cancel()
        self._started.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class _Batch:
    """One batch's reads in flight: their futures, the tensors they fill, the buffer those are views of."""

    __slots__ = ("buf", "futures", "out", "pool")

    def __init__(self, futures: list[Any], out: dict[str, torch.Tensor], pool: PinnedPool | None,
                 buf: Buffer | None) -> None:
        self.futures, self.out, self.pool, self.buf = futures, out, pool, buf

    def finish(self, stop: Any) -> HostBatch:
        try:
            for fut in self.futures:
                _threads.result(fut, stop)
        except BaseException:
            self.cancel()
            raise
        return HostBatch(self.out, self._lease())

    def _lease(self) -> Callable[[Any], None] | None:
        """The buffer's lease: returns it to the pool with the event of the copy that read it; a second
        call does nothing (as a worker slot's lease)."""
        if self.buf is None:
            return None
        buf, self.buf = self.buf, None
        released = []

        def lease(event: Any) -> None:
            if not released:
                released.append(True)
                self.pool.release(buf, event)

        return lease

    def cancel(self) -> None:
        for fut in self.futures:
            fut.cancel()
        for fut in self.futures:
            _threads.result(fut, None, swallow=True)
        if self.buf is not None:
            self.pool.release(self.buf, None)
            self.buf = None


def _views(buf: Buffer, fields: Any, offsets: dict[str, int], n: int) -> dict[str, torch.Tensor]:
    """Each field's ``n`` rows as a typed view of ``buf``, cached on the buffer per layout: batches of one
    size reuse them, with no torch call."""
    key = (n, tuple((k, f.dtype, f.shape) for k, f in fields.items()))
    views = buf.views.get(key)
    if views is None:
        views = {k: buf.tensor[offsets[k] : offsets[k] + n * f.sample_nbytes].view(f.dtype).view(n, *f.shape)
                 for k, f in fields.items()}
        if len(buf.views) >= 4:  # a few layouts (a full batch, the last one) at most
            buf.views.clear()
        buf.views[key] = views
    return views
