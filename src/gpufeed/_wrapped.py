"""What a prefetcher wraps: a loader (any re-iterable, or a callable returning a fresh iterable)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from gpufeed._copier import WithState


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
        self._factory = loader if is_factory else None
        # An iterator (a generator) is used up by one epoch; its second epoch would be silently empty.
        self._one_shot = isinstance(loader, Iterator)
        self._iterated = False
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None))

    def length(self) -> int:
        try:
            return len(self.source)
        except TypeError:
            raise TypeError(f"the wrapped {type(self.source).__name__} has no len()") from None

    def set_epoch(self, epoch: int, implicit: bool = False) -> None:
        """``implicit``: the prefetcher starts an iteration of ``epoch``. Like a DataLoader, a sampler's
        epoch changes only when set_epoch is called; a SourceLoader follows the prefetcher's epochs, which
        count an iteration only once it handed out a batch (an ``iter()`` that probes does not)."""
        from gpufeed.source_loader import SourceLoader

        if not implicit:
            _forward_set_epoch(self.source, epoch)
        elif isinstance(self.source, SourceLoader):
            self.source.set_epoch(epoch)

    def initial_state(self, epoch: int, start: int) -> Any:
        return self.source.state_dict() if self.stateful else None

    def state_dict(self, last: Any, epoch: int) -> dict[str, Any]:
        if not self.stateful:
            raise TypeError(
                f"cannot take the state of a {type(self.source).__name__}: it has no state_dict(). "
                "Wrap a torchdata StatefulDataLoader (pip install 'gpufeed[resume]') or a SourceLoader"
            )
        if last is None:
            last = self.source.state_dict()
        return {"gpufeed": STATE_VERSION, "mode": "loader", "epoch": epoch, "loader": last}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        _check_state(state, "loader")
        if not self.stateful:
            self.state_dict(None, 0)  # raises the TypeError that says why
        from gpufeed.source_loader import SourceLoader

        self.source.load_state_dict(state["loader"])
        if isinstance(self.source, SourceLoader):  # it resumes at its next epoch when the saved one was done
            return self.source.epoch, 0
        return int(state["epoch"]), 0

    def batches(self, epoch: int, start: int = 0) -> Iterable[Any]:
        if self._one_shot and self._iterated:
            warnings.warn(
                f"gpufeed: the wrapped {type(self.source).__name__} is an iterator, used up by the first "
                "epoch, so this epoch yields nothing; pass a re-iterable (a DataLoader, a list) or a "
                "zero-argument callable that returns a fresh iterable (CudaPrefetcher(lambda: gen()))",
                RuntimeWarning, stacklevel=4)
            self._one_shot = False  # said once
        self._iterated = True
        if self._factory is not None:
            return _Lazy(self._factory)
        if self.stateful:
            return _with_state(self.source)
        return self.source

    def close(self) -> None:
        pass


class _Lazy:
    def __init__(self, factory: Any) -> None:
        self.factory = factory

    def __iter__(self) -> Iterator[Any]:
        return iter(self.factory())


def _with_state(loader: Any) -> Iterator[WithState]:
    it = iter(loader)
    try:
        for batch in it:
            yield WithState(batch, loader.state_dict())
    finally:  # a SourceLoader's epoch ends its reads now, on this (the fetch) thread
        close = getattr(it, "close", None)
        if close is not None:
            close()


STATE_VERSION = 1
def _check_state(state: Any, mode: str) -> None:
    if not isinstance(state, dict) or "gpufeed" not in state:
        raise ValueError(f"not a gpufeed state_dict: expected a dict from CudaPrefetcher.state_dict(), got "
                         f"{type(state).__name__}")
    if state["gpufeed"] != STATE_VERSION:
        raise ValueError(f"gpufeed state version {state['gpufeed']} is not supported "
                         f"(this gpufeed reads version {STATE_VERSION})")
    if state.get("mode") != mode:
        raise ValueError(f"this state was saved by a gpufeed whose prefetcher read a BatchSource itself "
                         f"(mode {state.get('mode')!r}); save it again with a SourceLoader")
