"""The loader a prefetcher wraps, as a source of host batches: its epochs, ``len``, ``set_epoch``, state.

Wraps any re-iterable (a DataLoader, a list, the loaders accelerate, Lightning or torchdata hand out) or a
zero-argument callable that returns a fresh iterable each epoch. A DataLoader with workers has them
collate into the prefetcher's worker arena (pinned shared memory), where one is given.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from gpufeed import _forks
from gpufeed._resumable import take_state, why_not_resumable
from gpufeed.host_memory import HostBatch
from gpufeed.host_memory.worker_arena import SlotBatch, WorkerArena
from gpufeed.loaders._epochs import Epochs

#: The version of the prefetcher's own state_dict (the wrapped loader's state sits inside it).
STATE_VERSION = 1

def has_workers(loader: Any) -> bool:
    """Whether ``loader`` is a DataLoader whose batches are collated in worker processes."""
    import torch.utils.data

    return isinstance(loader, torch.utils.data.DataLoader) and loader.num_workers > 0


def no_workers_message(loader: Any, from_factory: bool = False) -> str:
    """Why ``worker_slots=True`` cannot apply to ``loader`` (``from_factory``: a factory returned it)."""
    if from_factory:
        kind = "DataLoader" if hasattr(loader, "num_workers") else type(loader).__name__
        what = f"the {kind} the factory returned"
    else:
        what = "num_workers=0" if hasattr(loader, "num_workers") else f"a {type(loader).__name__}"
    return (f"worker_slots=True: the workers of a DataLoader (num_workers > 0) collate into the slots, and "
            f"{what} has none; leave worker_slots unset")


def forward_set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on the loader, its sampler and its batch sampler, each once."""
    seen: set[int] = set()
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None)
    for obj in (loader, sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        fn = getattr(obj, "set_epoch", None)
        if obj is not None and callable(fn) and id(obj) not in seen:
            seen.add(id(obj))
            fn(epoch)


class LoaderAdapter(Epochs):
    """A wrapped loader's epochs as host batches, with the loader's state after each where it has one.

    Owns the epoch of the loader it wraps: an iteration that hands out a batch is an epoch, and the next
    iteration a new one unless :meth:`set_epoch` chose (as with a DataLoader's ``set_epoch``); an ``iter()``
    that hands out nothing (Lightning's probe) does not count. A loader that can really give its state
    (:func:`~gpufeed._resumable.why_not_resumable`) has it taken right after each batch.
    """

    def __init__(self, loader: Any) -> None:
        is_factory = callable(loader) and not isinstance(loader, Iterable)
        if not is_factory and not isinstance(loader, Iterable):
            raise ValueError(f"CudaPrefetcher needs an iterable (a DataLoader, a SourceLoader, a list) or a "
                             f"callable returning one; got {type(loader).__name__}")
        self.source = loader
        self._factory = loader if is_factory else None
        self._one_shot = isinstance(loader, Iterator)  # a generator: used up by one epoch
        self._iterated = False
        self.not_resumable = why_not_resumable(loader)
        super().__init__()
        self._iterating = 0  # the epoch of the iteration under way (or the next, or the one resumed in)
        self._resume: int | None = None  # the epoch to resume in, after load_state_dict
        self._end_state: Any = None  # the loader's state after its last iteration ended

    @property
    def is_factory(self) -> bool:
        return self._factory is not None

    def __len__(self) -> int:
        try:
            return len(self.source)
        except TypeError:
            raise TypeError(f"the wrapped {type(self.source).__name__} has no len()") from None

    @property
    def iteration_epoch(self) -> int:
        """The epoch of the current (or next) iteration."""
        return self._iterating

    def free_memory(self) -> None:
        """Nothing to free: the arena is the prefetcher's."""

    def set_epoch(self, epoch: int) -> None:
        """The next iteration's epoch; forwarded to the loader, its sampler and batch sampler."""
        super().set_epoch(epoch)
        self._iterating = self.epoch
        forward_set_epoch(self.source, self.epoch)

    def epoch_started(self) -> None:
        """The current iteration handed out its first batch."""
        self.begin_epoch(self._iterating)
        self._resume = None

    def initial_state(self) -> Any:
        """The state before an iteration's first batch: None, the loader's own, taken when asked (asked
        now, a StatefulDataLoader would start its workers before the iteration hands them the arena)."""
        return None

    def prefetcher_state(self, last: Any) -> dict[str, Any]:
        """The prefetcher's state: the epoch, and ``last``, the loader's state after the last batch handed
        out (None: before the first)."""
        if self.not_resumable is not None:
            raise TypeError(f"cannot take the state of this loader: {self.not_resumable}")
        if last is None:
            last = self.source.state_dict()
        done = last is self._end_state  # (the epoch ended: a resumed run starts the next one)
        return {"gpufeed": STATE_VERSION, "mode": "loader", "epoch": self._iterating + done, "loader": last}

    def load_prefetcher_state(self, state: dict[str, Any]) -> None:
        """Load the loader's state now; the next iteration resumes in the saved epoch."""
        check_state(state)
        if self.not_resumable is not None:
            raise TypeError(f"cannot resume this loader: {self.not_resumable}")
        self.source.load_state_dict(state["loader"])
        self._iterating = self._resume = int(state["epoch"])
        self.restart_at(self._resume)

    def host_batches(self, device: Any = None, arena: WorkerArena | None = None) -> Iterator[HostBatch]:
        """The next iteration's host batches (a new epoch, unless this one handed out nothing yet)."""
        self._iterating = self._resume if self._resume is not None else self.upcoming_epoch()
        if self._one_shot and self._iterated:
            warnings.warn(
                f"gpufeed: the wrapped {type(self.source).__name__} is an iterator, used up by the first "
                "epoch, so this epoch yields nothing; pass a re-iterable (a DataLoader, a list) or a "
                "zero-argument callable that returns a fresh iterable (CudaPrefetcher(lambda: gen()))",
                RuntimeWarning, stacklevel=4)
            self._one_shot = False  # said once
        self._iterated = True
        loader = self._factory() if self._factory is not None else self.source
        if arena is not None and arena.required and not has_workers(_workers_of(loader)):
            raise ValueError(no_workers_message(loader, from_factory=self._factory is not None))
        self._end_state = None
        if self._factory is not None or self.not_resumable is not None:  # (no state to take: one generator)
            return _batches(loader, arena)
        return self._with_state(loader, arena)

    def _with_state(self, loader: Any, arena: WorkerArena | None) -> Iterator[HostBatch]:
        """The batches of one iteration of ``loader`` (:func:`_batches`), each with the loader's state
        after it (where that can be taken: the first refusal says why not)."""
        stateful = True
        batches = _batches(loader, arena)
        try:
            for batch in batches:
                state = None
                if stateful:
                    state, self.not_resumable = take_state(loader)
                    stateful = self.not_resumable is None
                yield batch._replace(state=state) if state is not None else batch
            if stateful:  # (taken after the last batch, its state says the epoch is not done yet)
                self._end_state, self.not_resumable = take_state(loader)
        finally:
            batches.close()  # the loader's iteration ends now, on this thread

    def end_state(self) -> Any:
        """The loader's state once its iteration ended (None where it is not taken): a run resumed from it
        starts the next epoch, not an empty rest of this one."""
        return self._end_state


def _batches(loader: Any, arena: WorkerArena | None) -> Iterator[HostBatch]:
    """The batches of one iteration of ``loader``, those collated into ``arena`` as views of it.

    While the iteration starts its workers (at ``iter()`` for a DataLoader, at the first ``next()`` for a
    wrapper that iterates one lazily, as accelerate's do), the DataLoader's ``collate_fn`` is the arena's,
    and a process forked meanwhile, a worker, freezes the objects it inherited (:mod:`gpufeed._forks`).
    Both end when the first batch arrives."""
    inner = _workers_of(loader)
    collate = arena.begin(inner) if arena is not None and has_workers(inner) else None
    original = getattr(inner, "collate_fn", None)
    if collate is not None:
        inner.collate_fn = collate
    starting = has_workers(inner)
    if starting:
        _forks.starting(+1)
    it = None
    try:
        it = iter(loader)
        for batch in it:
            if starting:  # (the first batch: the workers started)
                starting = _started(starting, inner, collate, original)
            if type(batch) is SlotBatch:
                views, rebuild, lease = arena.open(batch)
                yield HostBatch(rebuild(views), lease)
            else:
                yield HostBatch(batch)
    finally:  # the iterator ends now (a DataLoader shuts its workers down), before the arena is reused
        _started(starting, inner, collate, original)
        close = getattr(it, "close", None)
        if close is not None:
            close()
        elif not getattr(inner, "persistent_workers", True):
            # A DataLoader's iterator shuts its workers down when collected; an error's traceback may
            # hold it past the epoch (and its dead worker's SIGCHLD then fires later): shut them down now.
            shutdown = getattr(it, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
        del it
        if collate is not None:
            arena.end()


def _started(starting: bool, inner: Any, collate: Any, original: Any) -> bool:
    """The workers started: the loader's own collate_fn back, forks no longer its workers'."""
    if collate is not None and inner.collate_fn is collate:
        inner.collate_fn = original
    if starting:
        _forks.starting(-1)
    return False


def _workers_of(loader: Any) -> Any:
    """The DataLoader whose workers collate ``loader``'s batches: accelerate's loaders wrap one
    (``base_dataloader``) and iterate it."""
    base = vars(loader).get("base_dataloader") if hasattr(loader, "__dict__") else None
    return base if base is not None else loader


def check_state(state: Any) -> None:
    if not isinstance(state, dict) or "gpufeed" not in state:
        raise ValueError(f"not a gpufeed state_dict: expected a dict from CudaPrefetcher.state_dict(), got "
                         f"{type(state).__name__}")
    if state["gpufeed"] != STATE_VERSION:
        raise ValueError(f"gpufeed state version {state['gpufeed']} is not supported "
                         f"(this gpufeed reads version {STATE_VERSION})")
    if state.get("mode") != "loader":
        raise ValueError(f"this state was saved by a gpufeed whose prefetcher read a BatchSource itself "
                         f"(mode {state.get('mode')!r}); save it again with a SourceLoader")
