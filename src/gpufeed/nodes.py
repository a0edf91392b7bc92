"""ToDevice: gpufeed's device stage as a torchdata ``nodes`` stage (``pip install 'gpufeed[nodes]'``); and
``pinned_collate``, ``default_collate`` into pinned memory for the ``Mapper`` that collates its batches."""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from gpufeed._device import DeviceBatch, DeviceStage, resolve_device
from gpufeed._extras import require
from gpufeed._threads import Failure
from gpufeed.host_memory import HostBatch
from gpufeed.host_memory.pinned_collate import pinned_collate
from gpufeed.stats import PrefetchStats

_nodes = require("torchdata.nodes", "gpufeed.nodes (ToDevice)")

__all__ = ["ToDevice", "pinned_collate"]


class ToDevice(_nodes.BaseNode):  # type: ignore[misc,name-defined]
    """A torchdata ``nodes`` stage whose ``next()`` returns the batch of ``source_node`` already on the GPU.

    Put it last, before the ``Loader``::

        node = Batcher(ParallelMapper(IterableWrapper(indices), dataset.__getitem__, num_workers=8), 256)
        node = Prefetcher(Mapper(node, pinned_collate), prefetch_factor=2)  # collated into pinned memory
        for batch in Loader(ToDevice(node)):       # batch["x"] is already on the GPU
            ...

    It is the device stage of :class:`~gpufeed.CudaPrefetcher`, staged and copied the same way: each
    ``next()`` takes one batch from ``source_node``, issues its copies (on a copy stream of its own for the
    stage's life; a batch whose copy costs less than that stream's calls, on your stream as pinning, then
    ``.to(non_blocking=True)``, would), and hands over the batch taken ``depth`` calls before, whose copy
    overlapped your steps meanwhile. A pinned batch (collated by :func:`pinned_collate`, or after
    ``PinMemory``) is copied as it is; a pageable one is pinned first, on your thread, by one thread's copy
    (torch's parallel copy would wait for the cores of the pipeline's threads). The stage has no thread:
    ``source_node.next()`` runs on your thread, so end the upstream with a stage that works on threads of its
    own (``Prefetcher``, ``PinMemory``, ``ParallelMapper``) when it does more than hand batches on.

    ``Loader(...).state_dict()`` holds the upstream's state right after the last batch handed to you:
    resuming from it re-reads the batches that were in flight. ``reset()`` (every new epoch of the
    ``Loader``) drops what is in flight and resets the upstream. An error upstream (or in ``transform``)
    is raised with its own type after the batches before it; the end of the upstream ends the epoch
    after the batches ahead are handed out. ``stats`` (a :class:`~gpufeed.PrefetchStats`) says whether
    your loop waited for data. Without CUDA (or with ``device="cpu"``) batches stay on the CPU.

    Example:
        >>> from torchdata.nodes import IterableWrapper, Loader
        >>> source = IterableWrapper([{"x": torch.arange(3)}, {"x": torch.arange(3, 6)}])
        >>> [b["x"].sum().item() for b in Loader(ToDevice(source, device="cpu"))]
        [3, 12]

    Args:
        source_node: the upstream ``torchdata.nodes.BaseNode`` (wrap a plain iterable in
            ``IterableWrapper``).
        device: target device; ``None`` means the current CUDA device when CUDA is available, else CPU.
        depth: batches taken from ``source_node`` ahead of the one your loop holds (>= 1); on CUDA their
            copies are in flight meanwhile.
        transform: optional function applied to each batch on the device, on the copy stream.

    Invariants: batches reach the loop in the upstream's order, each once, an error in its batch's
    place; ``_ahead`` holds at most ``depth + 1`` items (device batches, then a Failure last); each
    device batch carries the upstream's state taken right after it, and ``get_state`` is the state of
    the last one handed out. The stream and memory invariants are
    :class:`~gpufeed._device.DeviceStage`'s. No lock: like every node, it is driven by one thread.
    """

    SOURCE_KEY = "source"

    def __init__(self, source_node: Any, device: torch.device | str | int | None = None, depth: int = 2,
                 transform: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        if not isinstance(source_node, _nodes.BaseNode):
            raise TypeError(f"ToDevice takes a torchdata.nodes.BaseNode, got {type(source_node).__name__}: "
                            "wrap an iterable in torchdata.nodes.IterableWrapper(...), or use "
                            "gpufeed.CudaPrefetcher(loader) for a DataLoader or any iterable")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (batches prefetched ahead), got {depth!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {type(transform).__name__}")
        self.source = source_node
        self.device = resolve_device(device)
        self.depth = depth
        self.transform = transform
        self.stats = PrefetchStats(device=self.device.type, depth=depth, loader=type(source_node).__name__)
        # (its thread runs beside the pipeline's, busy with torch ops: a parallel pinning copy would wait for
        # their cores; docs/design.md, "Threads beside the loop")
        self._stage = DeviceStage(self.device, transform, self.stats, parallel_pin=False)
        self._ahead: collections.deque[Any] = collections.deque()
        # (collected with batches ahead, as when a Loader is dropped mid-epoch: their memory fenced too)
        weakref.finalize(self, self._stage.drop, self._ahead)
        self._ended = True  # the upstream is exhausted (or failed): nothing more to take until reset
        self._state: Any = None  # the upstream's state after the last batch handed out
        self._handed = 0  # batches handed out since the last reset
        self._last_t: float | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Drop the batches in flight and reset the upstream to ``initial_state`` (None: the beginning)."""
        self._stage.end_epoch()  # (an epoch left after a break ends here; after its end the first counts)
        super().reset(initial_state)
        self._drop()
        if initial_state is None:
            self.source.reset(None)
            self._state = self.source.state_dict()
        else:
            self._state = initial_state[self.SOURCE_KEY]
            self.source.reset(self._state)
        self._ended = False
        self._handed = 0
        self._last_t = None
        self._stage.new_epoch()

    def next(self) -> Any:
        stats = self.stats
        mark = stats.mark()
        if self._last_t is not None:  # (an epoch's first batch is its start-up: not judged)
            self._stage.asked(mark)
        ahead = self._ahead
        if not self._ended and len(ahead) <= self.depth:
            self._fill()
        if not ahead:
            self._stage.end_epoch()
            raise StopIteration
        item = ahead.popleft()
        if type(item) is not DeviceBatch:
            item.reraise()  # (the upstream's failure, now that the batches before it were handed out)
        self._handed += 1
        batch = self._stage.hand_over(item)
        self._state = item.state
        self._account(mark)
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self._state}

    def _fill(self) -> None:
        """Take batches from the upstream and issue their copies until ``depth`` are ahead of the next."""
        source, copy, ahead, depth, stats = self.source, self._stage.copy, self._ahead, self.depth, self.stats
        try:
            while len(ahead) <= depth:
                t0 = time.perf_counter()
                try:
                    batch = next(source)
                except StopIteration:
                    self._ended = True
                    return
                stats.fetch_s += time.perf_counter() - t0
                copied = copy(HostBatch(batch, None, source.state_dict()))
                ahead.append(copied)
        except Exception as exc:  # (the upstream's or the transform's) raised after the batches before it
            ahead.append(Failure.caught(exc))
            self._ended = True

    def _drop(self) -> None:
        """Drop the batches in flight (``DeviceStage.drop``: their memory's stream waits on their copies)."""
        self._stage.drop(self._ahead)

    def _account(self, mark: tuple[float, float, float]) -> None:
        """Your loop's wait since ``mark``, counted as ``CudaPrefetcher``'s (``PrefetchStats.served``)."""
        self._last_t = self.stats.served(mark, self._last_t, not self._stage.cuda)
        self.stats.batches += 1

