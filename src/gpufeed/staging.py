"""Staging through pinned memory: a bounded pool of reused pinned buffers and the chunk pipeline.

The pipeline turns a batch into *chunks*. Each chunk is filled into a pinned buffer, then the
background thread issues its host-to-device copies on the copy stream and records the buffer's event.
Pageable tensors are filled on the background thread by gpufeed's compiled copy (``_hostcopy``: its
own threads take 256 KiB pieces, GIL released), or by torch's multi-threaded CPU copy where no C
compiler is found. Source reads (``preadv``) are filled by worker threads. Chunk ``i + 1`` is filled
while chunk ``i`` is on the PCIe link, so the two stages overlap.

Invariant (kept by :class:`PinnedPool`): a pinned buffer is handed out again only after the event
recorded behind the last copy that read it has completed, so a fill never overwrites bytes that
the copy engine has not yet read. Only the background thread records and queries those events.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from gpufeed import _driver, _hostcopy
from gpufeed._worker import Stopped

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 32 * MiB  # 16 MiB cost source reads 20% on an H200; staging is as fast (_diag_ring)
HOT_CHUNKS = 4  # the pool grows past this many chunks only when no buffer in flight could serve
DEFAULT_PINNED_BUDGET = 512 * MiB


class PinnedUnavailable(RuntimeError):
    """The pool cannot pin memory (budget 0, or the allocation failed): copy from pageable memory."""


class _Buffer:
    __slots__ = ("busy", "event", "tensor", "views")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.views: dict[Any, Any] = {}  # typed views into this buffer, cached by their user
        self.event: torch.cuda.Event | None = None  # recorded behind the last copy that read this buffer
        self.busy = False  # an event was recorded and has not been seen complete

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def done(self) -> bool:
        if self.busy and self.event is not None and not _driver.done(self.event):
            return False
        self.busy = False
        return True


class PinnedPool:
    """A bounded pool of pinned host buffers, allocated on demand and reused for the prefetcher's life.

    Buffers are allocated lazily (so the pool is sized to the batches seen) in multiples of
    ``chunk_bytes``; the pool never holds more than ``budget`` bytes, except that a single request
    larger than the budget is served by one buffer of that size. A buffer is handed out again only
    after the CUDA event recorded behind its last copy completed (see :meth:`release`).

    Staging stays *hot* (``hot=True``, the chunk pipeline): once the pool holds ``hot_bytes`` (four
    chunks), a request that a buffer still in flight could serve waits for that copy to complete
    instead of allocating another buffer. Staging then cycles through a set small enough to stay in
    the CPU's last-level cache, where both the fill and the copy engine's read are served. Measured
    on an H200 machine (300 MiB L3), 64 MiB pageable batches end to end: 54.8 GB/s through 4 x 32 MiB
    buffers, 43 through 8 x 32 MiB, 35 through 4 x 64 MiB, against a 55 GB/s pinned ceiling
    (``benchmarks/_diag_ring.py``).

    Pinned allocation can fail (locked-memory limits, a budget of zero): ``available`` is then False
    and the prefetcher falls back to pageable copies with one warning.

    Example:
        >>> pool = PinnedPool(budget=64 << 20, pin=False)
        >>> buf = pool.acquire(1 << 20, stop=threading.Event())
        >>> pool.release(buf, record_on=None)
    """

    def __init__(self, budget: int = DEFAULT_PINNED_BUDGET, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 pin: bool = True) -> None:
        if budget < 0:
            raise ValueError(f"pinned_budget must be >= 0 bytes, got {budget}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {chunk_bytes}")
        self.budget = budget
        self.chunk_bytes = chunk_bytes
        self.hot_bytes = HOT_CHUNKS * chunk_bytes
        self.fill_bytes = max(64 << 10, chunk_bytes // 4)  # one worker's share of a chunk
        self.pin = pin
        self.available = budget > 0
        self.warned = False  # the prefetcher said once that it falls back to pageable copies
        self.allocated = 0
        self.allocations = 0
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, stop: threading.Event, hot: bool = False) -> _Buffer:
        """A buffer of at least ``nbytes`` whose previous copy has completed; waits for one if needed.

        Raises:
            PinnedUnavailable: the budget is 0, or pinning memory failed (the caller copies pageable).
        """
        delay = 20e-6
        while True:
            if not self.available:
                why = "pinned_budget is 0" if self.budget == 0 else "pinned allocation failed"
                raise PinnedUnavailable(why)
            buf = self.try_acquire(nbytes, hot)
            if buf is not None:
                return buf
            if stop.is_set():
                raise Stopped
            # Back off to 1 ms: each poll takes the GIL (and queries events) and the training thread
            # waits behind it; a 32 MiB copy takes about 0.6 ms at 55 GB/s.
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def try_acquire(self, nbytes: int, hot: bool = False) -> _Buffer | None:
        """A free buffer of at least ``nbytes`` whose copy completed, a new one within budget, or None.

        With ``hot``, past ``hot_bytes`` a buffer in flight that could serve is waited for instead.
        """
        with self._lock:
            # Most recently returned first: a small hot set of buffers stays in cache and TLB
            # (round-robin over the whole pool ran slower on an H200 machine).
            for i in range(len(self._free) - 1, -1, -1):
                buf = self._free[i]
                if buf.nbytes >= nbytes and buf.done():
                    return self._free.pop(i)
            size = -(-nbytes // self.chunk_bytes) * self.chunk_bytes
            for buf in [b for b in self._free if b.nbytes < nbytes and b.done()]:
                if self.allocated + size <= self.budget:
                    break
                self._free.remove(buf)  # too small for this request: make room for a bigger one
                self.allocated -= buf.nbytes
            if not self.available:
                return None
            if hot and self.allocated + size > self.hot_bytes and any(b.nbytes >= nbytes for b in self._free):
                return None  # past the hot set: wait for a copy in flight rather than grow (see class doc)
            if self.allocated + size <= self.budget or (self.allocated == 0 and not self._free):
                return self._allocate(size)
            return None  # every buffer is out; one comes back when its copy completes

    def release(self, buf: _Buffer, record_on: torch.cuda.Stream | None) -> None:
        """Return ``buf``; with ``record_on``, its event is recorded there, behind the copies that read it."""
        if record_on is not None:
            if buf.event is None:
                buf.event = torch.cuda.Event()
            buf.event.record(record_on)
            buf.busy = True
        with self._lock:
            self._free.append(buf)

    def release_in_flight(self, buf: _Buffer) -> None:
        """Return ``buf`` whose event was recorded behind its copies already (by ``gpufeed_stage``)."""
        buf.busy = True
        with self._lock:
            self._free.append(buf)

    def _allocate(self, size: int) -> _Buffer | None:
        try:
            tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError:  # cudaHostAlloc refused (locked-memory limit, no driver): go pageable
            self.available = False
            return None
        self.allocated += size
        self.allocations += 1
        return _Buffer(tensor)

    def clear(self) -> None:
        """Free every buffer that is back in the pool, once its copy completed."""
        with self._lock:
            for buf in self._free:
                if buf.event is not None:
                    buf.event.synchronize()
                self.allocated -= buf.nbytes
            self._free.clear()


@dataclass
class Chunk:
    """One unit of the pipeline, staged through one pinned buffer of ``nbytes``.

    Each ``(src, offset)`` of ``segments`` (a flat uint8 host view) is copied to ``buf[offset:]`` on the
    pipeline's own thread. Each callable of ``fills`` writes its part of the buffer (they run in parallel
    worker threads and touch disjoint bytes). Once both are done, each ``(dst, offset, n)`` of ``copies``
    is copied from ``buf[offset:offset+n]`` into the flat uint8 device view ``dst`` on the copy stream.
    """

    nbytes: int
    fills: list[Callable[[torch.Tensor], None]]
    copies: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    segments: list[tuple[torch.Tensor, int]] = field(default_factory=list)


def memcpy_fill(src_addr: int, offset: int, nbytes: int) -> Callable[[torch.Tensor], None]:
    """A fill that copies ``nbytes`` from host address ``src_addr`` to ``buf[offset:]`` (no GIL held)."""

    def fill(buf: torch.Tensor) -> None:
        ctypes.memmove(buf.data_ptr() + offset, src_addr, nbytes)

    return fill


#: A chunk this small is copied by ``memmove`` on the calling thread: waking a team of threads for it
#: costs more than it saves. Bigger ones go to the compiled copy, or segment by segment to torch's.
SMALL_FILL_BYTES = 64 << 10


def fill_segments(buf: torch.Tensor, segments: Sequence[tuple[torch.Tensor, int]]) -> None:
    """Copy each ``(src, offset)`` of ``segments`` (flat uint8 host views) into ``buf[offset:]``."""
    if not segments:
        return
    base = buf.data_ptr()
    parts = [(src.data_ptr(), off, src.numel()) for src, off in segments]
    total = sum(n for _, _, n in parts)
    if total >= SMALL_FILL_BYTES and STAGE_COPY == "auto":
        lib = _hostcopy.load()
        if lib is not None:
            _hostcopy.copy(lib, base, parts, min(copy_threads(), -(-total // _hostcopy.PIECE_BYTES)))
            return
    for (addr, off, n), (src, _) in zip(parts, segments, strict=True):
        if n >= SMALL_FILL_BYTES:
            buf[off : off + n].copy_(src)  # torch's parallel copy
        else:
            ctypes.memmove(base + off, addr, n)


def copy_threads() -> int:
    """Threads of the compiled staging copy (the background thread included): ``GPUFEED_COPY_THREADS``,
    else torch's intra-op thread count less one, so the training thread keeps a core to launch kernels.
    """
    if COPY_THREADS:
        return COPY_THREADS
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cpus) - 1)


def plan_chunks(leaves: Sequence[tuple[torch.Tensor, torch.Tensor | None]], chunk_bytes: int,
                fill_bytes: int | None = None, block: torch.Tensor | None = None) -> list[Chunk]:
    """Chunks that stage each contiguous host tensor ``src`` of ``leaves`` into its device tensor ``dst``.

    The leaves are laid end to end, each at a 64-byte boundary (:func:`layout`), and cut into chunks of
    ``chunk_bytes``: a 64 MiB batch of four tensors takes two 32 MiB chunks, as one tensor would, and
    every byte is copied by all cores. (Filling small tensors apart, one worker ``memmove`` each, left one
    core copying 4 MiB while the others waited: 31 GB/s where the same bytes as one tensor staged at 45
    on an H200 machine, ``benchmarks/_diag_shape.py``.)

    With ``block``, a flat uint8 device tensor laid out the same way (the ``dst`` are then ignored and
    may be None), each chunk is copied to the device in one piece.

    Without ``fill_bytes`` the chunks are filled on the pipeline's thread (``segments``); with it, by
    worker-thread ``memmove`` pieces of at most that size (``fills``, ``GPUFEED_STAGE_COPY=threads``).
    """
    chunk_bytes = chunk_bytes // 64 * 64
    chunks: list[Chunk] = []
    views = [(byte_view(src), None if block is not None else byte_view(dst)) for src, dst in leaves]
    for c, k, pos, off, n in _cut([v[0].numel() for v in views], chunk_bytes):
        if c == len(chunks):
            chunks.append(Chunk(0, []))
        chunk, (src_bytes, dst_bytes) = chunks[c], views[k]
        if fill_bytes is None:
            chunk.segments.append((src_bytes[pos : pos + n], off))
        else:
            base = src_bytes.data_ptr() + pos
            chunk.fills += [memcpy_fill(base + o, off + o, m) for o, m in split(n, fill_bytes)]
        if dst_bytes is not None:
            chunk.copies.append((dst_bytes[pos : pos + n], off, n))
        chunk.nbytes = off + n
    if block is not None:
        for i, chunk in enumerate(chunks):
            start = i * chunk_bytes
            chunk.copies = [(block[start : start + chunk.nbytes], 0, chunk.nbytes)]
    return chunks


def _cut(sizes: Sequence[int], chunk_bytes: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Lay leaves of ``sizes`` bytes end to end at 64-byte boundaries and cut them into chunks of
    ``chunk_bytes`` (a multiple of 64): ``(chunk, leaf, position in the leaf, offset in the chunk, n)``
    for each piece of a leaf in a chunk. Chunk ``i`` starts at byte ``i * chunk_bytes`` of the layout."""
    c, off = -1, chunk_bytes
    for k, total in enumerate(sizes):
        pos = 0
        while pos < total:
            if off >= chunk_bytes:
                c, off = c + 1, 0
            n = min(total - pos, chunk_bytes - off)
            yield c, k, pos, off, n
            pos += n
            off = align(off + n)


