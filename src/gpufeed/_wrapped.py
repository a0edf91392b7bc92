"""What a prefetcher wraps: a loader (any re-iterable, or a callable returning a fresh iterable)."""

from __future__ import annotations

import gc
import multiprocessing
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from gpufeed._copier import WithState
from gpufeed._resumable import why_not_resumable
from gpufeed._worker_slots import WorkerSlots


def _forward_set_epoch(loader: Any, epoch: int) -> None:
    seen: set[int] = set()
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        fn = getattr(obj, "set_epoch", None)
        if obj is not None and callable(fn) and id(obj) not in seen:
            seen.add(id(obj))
            fn(epoch)


class WrappedLoader:
    """The loader a prefetcher wraps: its epochs, ``len``, ``set_epoch`` and resumable state.

    A loader with ``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``, a
    :class:`~gpufeed.SourceLoader`) has its state taken right after it yields each batch; the state of
    the last batch handed to the consumer is what :meth:`state_dict` returns.
    """

    def __init__(self, loader: Any) -> None:
        from gpufeed.source_loader import SourceLoader
        from gpufeed.sources.base import BatchSource

        is_factory = callable(loader) and not isinstance(loader, Iterable)
        if isinstance(loader, BatchSource) and not isinstance(loader, Iterable):
            raise ValueError(
                f"CudaPrefetcher wraps something that yields batches; a {type(loader).__name__} is read in "
                "batches by a SourceLoader: CudaPrefetcher(SourceLoader(source, batch_size=N))")
        if not is_factory and not isinstance(loader, Iterable):
            raise ValueError(
                f"CudaPrefetcher needs an iterable (a DataLoader, a SourceLoader, a list) or a callable "
                f"returning one; got {type(loader).__name__}"
            )
        self.source = loader
        self.slots: WorkerSlots | None = None  # where a DataLoader's workers collate into (the prefetcher's)
        self._factory = loader if is_factory else None
        # An iterator (a generator) is used up by one epoch; its second epoch would be silently empty.
        self._one_shot = isinstance(loader, Iterator)
        self._iterated = False
        self.not_resumable = why_not_resumable(loader)  # None, or why its state cannot be taken
        self.stateful = self.not_resumable is None
        # A SourceLoader keeps the epochs: the prefetcher asks it for each iteration's, reads the epoch and
        # position it chose, and tells it when a batch of an epoch was handed out.
        self.source_loader: SourceLoader | None = loader if isinstance(loader, SourceLoader) else None

    @property
    def is_factory(self) -> bool:
        """Whether the prefetcher wraps a callable that returns a fresh loader each epoch."""
        return self._factory is not None

    def length(self) -> int:
        try:
            return len(self.source)
        except TypeError:
            raise TypeError(f"the wrapped {type(self.source).__name__} has no len()") from None

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch`` called on the prefetcher: the loader, its sampler and batch sampler follow."""
        _forward_set_epoch(self.source, epoch)

    def next_epoch(self, current: int, started: bool, chosen: bool) -> int:
        """The epoch of the next iteration. Like a DataLoader's, a plain loader's epoch advances only when
        the prefetcher's does (an iteration that handed out a batch, unless set_epoch chose); a SourceLoader
        keeps its own count, shared by every prefetcher that wraps it in turn."""
        if self.source_loader is not None:
            return self.source_loader.upcoming_epoch()
        return current + 1 if started and not chosen else current

    def epoch_started(self, epoch: int) -> None:
        """The first batch of ``epoch`` was handed out."""
        if self.source_loader is not None:
            self.source_loader.begin_epoch(epoch)

    def initial_state(self, epoch: int, start: int) -> Any:
        """The state before an iteration's first batch; None: the loader's own, asked when needed (a
        StatefulDataLoader asked now would start its workers before the iteration hands them its slots)."""
        if self.source_loader is not None:
            return self.source_loader.state_at(epoch, start)
        return None

    def state_dict(self, last: Any, epoch: int) -> dict[str, Any]:
        if not self.stateful:
            raise TypeError(f"cannot take the state of the wrapped loader: {self.not_resumable}")
        if last is None:
            last = self.source.state_dict()
        return {"gpufeed": STATE_VERSION, "mode": "loader", "epoch": epoch, "loader": last}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, batch)`` to resume at. A SourceLoader is left untouched (the position is the
        prefetcher's until it hands out a batch); any other loader loads the state now."""
        _check_state(state)
        if not self.stateful:
            self.state_dict(None, 0)  # raises the TypeError that says why
        if self.source_loader is not None:
            return self.source_loader.resume_point(state["loader"])
        self.source.load_state_dict(state["loader"])
        return int(state["epoch"]), 0

    def batches(self, epoch: int, start: int = 0, spare_core: bool = True) -> Iterable[Any]:
        if self._one_shot and self._iterated:
            warnings.warn(
                f"gpufeed: the wrapped {type(self.source).__name__} is an iterator, used up by the first "
                "epoch, so this epoch yields nothing; pass a re-iterable (a DataLoader, a list) or a "
                "zero-argument callable that returns a fresh iterable (CudaPrefetcher(lambda: gen()))",
                RuntimeWarning, stacklevel=4)
            self._one_shot = False  # said once
        self._iterated = True
        if self.source_loader is not None:
            return _source_batches(self.source_loader, epoch, start, spare_core)
        if self._factory is not None:
            return _Lazy(self._factory, self.slots)
        _collect_before_fork(self.source)
        if self.stateful:
            return _with_state(self.source, self.slots)
        return _slotted(self.source, self.slots)


