"""The two things a prefetcher can wrap: an iterable (a loader) or a BatchSource."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpufeed._copier import WithState
from gpufeed._source_batch import _Chain


def make_mode(source: Any, pf: Any, **kw: Any) -> Any:
    from gpufeed.sources.base import BatchSource

    num_threads = kw.pop("num_threads")
    if isinstance(source, BatchSource) and not isinstance(source, Iterable):
        return SourceMode(source, pf, **kw)
    given = {k: v for k, v in {**kw, "num_threads": num_threads}.items() if v != _SOURCE_DEFAULTS[k]}
    if given:
        args = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ValueError(
            f"CudaPrefetcher({args}): these batch, shuffle, shard or read a BatchSource, but "
            f"{type(source).__name__} is an iterable that batches itself: set them on your DataLoader "
            "(its batch_size, shuffle, drop_last, and a DistributedSampler for rank and world_size)"
        )
    return IterableMode(source)


#: The source-mode arguments of CudaPrefetcher and their defaults: with a loader, any other value raises.
_SOURCE_DEFAULTS: dict[str, Any] = {"batch_size": None, "shuffle": False, "drop_last": False, "seed": 0,
                                    "rank": None, "world_size": None, "pad": False, "num_threads": None}


def _forward_set_epoch(loader: Any, epoch: int) -> None:
    seen: set[int] = set()
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        fn = getattr(obj, "set_epoch", None)
        if obj is not None and callable(fn) and id(obj) not in seen:
            seen.add(id(obj))
            fn(epoch)


class IterableMode:
    """Wraps a loader: any re-iterable, or a zero-argument callable that returns a fresh iterable."""

    def __init__(self, loader: Any) -> None:
        is_factory = callable(loader) and not isinstance(loader, Iterable)
        if not is_factory and not isinstance(loader, Iterable):
            raise ValueError(
                f"CudaPrefetcher needs an iterable (a DataLoader, a list), a callable returning one, "
                f"or a BatchSource; got {type(loader).__name__}"
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
        if not implicit:  # like a DataLoader: a sampler's epoch changes only when set_epoch is called
            _forward_set_epoch(self.source, epoch)

    def initial_state(self, epoch: int, start: int) -> Any:
        return self.source.state_dict() if self.stateful else None

    def state_dict(self, last: Any, epoch: int) -> dict[str, Any]:
        if not self.stateful:
            raise TypeError(
                f"cannot take the state of a {type(self.source).__name__}: it has no state_dict(). "
                "Wrap a torchdata StatefulDataLoader (pip install 'gpufeed[resume]') or use a BatchSource"
            )
        if last is None:
            last = self.source.state_dict()
        return {"gpufeed": STATE_VERSION, "mode": "loader", "epoch": epoch, "loader": last}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        _check_state(state, "loader")
        if not self.stateful:
            self.state_dict(None, 0)  # raises the TypeError that says why
        self.source.load_state_dict(state["loader"])
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
    for batch in loader:
        yield WithState(batch, loader.state_dict())


class SourceMode:
    """Wraps a BatchSource: gpufeed samples, batches, shards and reads it into its own buffers."""

    def __init__(self, source: Any, pf: Any, *, batch_size: int | None, shuffle: bool | str, drop_last: bool,
                 seed: int, rank: int | None, world_size: int | None, pad: bool) -> None:
        if batch_size is None or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"a BatchSource needs batch_size=N (an int >= 1), got {batch_size!r}")
        if shuffle not in (False, True, "blocks"):
            raise ValueError(f"shuffle must be False, True or 'blocks', got {shuffle!r}")
        if rank is None and world_size is None and _dist_ready():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        rank, world_size = rank or 0, world_size or 1
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.source = source
        self.config = dict(batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, seed=int(seed),
                           rank=rank, world_size=world_size, pad=pad)
        self.stateful = True
        self._epoch = 0

    def _plan(self, epoch: int) -> list[Any]:
        from gpufeed.sources.sampling import plan_batches

        c = self.config
        return plan_batches(len(self.source), c["batch_size"], shuffle=c["shuffle"], drop_last=c["drop_last"],
                            seed=c["seed"], epoch=epoch, rank=c["rank"], world_size=c["world_size"],
                            pad=c["pad"])

    def length(self) -> int:
        return len(self._plan(self._epoch))

    def set_epoch(self, epoch: int, implicit: bool = False) -> None:
        self._epoch = epoch

    def initial_state(self, epoch: int, start: int) -> dict[str, int]:
        return {"epoch": epoch, "batch": start}

    def state_dict(self, last: Any, epoch: int) -> dict[str, Any]:
        pos = last or {"epoch": epoch, "batch": 0}
        return {"gpufeed": STATE_VERSION, "mode": "source", **pos, "num_samples": len(self.source),
                "config": dict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        _check_state(state, "source")
        mine = {**self.config, "num_samples": len(self.source)}
        theirs = {**state.get("config", {}), "num_samples": state.get("num_samples")}
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"this state was saved with another configuration ({what}); "
                             "resume with the same source, batch_size, shuffle, seed, drop_last and ranks")
        epoch, start = int(state["epoch"]), int(state["batch"])
        if start >= len(self._plan(epoch)):  # the epoch was complete: resume at the next one
            epoch, start = epoch + 1, 0
        return epoch, start

    def batches(self, epoch: int, start: int = 0) -> Iterator[WithState]:
        chain = _Chain(self.source, self._plan(epoch))
        try:
            for i in range(start, len(chain.plan)):
                yield WithState(chain.get(i), {"epoch": epoch, "batch": i + 1})
        finally:  # stopped, failed or done: reads already started for a batch never delivered end here
            chain.cancel()

    def close(self) -> None:
        # The source belongs to the user: another prefetcher may be reading it (train and eval over one
        # source), so closing it here would pull its files from under those reads. Sources close their
        # files when they are closed or collected.
        pass


STATE_VERSION = 1
def _check_state(state: Any, mode: str) -> None:
    if not isinstance(state, dict) or "gpufeed" not in state:
        raise ValueError(f"not a gpufeed state_dict: expected a dict from CudaPrefetcher.state_dict(), got "
                         f"{type(state).__name__}")
    if state["gpufeed"] != STATE_VERSION:
        raise ValueError(f"gpufeed state version {state['gpufeed']} is not supported "
                         f"(this gpufeed reads version {STATE_VERSION})")
    if state.get("mode") != mode:
        raise ValueError(f"this state was saved from a prefetcher over a {state.get('mode')}, "
                         f"but this one wraps a {mode}; resume with the same kind of input")


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