@dataclass
class RawChunk:
    """A chunk in addresses, for :meth:`ChunkPipeline.run_raw`: each ``(src_address, offset, n)`` of
    ``segments`` is copied into the pinned buffer at ``offset``; each ``(device_address, offset, n)`` of
    ``copies`` is sent from the buffer at ``offset``."""

    nbytes: int
    segments: list[tuple[int, int, int]]
    copies: list[tuple[int, int, int]]


def plan_raw(leaves: Sequence[tuple[int, int]], chunk_bytes: int, block: int) -> list[RawChunk]:
    """:func:`plan_chunks` for ``(address, nbytes)`` host leaves into device address ``block`` (laid out by
    :func:`layout`), in integers: no torch call, so no GIL handoff, per leaf or chunk."""
    chunk_bytes = chunk_bytes // 64 * 64
    chunks: list[RawChunk] = []
    for c, k, pos, off, n in _cut([size for _, size in leaves], chunk_bytes):
        if c == len(chunks):
            chunks.append(RawChunk(0, [], []))
        chunks[c].segments.append((leaves[k][0] + pos, off, n))
        chunks[c].nbytes = off + n
    for i, chunk in enumerate(chunks):  # each chunk goes to the device in one piece
        chunk.copies.append((block + i * chunk_bytes, 0, chunk.nbytes))
    return chunks