def _collect_before_fork(loader: Any) -> None:
    """Collect this process's unreachable cycles if iterating ``loader`` forks workers now. The workers
    fork from this process as it is, cycles included; collected in a worker, a cycle's CUDA tensors that a
    stream used (``record_stream``) record an event as they are freed, and a CUDA call aborts a forked
    child."""
    if _forks_workers(loader):
        gc.collect()


def _forks_workers(loader: Any) -> bool:
    """Whether iterating ``loader`` forks worker processes now (a DataLoader whose workers start by fork,
    unless persistent ones run already)."""
    if not has_workers(loader):
        return False
    if loader.persistent_workers and getattr(loader, "_iterator", None) is not None:
        return False
    ctx = loader.multiprocessing_context
    if ctx is not None:
        return ctx.get_start_method() == "fork"
    # Not set yet: the platform's default, which asking for the start method would also fix.
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return method == "fork"


def has_workers(loader: Any) -> bool:
    """Whether ``loader`` is a DataLoader whose batches are collated in worker processes."""
    import torch.utils.data

    return isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers > 0


def _slotted(loader: Any, slots: WorkerSlots | None) -> Iterable[Any]:
    """``loader``, whose workers collate into ``slots`` when it is a DataLoader with workers."""
    if slots is None or not has_workers(loader):
        return loader
    return _slotted_batches(loader, slots)


def _slotted_batches(loader: Any, slots: WorkerSlots) -> Iterator[Any]:
    # The loader's collate_fn is ours only while its iterator starts (its workers take it then): the user's
    # loader is left as it was.
    collate = slots.begin(loader)
    original = loader.collate_fn
    if collate is not None:
        loader.collate_fn = collate
    try:
        it = iter(loader)
    except BaseException:
        if collate is not None:
            slots.end()
        raise
    finally:
        loader.collate_fn = original
    try:
        yield from it
    finally:
        del it  # a DataLoader iterator shuts its workers down now, before the slots are handed out again
        if collate is not None:
            slots.end()


class _Lazy:
    def __init__(self, factory: Any, slots: WorkerSlots | None) -> None:
        self.factory = factory
        self.slots = slots

    def __iter__(self) -> Iterator[Any]:
        loader = self.factory()
        _collect_before_fork(loader)
        return iter(_slotted(loader, self.slots))


def _source_batches(loader: Any, epoch: int, start: int, spare_core: bool) -> Iterator[WithState]:
    it = loader.batches(epoch, start, spare_core=spare_core)
    try:
        for request in it:
            yield WithState(request, loader.state_at(epoch, request.index + 1))
    finally:  # the epoch's reads end now, on the thread that reads the epoch
        it.close()


def _with_state(loader: Any, slots: WorkerSlots | None) -> Iterator[WithState]:
    it = iter(_slotted(loader, slots))
    try:
        for batch in it:
            yield WithState(batch, loader.state_dict())
    finally:  # the loader's iterator (a generator's cleanup) ends now, on the thread that pulls from it
        close = getattr(it, "close", None)
        if close is not None:
            close()


#: The version of the prefetcher's own state_dict (the wrapped loader's state sits inside it).
STATE_VERSION = 1


def _check_state(state: Any) -> None:
    if not isinstance(state, dict) or "gpufeed" not in state:
        raise ValueError(f"not a gpufeed state_dict: expected a dict from CudaPrefetcher.state_dict(), got "
                         f"{type(state).__name__}")
    if state["gpufeed"] != STATE_VERSION:
        raise ValueError(f"gpufeed state version {state['gpufeed']} is not supported "
                         f"(this gpufeed reads version {STATE_VERSION})")
    if state.get("mode") != "loader":
        raise ValueError(f"this state was saved by a gpufeed whose prefetcher read a BatchSource itself "
                         f"(mode {state.get('mode')!r}); save it again with a SourceLoader")
