"""CudaPrefetcher: wrap any loader so that every batch arrives already on the GPU."""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import queue
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from gpufeed import _nvtx, _worker
from gpufeed._copier import Copier, Delivered, InFlight
from gpufeed._host_buffers import HostBuffers
from gpufeed._static import StaticBuffers
from gpufeed._streams import StreamSwitch
from gpufeed._tracing import TraceRecorder
from gpufeed._worker_slots import WorkerSlots
from gpufeed._wrapped import WrappedLoader, has_workers
from gpufeed.pinned_pool import PinnedPool
from gpufeed.staging import DEFAULT_CHUNK_BYTES, DEFAULT_PINNED_BUDGET
from gpufeed.stats import PrefetchStats

_LIVE: weakref.WeakSet[CudaPrefetcher] = weakref.WeakSet()
_JOIN_S = 5.0
#: An epoch's batches measured inline before it decides whether to fetch on a background thread.
PROBE_BATCHES = 2
#: What a background thread costs the loop per batch: the GIL and queue handoffs, and its slower staging
#: (torch's parallel copy wakes a second OpenMP team); inside the break-even that the A/B of
#: docs/design.md ("Fetching on the loop's thread") found on both cards.
THREAD_COST_S = 3e-3


class CudaPrefetcher:
    """Yield the batches of ``source`` with every tensor already on ``device``.

    One line in a training loop::

        for batch in CudaPrefetcher(loader):           # any DataLoader, list or iterable
            loss = model(batch["x"]).loss(batch["y"])   # batch["x"] is already on the GPU

    Wraps any iterable (a DataLoader, a list, a callable that returns a fresh iterable each epoch),
    or a :class:`~gpufeed.SourceLoader`, which batches a :class:`~gpufeed.BatchSource` (files read
    straight into the prefetcher's pinned buffers). ``depth`` batches are kept copied ahead of the
    loop: tensors that are not pinned are pinned (torch's caching host allocator) and copied to the
    device on one dedicated copy stream while the loop computes on its own stream. Each epoch fetches on
    the loop's thread, as a one-ahead side-stream prefetcher does, and moves to a background thread when
    its first batches show the GPU idle when the loop asks (a sync every step) with time to hide the
    fetching in (large pageable batches or a slow loader); ``pf.stats.threaded_batches`` counts those.
    Re-iterate it for each epoch; ``len``, ``set_epoch`` and ``state_dict`` behave as a DataLoader's.
    ``pf.stats`` (a :class:`~gpufeed.PrefetchStats`) says whether the loop waited for data:
    ``print(pf.stats.summary())``. Without CUDA (or with ``device="cpu"``) the same class runs on the
    CPU, without streams; there an epoch moves to a background thread only where a core is left beside
    torch's intra-op threads (``torch.get_num_threads()``), and otherwise reads each batch on the loop's
    thread when the loop asks for it (as ``num_workers=0`` does).

    Example:
        >>> loader = [{"x": torch.arange(4)}, {"x": torch.arange(4, 8)}]
        >>> with CudaPrefetcher(loader, device="cpu") as pf:
        ...     [b["x"].sum().item() for b in pf]
        [6, 22]

    Args:
        source: the loader: any iterable, a zero-argument callable returning one, or a SourceLoader.
        device: target device; ``None`` means the current CUDA device when CUDA is available, else CPU.
        depth: batches prefetched ahead of the one the loop holds (>= 1; 1 is double buffering); a CPU
            epoch on the loop's thread reads each batch when asked, without prefetching.
        transform: optional function applied to each batch on the device, on the copy stream (ship
            ``uint8`` and convert on the GPU: a quarter of the bytes of ``float32``).
        pinned_budget: bytes of pinned memory a SourceLoader's reads may hold (default 512 MiB); 0
            disables pinned staging for any loader (pageable copies, still off the loop's thread). With
            another loader, any other value raises: its batches are pinned by torch's caching host
            allocator.
        chunk_bytes: a pageable tensor larger than this is staged in chunks of it, so filling one chunk
            overlaps the copy of the one before; also the size of a source's pinned buffers. It and
            ``pinned_budget`` apply to a CUDA device only: on the CPU a value raises.
        static: deliver every batch into the same device tensors, for a captured CUDA graph; each item
            is then a :class:`~gpufeed.StaticBatch` ``(batch, valid)``, a short last batch zero-padded.
        trace: record every batch's stages for :meth:`export_trace` (default: env ``GPUFEED_TRACE=1``).
        worker_slots: a DataLoader's workers copy each collated batch into a slot of shared memory that
            the prefetcher pinned once, so the main process copies none of its bytes (the loader's own
            ``pin_memory`` then has nothing left to do). ``None`` (default): on for a DataLoader with
            workers, or a callable returning one, on CUDA; ``True`` also on the CPU, where the batch is
            copied out of its slot (what the CPU tests run); ``False``: batches cross as the DataLoader
            hands them over.

    Stream and memory invariants:

    * One copy stream serves the prefetcher's whole life (not one per epoch).
    * Each batch's copies (and ``transform``) are followed by one event on the copy stream;
      ``__next__`` makes the consumer's current stream wait on that event only.
    * Device tensors of a batch are allocated on the copy stream and ``record_stream``-ed to the
      consumer's stream, so the caching allocator never hands their memory to a later copy while
      kernels of the consumer may still read it, even when the user keeps the batch.
    * Pinned staging memory is refilled only after the event behind the copy that read it completed
      (:mod:`gpufeed.staging`).
    * At most ``depth`` batches are prefetched (copied or being copied) ahead of the batch the consumer
      holds, whichever thread fetches them.
    """

    def __init__(
        self,
        source: Any,
        device: torch.device | str | int | None = None,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
        *,
        pinned_budget: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        static: bool = False,
        trace: bool | None = None,
        worker_slots: bool | None = None,
        **unexpected: Any,
    ) -> None:
        if unexpected:
            raise TypeError(_unexpected_message(unexpected))
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (batches prefetched ahead), got {depth!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {type(transform).__name__}")
        self.device = _resolve_device(device)
        self.depth = depth
        self.transform = transform
        self.stats = PrefetchStats()
        self.epoch = 0
        self._epoch_set = False
        self._started = False
        self._closed = False
        self._current: weakref.ref[_EpochIterator] | None = None
        self._state: Any = None  # the resumable state after the last batch handed to the consumer
        self._resume: tuple[int, int] | None = None  # (epoch, batch) to start from, after load_state_dict
        self._lock = threading.Lock()
        self._loader = WrappedLoader(source)
        if pinned_budget is not None and pinned_budget > 0 and self._loader.source_loader is None:
            raise ValueError(
                f"pinned_budget={pinned_budget!r} bounds the pinned read buffers of a SourceLoader; with a "
                f"{type(source).__name__} only pinned_budget=0 applies (no pinned staging): its batches "
                "are pinned in torch's caching host allocator, which has no budget of its own")
        self._cuda = self.device.type == "cuda"
        if not self._cuda and ((pinned_budget or 0) > 0 or chunk_bytes != DEFAULT_CHUNK_BYTES):
            raise ValueError(
                f"pinned_budget and chunk_bytes size the pinned staging of copies to a CUDA device; on "
                f"{self.device} batches are read into reused host tensors and nothing is staged: leave "
                "them unset (pinned_budget=0 is accepted)")
        self._slots = _worker_slots(worker_slots, source, self._loader, self._cuda, pinned_budget, depth)
        self._loader.slots = self._slots
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        budget = DEFAULT_PINNED_BUDGET if pinned_budget is None else int(pinned_budget)
        self._pool = PinnedPool(budget, chunk_bytes, pin=self._cuda)
        # CPU batches: ``depth`` queued, one being read, and the one or two the loop still holds.
        self._host = HostBuffers(slots=depth + 3)
        self._in_flight = InFlight(self.stats)  # copies of ended epochs are let go of once complete
        self._static = StaticBuffers() if static else None
        if trace is None:
            trace = os.environ.get("GPUFEED_TRACE", "0") not in ("", "0", "false", "no")
        self._trace = TraceRecorder() if trace else None
        _LIVE.add(self)

    # -- drop-in surface ---------------------------------------------------------------------------

    @property
    def source(self) -> Any:
        return self._loader.source

    def __len__(self) -> int:
        return self._loader.length()

    def __getattr__(self, name: str) -> Any:
        # dataset, sampler, batch_size, collate_fn ... read through to the wrapped loader, when it has them.
        loader = self.__dict__.get("_loader")
        if not name.startswith("_") and loader is not None and hasattr(loader.source, name):
            return getattr(loader.source, name)
        wrapped = f" nor has the wrapped {type(loader.source).__name__}" if loader is not None else ""
        raise AttributeError(f"'CudaPrefetcher' object has no attribute {name!r}{wrapped}")

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration, forwarded to the loader, its sampler and batch sampler."""
        self.epoch = int(epoch)
        self._epoch_set = True
        self._loader.set_epoch(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        with self._lock:  # (close() takes it too: no epoch starts on a prefetcher being closed)
            if self._closed:
                raise RuntimeError("this CudaPrefetcher is closed; create a new one to iterate again")
            previous = self._current() if self._current is not None else None
            if previous is not None:
                previous._shutdown("a new iteration of the same CudaPrefetcher started")
            start = 0
            if self._resume is not None:  # kept until a batch is handed out: a probing iter() keeps it
                self.epoch, start = self._resume
            else:
                self.epoch = self._loader.next_epoch(self.epoch, self._started, self._epoch_set)
            self._started = self._epoch_set = False
            self._state = self._loader.initial_state(self.epoch, start)
            may_thread = self._cuda or _cpu_core_to_spare()
            batches = self._loader.batches(self.epoch, start, spare_core=may_thread)
            it = _EpochIterator(self, batches, may_thread)
            self._current = weakref.ref(it)
        return it

    def export_trace(self, path: str | os.PathLike[str]) -> str:
        """Write a Chrome/Perfetto trace of every batch's stages and the consumer's waits.

        Open it in https://ui.perfetto.dev or chrome://tracing: one row for the fetching (fetch, stage,
        copy issue; on the loop's thread these spans lie inside its waits), one for the consumer (wait).
        Needs ``trace=True`` (or ``GPUFEED_TRACE=1``).
        """
        if self._trace is None:
            raise RuntimeError("tracing is off: create the prefetcher with trace=True "
                               "(or set GPUFEED_TRACE=1)")
        return self._trace.write(path)

    # -- resumption --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the consumer has received so far (not what is in flight), to resume exactly there.

        The wrapped loader needs ``state_dict`` (a :class:`~gpufeed.SourceLoader`, torchdata's
        ``StatefulDataLoader``): this is the loader's state taken right after it produced the last batch
        handed out (for a SourceLoader: the epoch, the batches handed out in it, the configuration).

        Example:
            >>> pf = CudaPrefetcher(SourceLoader(source, batch_size=32))      # doctest: +SKIP
            >>> ckpt = pf.state_dict()                                        # doctest: +SKIP
            >>> CudaPrefetcher(SourceLoader(source, batch_size=32)).load_state_dict(ckpt)  # doctest: +SKIP
        """
        return self._loader.state_dict(self._state, self.epoch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration yields exactly the batches not yet received."""
        self.epoch, start = self._loader.load_state_dict(state)
        self._resume = (self.epoch, start)
        self._epoch_set = False
        self._state = self._loader.initial_state(self.epoch, start)  # state_dict() says the loaded position

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the epoch (and its background thread), free pinned and device buffers; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            it = self._current() if self._current is not None else None
        if it is not None:
            it._shutdown("the CudaPrefetcher was closed")
        if self._cuda:
            try:
                self._in_flight.close()
            except Exception:  # a broken CUDA context: nothing left to wait for
                pass
        if self._slots is not None:
            self._slots.close()
        self._pool.clear()
        self._host.clear()

    def __enter__(self) -> CudaPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- used by an epoch ---------------------------------------------------------------------------

    def _copier(self) -> Copier:
        # One copier an epoch: its count of batches starts again, so each epoch's first batch, which pays
        # the start-up, is never the one timed with CUDA events; pinned buffers live on in the pool.
        return Copier(self.device, self._stream, self._pool, self.stats, self.transform, self._trace,
                      host=self._host, in_flight=self._in_flight, slots=self._slots)


class _EpochIterator:
    """One epoch's deliveries: made on the loop's thread in ``__next__`` (inline), then, where it pays,
    by a background thread into a queue.

    An epoch starts inline; a CUDA one keeps ``depth`` batches copied ahead of the one it returns (the
    copy of each runs on the copy stream while the loop computes). Once its first batches show that a
    thread would hide more than it costs (:func:`_thread_pays`: the GPU waits for the loop, which
    leaves time between batches, and fetching takes time), the rest of the epoch is fetched by a
    background thread, ``depth`` batches ahead. A CPU epoch moves only where a core is left beside
    torch's intra-op threads (:func:`_cpu_core_to_spare`).

    Invariants: batches reach the loop in the loader's order, each once, an error at its batch; at
    most ``depth`` are fetched ahead of the one the loop holds, inline and on the thread together
    (the thread's slots start at ``depth`` less those made ahead inline).

    The thread holds no reference to this object or to the prefetcher, so ``break``, ``del`` and
    garbage collection of the iterator stop it (a finalizer sets the stop flag and joins).
    """

    def __init__(self, pf: CudaPrefetcher, batches: Iterable[Any], may_thread: bool) -> None:
        self._pf = pf  # keeps the prefetcher (stream, pool) alive while an epoch runs
        self._stop = threading.Event()
        self._done = False
        self._reason = ""
        self._last_t: float | None = None
        self._streams = StreamSwitch(pf.device, pf._stream) if pf._stream is not None else None
        self._thread: threading.Thread | None = None
        consumer = self._streams.current() if self._streams is not None else None
        self._deliveries = _deliveries(batches, pf._copier(), self._stop, consumer)
        # Inline: the deliveries made ahead of the one returned (Delivered, then END or a Failure last).
        self._ahead: collections.deque[Any] = collections.deque()
        self._keep_ahead = pf.depth if pf._cuda else 0
        # While the epoch decides whether a thread pays: the loop's time between two batches, and the
        # time fetching a batch took; ``None`` once decided (or where no thread may take over).
        self._gaps: list[float] = []
        self._fetches: list[float] | None = [] if may_thread else None
        self._gpu_busy = False  # the loop's GPU work was still running when it asked for a batch
        self._fetcher: dict[str, Any] = {}  # the fetch thread and its queue, once one takes over
        self._finalizer = weakref.finalize(self, _stop_epoch, self._stop, self._deliveries, self._fetcher)

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            if self._reason:
                raise RuntimeError(f"this gpufeed iterator was stopped: {self._reason}")
            raise StopIteration
        t0 = time.perf_counter()
        consumer = self._streams.current() if self._streams is not None else None
        try:
            if self._last_t is not None and self._fetches is not None:  # (None once decided)
                self._decide(t0 - self._last_t, consumer)
            if self._thread is None:
                item = self._read_inline()
            else:
                item = self._next_threaded()
                self._slots.release()
        except BaseException:  # Ctrl-C, or closed from another thread: the epoch ends now, not at collection
            if not self._done:
                self._shutdown("")
            raise
        stats = self._pf.stats
        if isinstance(item, Delivered):
            if not self._pf._started:  # an epoch counts once it hands out a batch (not a probing iter())
                self._pf._started = True
                self._pf._resume = None
                self._pf._loader.epoch_started(self._pf.epoch)
            batch = item.handover(consumer)
            try:
                batch = batch if self._pf._static is None else self._pf._static.fill(batch)
            finally:
                self._account(t0, stats)
            self._pf._state = item.state
            stats.batches += 1
            return batch
        self._account(t0, stats)
        self._finish()
        if isinstance(item, _worker.Failure):
            item.reraise()
        raise StopIteration

    def _account(self, t0: float, stats: PrefetchStats) -> None:
        """Count the time since ``t0`` (all of ``next()``, the hand-over included) as the loop's wait, or as
        start-up for an epoch's first batch; what the loop does between batches is the rest of ``wall_s``."""
        now = time.perf_counter()
        if self._last_t is None:  # the pipeline starting up: not a wait of the training loop
            stats.startup_s += now - t0
        else:
            stats.wait_s += now - t0
            stats.wall_s += now - self._last_t
        self._last_t = now
        if self._pf._trace is not None:
            self._pf._trace.add("wait", int(t0 * 1e9), int(now * 1e9), "consumer", batch=stats.batches)

    def _decide(self, gap: float, consumer: torch.cuda.Stream | None) -> None:
        """Note the loop's time since the last batch, and whether the GPU is still busy with what the
        loop queued; after :data:`PROBE_BATCHES` batches, move the fetching to a background thread if
        it pays (:func:`_thread_pays`), or stay inline for the rest of the epoch."""
        self._gaps.append(gap)
        if consumer is not None and not self._gpu_busy:
            mark = torch.cuda.Event()
            mark.record(consumer)
            self._gpu_busy = not mark.query()
            self._pf.stats.gpu_busy |= self._gpu_busy
        if len(self._gaps) < PROBE_BATCHES:
            return
        if self._fetches and _thread_pays(self._gaps, self._fetches, self._gpu_busy) and not self._ended():
            self._start_thread()
        self._fetches = None  # decided: measure no more

    def _ended(self) -> bool:
        return bool(self._ahead) and not isinstance(self._ahead[-1], Delivered)

    def _start_thread(self) -> None:
        """Hand the rest of the epoch's deliveries to a background thread; those made ahead inline stay
        first in line, and count against the ``depth`` batches the thread may make ahead."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = _worker.Slots(self._pf.depth - len(self._ahead))
        args = (self._deliveries, self._pf._stream, self._queue, self._slots, self._stop)
        thread = threading.Thread(target=_produce, args=args, name="gpufeed-fetch", daemon=True)
        self._fetcher.update(thread=thread, queue=self._queue)  # before it starts: the finalizer joins it
        thread.start()
        self._thread = thread
        self._check_stopped()  # a close() from another thread while it started

    def _read_inline(self) -> Any:
        """The next delivery, after making ``depth`` more ahead of it (CUDA) or none (CPU). Their copies
        (and the transform) go to the copy stream, current meanwhile; the loop's stream is current after."""
        t0 = time.perf_counter()
        streams = self._streams
        device = streams.enter_copy() if streams is not None else 0
        try:
            while len(self._ahead) <= self._keep_ahead and not self._ended():
                self._ahead.append(self._pull())
                self._check_stopped()
        finally:
            if streams is not None:
                streams.leave_copy(device)
        if self._fetches is not None and self._last_t is not None:
            self._fetches.append(time.perf_counter() - t0)
        try:
            return self._ahead.popleft()
        except IndexError:  # cleared by a close() from another thread
            self._check_stopped()
            raise

    def _check_stopped(self) -> None:
        """Closed from another thread (while this one read, or started the thread): the epoch ends here."""
        if self._stop.is_set():
            self._done = True
            self._ahead.clear()
            _stop_epoch(self._stop, self._deliveries, self._fetcher)  # what the finalizer could not close
            raise RuntimeError(f"this gpufeed iterator was stopped: {self._reason}")

    def _pull(self) -> Any:
        """The next delivery, or the loader's error, re-raised by ``__next__`` in its turn (as a thread's
        would be). Ctrl-C is raised now: it ends the epoch without handing out the batches made ahead."""
        try:
            return next(self._deliveries, _worker.END)
        except Exception as exc:
            return _worker.Failure.caught(exc)

    def _next_threaded(self) -> Any:
        try:
            return self._ahead.popleft()  # those made inline before the thread took over come first
        except IndexError:
            pass
        item = self._get()
        if isinstance(item, Delivered):
            self._pf.stats.threaded_batches += 1
        return item

    def _get(self) -> Any:
        q, thread = self._queue, self._thread
        while True:
            try:
                item = q.get(timeout=_worker.POLL_S)
            except queue.Empty:
                self._check_stopped()
                if not thread.is_alive() and q.empty():
                    raise RuntimeError("gpufeed's background thread ended without a result") from None
                continue
            self._check_stopped()  # closed meanwhile: what the thread made is not handed out (as inline)
            return item

    def _finish(self) -> None:
        self._done = True
        self._ahead.clear()  # batches made ahead: their device memory goes back now
        self._finalizer()

    def _shutdown(self, reason: str) -> None:
        self._reason = reason
        self._finish()

    def close(self) -> None:
        """End this epoch now: its background thread stops (or, inline, its loader's iterator closes)."""
        self._shutdown("closed")


def _produce(deliveries: Iterator[Any], stream: torch.cuda.Stream | None, q: queue.SimpleQueue,
             slots: _worker.Slots, stop: threading.Event) -> None:
    """The background thread: make each delivery once a slot is free, and put it on the queue."""
    try:
        if stream is not None:
            torch.cuda.set_stream(stream)  # this thread's current stream (and device): every copy goes there
        while True:
            slots.acquire(stop)
            item = next(deliveries, _worker.END)
            q.put(item)
            if item is _worker.END:
                return
    except _worker.Stopped:
        pass
    except BaseException as exc:  # forwarded with its traceback; re-raised in the consumer
        if not stop.is_set():  # (a stopped epoch's consumer is gone: dropping it frees the loader now)
            q.put(_worker.Failure.caught(exc))
    finally:
        deliveries.close()  # type: ignore[attr-defined]  # its finally closes the loader's iterator


def _deliveries(batches: Iterable[Any], copier: Copier, stop: threading.Event,
                consumer_stream: torch.cuda.Stream | None) -> Iterator[Delivered]:
    """Pull each batch from ``batches`` and deliver it (staged and copied, or read)."""
    it = None
    try:
        it = iter(batches)
        for index in itertools.count():
            _worker.check(stop)
            t0 = time.perf_counter()
            with _nvtx.range("gpufeed.fetch"):
                raw = next(it, _worker.END)
            t1 = time.perf_counter()
            copier.stats.add(fetch_s=t1 - t0)
            if copier.trace is not None:
                copier.trace.add("fetch", int(t0 * 1e9), int(t1 * 1e9), "gpufeed-fetch", batch=index)
            if raw is _worker.END:
                return
            yield copier.deliver(raw, index, stop, consumer_stream)
    finally:  # (the copies still in flight stay in the prefetcher's InFlight: the epoch does not wait)
        if isinstance(it, types.GeneratorType):
            it.close()  # runs its cleanup now (a source epoch returns the buffers of reads started ahead)
        del it  # a DataLoader iterator shuts its workers down here


def _thread_pays(gaps: list[float], fetches: list[float], gpu_busy: bool) -> bool:
    """Whether a background thread would make an epoch faster.

    Not while the GPU is the bottleneck (``gpu_busy``: the loop's queued work still ran when it asked
    for a batch): fetching on the loop's thread then costs the GPU nothing, where a thread would take
    the GIL from the loop's launches and from a DataLoader's pin thread. Otherwise the loop's thread
    waits for every fetch, so a thread pays when the loop leaves time between batches (``gaps``: its
    step, a sync included) and fetching a batch takes time (``fetches``: the loader, staging, issuing
    copies), and the smaller of the two, what a thread could hide, is more than the thread costs
    (:data:`THREAD_COST_S`). A loop that does nothing between batches leaves no time to hide.
    """
    return not gpu_busy and min(min(gaps), min(fetches)) > THREAD_COST_S


def _cpu_core_to_spare() -> bool:
    """Whether a CPU prefetcher reads ahead on a background thread: only where a core is left beside
    torch's intra-op threads (``torch.get_num_threads()``). Otherwise the loop's compute already runs on
    every core, and reads beside it slow that compute more than they hide. The cores are the CPUs this
    process may run on (its affinity, hyperthreads included; a container's CPU quota is not seen)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


def _stop_epoch(stop: threading.Event, deliveries: Iterator[Delivered], fetcher: dict[str, Any]) -> None:
    """End an epoch: stop its fetch thread if one took over (and drop the batches nobody will take, so
    their device memory goes back now), else close its deliveries (and with them the loader's iterator)."""
    stop.set()
    thread = fetcher.get("thread")
    if thread is None:
        try:
            deliveries.close()  # type: ignore[attr-defined]  # its finally closes the loader's iterator
        except ValueError as exc:  # the loop's thread is reading: it closes the epoch after, seeing ``stop``
            if "already executing" not in str(exc):
                raise
        return
    if thread is not threading.current_thread() and thread.ident is not None:  # (started)
        thread.join(_JOIN_S)
    q = fetcher["queue"]
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            break


def _worker_slots(asked: bool | None, source: Any, loader: WrappedLoader, cuda: bool,
                  pinned_budget: int | None, depth: int) -> WorkerSlots | None:
    """The slots a DataLoader's workers collate into, where ``worker_slots`` asks for them (see
    :class:`CudaPrefetcher`)."""
    if asked is None:
        wanted = cuda and pinned_budget != 0 and loader.source_loader is None
        return WorkerSlots(pin=True, depth=depth) if wanted else None
    if not asked:
        return None
    if not (has_workers(source) or loader.is_factory):
        what = "num_workers=0" if hasattr(source, "num_workers") else f"a {type(source).__name__}"
        raise ValueError(f"worker_slots=True: the workers of a DataLoader (num_workers > 0) collate into the "
                         f"slots, and {what} has none; leave worker_slots unset")
    if cuda and pinned_budget == 0:
        raise ValueError("worker_slots=True pins the workers' shared buffers, and pinned_budget=0 turns "
                         "pinning off: pass one of them")
    return WorkerSlots(pin=cuda, depth=depth)


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
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


#: Arguments that batch, shuffle, shard or read: they belong to the loader a prefetcher wraps.
_LOADER_ARGS = ("batch_size", "shuffle", "drop_last", "seed", "rank", "world_size", "pad", "num_threads")


def _unexpected_message(kwargs: dict[str, Any]) -> str:
    moved = [k for k in kwargs if k in _LOADER_ARGS]
    if not moved:
        return f"CudaPrefetcher() got an unexpected keyword argument {next(iter(kwargs))!r}"
    return (f"CudaPrefetcher() got {', '.join(moved)}: batching belongs to the loader it wraps: "
            f"CudaPrefetcher(SourceLoader(source, {moved[0]}=...)) for a BatchSource, or the DataLoader's "
            "own arguments (a DistributedSampler for rank and world_size)")


@atexit.register
def _close_all() -> None:
    for pf in list(_LIVE):
        try:
            pf.close()
        except Exception:
            pass