def align(n: int) -> int:
    """``n`` rounded up to a multiple of 64 bytes (a cache line; every dtype's alignment)."""
    return -(-n // 64) * 64


def layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``nbytes`` laid end to end at 64-byte boundaries, and the bytes they span:
    the layout :func:`plan_chunks` stages them in (its chunk size is a multiple of 64)."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end = align(end + n)
    return offsets, (offsets[-1] + nbytes[-1]) if nbytes else 0


def plan_leaf_chunks(src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int,
                     fill_bytes: int | None = None) -> list[Chunk]:
    """Chunks that stage one contiguous host tensor ``src`` into device tensor ``dst``: see plan_chunks."""
    return plan_chunks([(src, dst)], chunk_bytes, fill_bytes)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)


def split(total: int, piece: int) -> list[tuple[int, int]]:
    """``[(offset, n), ...]`` covering ``range(total)`` in pieces of at most ``piece``."""
    return [(off, min(piece, total - off)) for off in range(0, total, piece)]


#: How pageable tensors are copied into pinned buffers: ``auto`` (gpufeed's compiled copy on its own
#: threads, built on first use; torch's where no C compiler is found), ``torch`` (torch's parallel
#: ``copy_``, its OpenMP threads) or ``threads`` (``memmove`` pieces on gpufeed's Python worker threads).
#: All run off the training thread. ``GPUFEED_STAGE_COPY`` picks; see docs/tuning.md.
STAGE_COPY = os.environ.get("GPUFEED_STAGE_COPY", "auto").strip().lower() or "auto"
if STAGE_COPY not in ("auto", "torch", "threads"):
    raise ValueError(f"GPUFEED_STAGE_COPY must be 'auto', 'torch' or 'threads', got {STAGE_COPY!r}")
