"""CudaPrefetcher: wrap any loader so that every batch arrives already on the GPU."""

from __future__ import annotations

import atexit
import collections
import difflib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

from gpufeed import _nvtx
from gpufeed._device import DeviceBatch, DeviceStage, resolve_device
from gpufeed._static import StaticBuffers
from gpufeed._threads import Failure
from gpufeed._tracing import TraceRecorder
from gpufeed.host_memory.worker_arena import WorkerArena
from gpufeed.loaders.dataloader import LoaderAdapter, has_workers, no_workers_message
from gpufeed.loaders.source_loader import SourceLoader
from gpufeed.stats import PrefetchStats

_LIVE: weakref.WeakSet[CudaPrefetcher] = weakref.WeakSet()


class CudaPrefetcher:
    """Yield the batches of ``loader`` with every tensor already on ``device``.

    One line in a training loop::

        for batch in CudaPrefetcher(loader):           # any DataLoader, list or iterable
            loss = model(batch["x"]).loss(batch["y"])   # batch["x"] is already on the GPU

    Wraps any iterable (a DataLoader, a list, a callable that returns a fresh iterable each epoch), or a
    :class:`~gpufeed.SourceLoader`, which reads a :class:`~gpufeed.BatchSource` straight into pinned buffers.
    ``depth`` batches are kept copied ahead of the loop: each ``next()`` takes one batch from the loader,
    issues its copies on a dedicated copy stream (pinning what is not pinned; a small batch, whose copy costs
    less than that stream's calls, on the loop's stream as pinning, then ``.to(non_blocking=True)``, would),
    and hands over the batch copied ``depth`` calls earlier, whose copy overlapped the loop's steps meanwhile.
    Everything slow runs where it runs without gpufeed: a DataLoader's workers collate (into pinned shared
    memory, ``worker_slots``), a SourceLoader's threads read; the loop's thread only issues copies. Re-iterate
    it for each epoch; ``len``, ``set_epoch`` and ``state_dict`` behave as a DataLoader's. ``pf.stats`` (a
    :class:`~gpufeed.PrefetchStats`) says whether the GPU waited for data, and what to do. Without CUDA (or
    with ``device="cpu"``) the same class runs on the CPU, without streams.

    Example:
        >>> loader = [{"x": torch.arange(4)}, {"x": torch.arange(4, 8)}]
        >>> with CudaPrefetcher(loader, device="cpu") as pf:
        ...     [b["x"].sum().item() for b in pf]
        [6, 22]

    Args:
        loader: any iterable, a zero-argument callable returning one, or a SourceLoader.
        device: target device; ``None`` means the current CUDA device when CUDA is available, else CPU.
        depth: batches taken from the loader ahead of the one the loop holds (>= 1; 1 is double
            buffering); on CUDA their copies are in flight meanwhile.
        transform: optional function applied to each batch on the device, on the copy stream (ship
            ``uint8`` and convert on the GPU: a quarter of the bytes of ``float32``).
        static: deliver every batch into the same device tensors, for a captured CUDA graph; each item
            is then a :class:`~gpufeed.StaticBatch` ``(batch, valid)``, a short last batch zero-padded.
        trace: record every batch's stages for :meth:`export_trace` (default: env ``GPUFEED_TRACE=1``).
        worker_slots: a DataLoader's workers collate each batch into shared memory that the prefetcher
            pinned once, so the main process copies none of its bytes. ``None`` (default): on for a
            DataLoader with workers (or a callable returning one) on CUDA; ``True`` also on the CPU, where
            the batch is copied out of its slot (ValueError for a loader without workers; a callable's
            loader is checked each epoch, at ``iter()``); ``False``: batches cross as the DataLoader sends
            them.
        measure: time how long the GPU waited for its batches, for ``stats``' verdict (default ``True``):
            CUDA events on the loop's stream for each of the first 64 batches, then for two batches in
            about 64 (about 1 us a batch), read batches later. ``False``: no events, and no verdict (the
            counters still count). On the CPU the verdict reads the loop thread's own waits, which cost
            nothing; ``False`` only drops the verdict there. Not ``trace``: that records every stage for a
            trace file, off by default, while the verdict is what ``stats.summary()`` is for.

    Invariants: batches reach the loop in the loader's order, each once, an error in its batch's place;
    at most ``depth`` batches are taken from the loader ahead of the one the loop holds; the stream and
    memory invariants are :class:`~gpufeed._device.DeviceStage`'s.
    """

    def __init__(self, loader: Any, device: torch.device | str | int | None = None, depth: int = 2,
                 transform: Callable[[Any], Any] | None = None, *, static: bool = False,
                 trace: bool | None = None, worker_slots: bool | None = None, measure: bool = True,
                 **unexpected: Any) -> None:
        if unexpected:
            raise TypeError(_unexpected_message(unexpected))
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (batches prefetched ahead), got {depth!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {type(transform).__name__}")
        for name, value, unset in (("static", static, False), ("measure", measure, False),
                                   ("trace", trace, True), ("worker_slots", worker_slots, True)):
            if not (isinstance(value, bool) or (unset and value is None)):
                allowed = "True, False or None" if unset else "True or False"
                raise ValueError(f"{name} must be {allowed}, got {value!r}")
        self.device = resolve_device(device)
        self.depth = depth
        self.transform = transform
        self.stats = PrefetchStats(device=self.device.type, measure=measure, depth=depth, **_describe(loader))
        self._closed = False
        self._current: weakref.ref[_Epoch] | None = None
        self._state: Any = None  # the loader's state after the last batch handed to the consumer
        self._lock = threading.Lock()
        self._loader = _as_loader(loader)
        self._arena = _worker_arena(worker_slots, loader, self._loader, self.device.type == "cuda", depth,
                                    self.stats)
        if trace is None:
            trace = os.environ.get("GPUFEED_TRACE", "0") not in ("", "0", "false", "no")
        self._trace = TraceRecorder() if trace else None
        self._stage = DeviceStage(self.device, transform, self.stats, measure)
        self._static = StaticBuffers() if static else None
        _LIVE.add(self)

    # -- drop-in surface ---------------------------------------------------------------------------

    @property
    def source(self) -> Any:
        """The loader this prefetcher wraps."""
        return self._loader.source if isinstance(self._loader, LoaderAdapter) else self._loader

    @property
    def epoch(self) -> int:
        """The epoch of the current iteration (or the one resumed in, or the next)."""
        return self._loader.iteration_epoch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        # dataset, sampler, batch_size, collate_fn ... read through to the wrapped loader, when it has them.
        loader = self.__dict__.get("_loader")
        source = loader.source if isinstance(loader, LoaderAdapter) else loader
        if not name.startswith("_") and source is not None and hasattr(source, name):
            return getattr(source, name)
        wrapped = f" nor has the wrapped {type(source).__name__}" if source is not None else ""
        raise AttributeError(f"'CudaPrefetcher' object has no attribute {name!r}{wrapped}")

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration, forwarded to the loader, its sampler and batch sampler."""
        self._loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        with self._lock:  # (close() takes it too: no epoch starts on a prefetcher being closed)
            if self._closed:
                raise RuntimeError("this CudaPrefetcher is closed; create a new one to iterate again")
            previous = self._current() if self._current is not None else None
            if previous is not None:
                previous.close("a new iteration of the same CudaPrefetcher started")
            batches = self._loader.host_batches(self.device, self._arena)
            self._state = self._loader.initial_state()
            it = _Epoch(self, batches)
            self._current = weakref.ref(it)
        return it

    def export_trace(self, path: str | os.PathLike[str]) -> str:
        """Write a Chrome/Perfetto trace of every batch's stages and the consumer's waits.

        Open it in https://ui.perfetto.dev or chrome://tracing. Needs ``trace=True`` (or ``GPUFEED_TRACE=1``).
        """
        if self._trace is None:
            raise RuntimeError("tracing is off: create the prefetcher with trace=True "
                               "(or set GPUFEED_TRACE=1)")
        return self._trace.write(path)

    # -- resumption --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the consumer has received so far (not what is in flight), to resume exactly there.

        The wrapped loader must be able to give its state (a :class:`~gpufeed.SourceLoader`, torchdata's
        ``StatefulDataLoader``): this is the loader's state taken right after it produced the last batch
        handed out.
        """
        return self._loader.prefetcher_state(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration yields exactly the batches not yet received."""
        self._loader.load_prefetcher_state(state)
        self._state = None

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the epoch, free pinned and device buffers; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            it = self._current() if self._current is not None else None
        if it is not None:
            it.close("the CudaPrefetcher was closed")
        try:
            self._stage.close()
        except Exception:  # a broken CUDA context: nothing left to wait for
            pass
        if self._arena is not None:
            self._arena.close()
        self._loader.free_memory()

    def __enter__(self) -> CudaPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Epoch:
    """One iteration: each ``next()`` takes a host batch from the loader, issues its copies, and hands over
    the batch taken ``depth`` calls before.

    The iteration's steps are one generator (:func:`_handed`), which keeps what every batch uses in its
    locals; this object is the iterator the loop holds, the lock that serializes ``next()`` calls, and the
    ``close()`` any thread may call. A ``close()`` that finds a thread in ``next()`` leaves the epoch's end
    to that thread, which ends it as it leaves ``next()``; a thread waiting for the lock then learns why.
    A batch that cannot be handed over raises in its place, and the generator goes on.

    Invariants: ``ahead`` holds at most ``depth + 1`` items (device batches, then a Failure last), in the
    loader's order; an item is handed over once. The epoch's host batches come from a generator that owns
    the loader's iterator: the epoch's end (the loader's end or error, ``close()``, or this object
    collected: ``break``, ``del``) closes it, ending the loader's iteration, its worker processes and
    reader threads, on the thread that reads, or at ``close()`` when no thread reads. On the CPU, ``kept``
    holds the two batches handed over last: the batch the loop let go of is freed inside ``next()`` (the
    hand-over drops it), so the cost of freeing it (a DataLoader worker's shared memory: about 130 us a
    MiB) counts as the input's, not as the loop's step.
    """

    def __init__(self, pf: CudaPrefetcher, batches: Iterator[Any]) -> None:
        self._ahead: collections.deque[Any] = collections.deque()
        self._kept: collections.deque[Any] = collections.deque(maxlen=2)
        self._busy = threading.Lock()  # held while a thread is in next()
        self._stop = _Stop()
        self._finalizer = weakref.finalize(self, _end_epoch, batches, self._ahead, pf._stage)
        # (the generator holds no reference to this object: collecting it ends the epoch at once)
        self._step = _handed(pf, batches, self._ahead, self._kept, self._stop, self._finalizer).__next__
        pf._stage.new_epoch()

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        if self._stop.done:
            self._stop.raise_()
        try:
            with self._busy:
                if self._stop.done:  # (stopped while this thread waited for the one in next())
                    self._stop.raise_()
                out = self._step()
        finally:  # a close() from another thread while this one was in next() could not end the epoch:
            if self._stop.done and self._busy.acquire(blocking=False):  # the thread that holds it does
                try:
                    self._finalizer()
                finally:
                    self._busy.release()
        if type(out) is Failure:  # (handing the batch over failed: the generator goes on)
            out.reraise()
        return out

    def close(self, reason: str = "closed") -> None:
        """End this epoch now: the loader's iterator closes, and the batches taken ahead are dropped."""
        self._stop.stop(reason, self._kept)
        if self._busy.acquire(blocking=False):  # (else a thread is in next(): it ends the epoch)
            try:
                self._finalizer()
            finally:
                self._busy.release()


class _Stop:
    """Whether an epoch was stopped, and why: set by ``close()`` on any thread, read in ``next()``."""

    def __init__(self) -> None:
        self.done = False
        self.reason = ""  # empty: the epoch ended (its next() raises StopIteration)

    def stop(self, reason: str, kept: collections.deque[Any]) -> None:
        self.reason = reason  # (first: a next() that finds the epoch done reads why)
        self.done = True
        kept.clear()

    def raise_(self) -> NoReturn:
        if self.reason:
            raise RuntimeError(f"this gpufeed iterator was stopped: {self.reason}")
        raise StopIteration


def _handed(pf: CudaPrefetcher, batches: Iterator[Any], ahead: collections.deque[Any],
            kept: collections.deque[Any], stop: _Stop, end: Callable[[], Any]) -> Iterator[Any]:
    """An epoch's batches, each handed over on the loop's stream: every step takes batches from the
    loader and issues their copies until ``depth`` are ahead of the next one (``ahead``), then hands that
    one over. The loader's end, or its error in its batch's place, ends the epoch (``end``); so does any
    other error, but one handing a batch over, which arrives in that batch's place."""
    stage, stats, loader, trace = pf._stage, pf.stats, pf._loader, pf._trace
    fetch = _nvtx.ranged("gpufeed.fetch")(batches.__next__)
    depth, static, copy, perf = pf.depth, pf._static, stage.copy, time.perf_counter
    last: float | None = None  # when the loop got its previous batch (None: an epoch's first is its start-up)
    taken = 0  # batches taken from the loader
    ended = False  # the loader is exhausted (or failed): nothing more to take
    while True:
        try:
            mark = stats.mark()
            if last is not None:
                stage.asked(mark)
            while not ended and len(ahead) <= depth and not stop.done:
                t0 = perf()
                try:
                    try:
                        hb = fetch()
                    finally:
                        t1 = perf()
                        stats.fetch_s += t1 - t0
                        if trace is not None:
                            trace.add("fetch", int(t0 * 1e9), int(t1 * 1e9), "gpufeed", batch=taken)
                    ahead.append(copy(hb))  # (after the copy: a close() meanwhile finds it in the deque)
                    if trace is not None:
                        trace.add("copy", int(t1 * 1e9), time.perf_counter_ns(), "gpufeed", batch=taken)
                    taken += 1
                except StopIteration:
                    ended = True
                except Exception as exc:  # (the loader's or the transform's) after the batches before it
                    ahead.append(Failure.caught(exc))
                    ended = True
            hb = None
            item = ahead.popleft() if ahead else None
            if stop.done:  # closed from another thread while this one read: this thread ends the iteration
                if item is not None:
                    ahead.appendleft(item)
                end()
                stop.raise_()
            if type(item) is not DeviceBatch:  # the loader's end (None) or its error, every batch before
                try:  # handed; the state after the end (a resumed run starts anew)
                    if item is None and last is not None:
                        state = loader.end_state()
                        if state is not None:
                            pf._state = state
                    _account(stats, trace, mark, last, False)
                finally:
                    stop.stop("", kept)
                    end()
                if item is not None:
                    item.reraise()
                return
            try:
                batch = stage.hand_over(item)
                if static is not None:
                    batch = static.fill(batch)
            except Exception as exc:  # this batch cannot be handed over (``static``'s fill): its error in
                stage.drop(collections.deque([item]))  # its place, and the epoch goes on (as a loader's
                if isinstance(exc, StopIteration):  # next() that raised would let it); PEP 479
                    cause, exc = exc, RuntimeError("handing a batch over raised StopIteration")
                    exc.__cause__ = cause
                batch, item = Failure.caught(exc), None
                last = _account(stats, trace, mark, last, False)
            else:
                if last is None:  # an epoch counts once it hands out a batch (not a probing iter())
                    loader.epoch_started()
                if not stage.cuda:
                    kept.append(batch)
                pf._state = item.state
                item = None
                last = _account(stats, trace, mark, last, not stage.cuda)
                stats.batches += 1
        except BaseException:  # anything else (Ctrl-C) ends the epoch now
            if not stop.done:
                stop.stop("", kept)
                end()
            raise
        handed = [batch]  # (yielded from a list: the suspended frame keeps no reference to the batch)
        batch = None
        yield handed.pop()


def _account(stats: PrefetchStats, trace: TraceRecorder | None, mark: tuple[float, float, float],
             last: float | None, judged: bool) -> float:
    """The loop's wait since ``mark`` (``PrefetchStats.served``); on the CPU the verdict judges the calls
    that handed a batch over (``judged``; not the one that finds the end: no step follows it)."""
    now = stats.served(mark, last, judged)
    if trace is not None:
        trace.add("wait", int(mark[0] * 1e9), int(now * 1e9), "consumer", batch=stats.batches)
    return now


def _end_epoch(batches: Iterator[Any], ahead: collections.deque[Any], stage: DeviceStage) -> None:
    """End an epoch (``close()``, or ``break``/``del``/GC of its iterator): drop the batches taken ahead,
    their memory fenced behind their copies (``DeviceStage.drop``), and close the loader's iteration."""
    stage.end_epoch()
    stage.drop(ahead)
    close = getattr(batches, "close", None)
    if close is not None:
        try:
            close()
        except ValueError:  # "generator already executing": another thread is in it, and ends it after
            pass


def _as_loader(loader: Any) -> Any:
    from gpufeed.sources.base import BatchSource

    if isinstance(loader, SourceLoader):
        return loader
    if isinstance(loader, BatchSource) and not isinstance(loader, collections.abc.Iterable):
        raise ValueError(f"CudaPrefetcher wraps something that yields batches; a {type(loader).__name__} is "
                         "read in batches by a SourceLoader: "
                         "CudaPrefetcher(SourceLoader(source, batch_size=N))")
    return LoaderAdapter(loader)


def _worker_arena(asked: bool | None, loader: Any, adapter: Any, cuda: bool, depth: int,
                  stats: PrefetchStats) -> WorkerArena | None:
    """The shared memory a DataLoader's workers collate into, where ``worker_slots`` asks for it."""
    if not isinstance(adapter, LoaderAdapter):
        if asked:
            raise ValueError("worker_slots=True: a SourceLoader reads into pinned buffers of its own, and "
                             "has "
                             "no DataLoader workers; leave worker_slots unset")
        return None
    if asked is None:
        return WorkerArena(pin=True, depth=depth, stats=stats) if cuda else None
    if not asked:
        return None
    if not (has_workers(loader) or adapter.is_factory):
        raise ValueError(no_workers_message(loader))
    return WorkerArena(pin=cuda, depth=depth, stats=stats, required=True)  # (a factory's loaders: each epoch)


def _describe(loader: Any) -> dict[str, Any]:
    """What the verdict's next step names: the loader's kind, and its workers."""
    if isinstance(loader, SourceLoader):
        return {"loader": "SourceLoader"}
    if isinstance(getattr(loader, "num_workers", None), int):
        return {"loader": "DataLoader", "num_workers": loader.num_workers}
    if callable(loader) and not isinstance(loader, collections.abc.Iterable):
        return {"loader": "factory"}  # (called each epoch: what it returns is not known yet)
    return {"loader": type(loader).__name__}


#: Arguments that batch, shuffle, shard or read: they belong to the loader a prefetcher wraps.
_LOADER_ARGS = ("batch_size", "shuffle", "drop_last", "seed", "rank", "world_size", "pad", "num_threads",
                "pinned_budget")
_ARGS = ("device", "depth", "transform", "static", "trace", "worker_slots", "measure")


def _unexpected_message(kwargs: dict[str, Any]) -> str:
    moved = [k for k in kwargs if k in _LOADER_ARGS]
    if "chunk_bytes" in kwargs:
        return ("CudaPrefetcher() no longer takes chunk_bytes: pageable tensors are staged in chunks of a "
                "fixed "
                "32 MiB, and a SourceLoader reads whole batches; remove the argument")
    if not moved:
        name = next(iter(kwargs))
        close = difflib.get_close_matches(name, _ARGS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (it takes {', '.join(_ARGS)})"
        return f"CudaPrefetcher() got an unexpected keyword argument {name!r}{hint}"
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