#: Threads of the compiled copy, ``GPUFEED_COPY_THREADS`` (0: :func:`copy_threads` picks).
_threads = os.environ.get("GPUFEED_COPY_THREADS", "").strip() or "0"
if not _threads.isdigit():
    raise ValueError(f"GPUFEED_COPY_THREADS must be a whole number >= 0 (0: the default), got {_threads!r}")
COPY_THREADS = int(_threads)


#: Worker fills this small (a small batch's one read, a chunk of ``GPUFEED_STAGE_COPY=threads``) run on
#: the background thread itself: handing them to a worker costs GIL handoffs (submit, wake, result, wake),
#: and each can delay the training thread's next torch call. Larger ones run on the workers, beside the
#: next chunk's fill.
INLINE_BYTES = 1 << 20


def run_now(job: Callable[[], Any]) -> Future:
    """Run ``job`` on this thread; a done Future with its result or exception (as a worker's would be)."""
    fut: Future = Future()
    try:
        fut.set_result(job())
    except BaseException as exc:  # delivered through the future, as from a worker thread
        fut.set_exception(exc)
    return fut


class ChunkPipeline:
    """Runs chunks through the pool: fills in worker threads, H2D copies in order on ``stream``.

    At most ``max_in_flight`` fills run ahead of the copies, and the pool's budget bounds them too.
    Called only from the background thread; the workers never touch CUDA.
    """

    def __init__(self, pool: PinnedPool, executor: ThreadPoolExecutor, stream: torch.cuda.Stream | None,
                 max_in_flight: int, trace: Any = None) -> None:
        self.trace = trace  # a TraceRecorder: one span per fill, on the worker's row
        self.pool = pool
        self.executor = executor
        self.stream = stream
        self.max_in_flight = max(1, max_in_flight)
        self.threads: int = executor._max_workers  # reads per batch are split so every worker has one

    def run(self, chunks: Sequence[Chunk], stop: threading.Event) -> None:
        # pending entries: (chunk, buffer, futures of its worker fills). Worker fills (packed small
        # tensors) are submitted as soon as they have a buffer, so they run while the next inline
        # torch copy runs.
        pending: collections.deque[tuple[Chunk, _Buffer, list[Future]]] = collections.deque()
        todo = collections.deque(chunks)
        try:
            while todo or pending:
                while todo and len(pending) < self.max_in_flight:
                    # Block for a buffer only when nothing is in flight; else copy what is ready first.
                    nbytes = todo[0].nbytes
                    pool = self.pool
                    buf = (pool.try_acquire(nbytes, hot=True) if pending
                           else pool.acquire(nbytes, stop, hot=True))
                    if buf is None:
                        break
                    chunk = todo.popleft()
                    jobs = self._jobs(chunk, buf.tensor)
                    if chunk.segments or chunk.nbytes <= INLINE_BYTES:  # fill it here, no worker handoff
                        try:
                            fill_segments(buf.tensor, chunk.segments)  # torch's parallel copy, GIL released
                            for job in jobs:
                                job()
                        except BaseException:
                            self.pool.release(buf, None)
                            raise
                        self._copy(chunk, buf)
                        continue
                    futs = [self.executor.submit(job) for job in jobs]
                    pending.append((chunk, buf, futs))
                if not pending:
                    continue
                chunk, buf, futs = pending[0]
                for fut in futs:
                    _result(fut, stop)
                pending.popleft()
                self._copy(chunk, buf)
        finally:
            for _, buf, futs in pending:  # on error or stop: let running fills end before reuse
                for fut in futs:
                    fut.cancel()
                for fut in futs:
                    _result(fut, None, swallow=True)
                self.pool.release(buf, None)

    def staged_lib(self) -> Any:
        """The compiled library when batches can go through :meth:`run_raw`, else None (then :meth:`run`)."""
        if self.stream is None or STAGE_COPY != "auto" or self.trace is not None:
            return None
        lib = _hostcopy.load()
        return lib if lib is not None and _hostcopy.driver_ok() else None

    def run_raw(self, lib: Any, chunks: Sequence[RawChunk], stop: threading.Event) -> None:
        """Fill and send the chunks in as few GIL-free calls as the pool's free buffers allow.

        Each call takes every chunk that has a buffer (the first waits for one), up to the hot set: the
        background thread then stays in C for a whole 64 MiB batch. Each GIL-releasing call it made
        instead (a dozen torch calls per batch) let the training thread take the GIL, and the
        background thread then waited for it back while the copy engine ran dry.
        """
        stream = self.stream.cuda_stream
        todo = collections.deque(chunks)
        threads = copy_threads()
        most = max(1, self.pool.hot_bytes // self.pool.chunk_bytes)  # the buffers out at once stay hot
        while todo:
            buf = self.pool.acquire(todo[0].nbytes, stop, hot=True)
            group = [(todo.popleft(), buf)]
            while todo and len(group) < most and (buf := self.pool.try_acquire(todo[0].nbytes, hot=True)):
                group.append((todo.popleft(), buf))
            work = [(buf.tensor.data_ptr(), c.segments, c.copies, self._event(buf)) for c, buf in group]
            try:
                _hostcopy.stage(lib, work, stream, threads)
            except _hostcopy.StageError as exc:
                for i, (_, buf) in enumerate(group):
                    if i < exc.issued:
                        self.pool.release_in_flight(buf)
                    else:
                        self.pool.release(buf, None)
                raise
            except BaseException:
                for _, buf in group:
                    self.pool.release(buf, None)
                raise
            for _, buf in group:
                self.pool.release_in_flight(buf)

    def _event(self, buf: _Buffer) -> int:
        """The raw CUevent of ``buf``'s event, created (recorded once on the copy stream) when new."""
        if buf.event is None:
            buf.event = torch.cuda.Event()
            buf.event.record(self.stream)
        return buf.event.cuda_event

    def _jobs(self, chunk: Chunk, buf: torch.Tensor) -> list[Callable[[], None]]:
        jobs = [functools.partial(f, buf) for f in chunk.fills]
        return jobs if self.trace is None else [_traced(self.trace, job) for job in jobs]

    def _copy(self, chunk: Chunk, buf: _Buffer) -> None:
        for dst, off, n in chunk.copies:
            dst.copy_(buf.tensor[off : off + n], non_blocking=True)
        self.pool.release(buf, self.stream)


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


def warn_pageable(reason: str) -> None:
    warnings.warn(
        f"gpufeed: pinned staging is off ({reason}); falling back to pageable host-to-device copies, "
        "which are slower and may stall. Raise the locked-memory limit (ulimit -l) or pinned_budget.",
        RuntimeWarning,
        stacklevel=3,
    )
