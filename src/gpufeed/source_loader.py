"""SourceLoader: batch, shuffle and shard a BatchSource, as a DataLoader does a Dataset.

A :class:`SourceLoader` owns every decision about which rows make up each batch (``batch_size``,
``shuffle``, ``drop_last``, ``seed``, the rank's shard, ``pad``) and the epoch and resume position.
Iterating it yields :class:`ReadRequest` objects; a :class:`~gpufeed.CudaPrefetcher` wrapping it has each
request read straight into its pinned and device buffers.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpufeed._copier import Copier, Delivered
    from gpufeed.sources.base import BatchSource, Rows

STATE_VERSION = 1


class ReadRequest(abc.ABC):
    """One batch that reads itself to the device: what a :class:`SourceLoader` yields.

    The protocol between a loader of a source and :class:`~gpufeed.CudaPrefetcher`: when the
    prefetcher takes a ``ReadRequest`` from the loader it wraps (on the loop's thread or its fetch
    thread), it calls
    :meth:`read` instead of copying the item's tensors. ``read`` may use these members of the copier:
    ``device``, ``stream`` (the copy stream, already the calling thread's current stream; ``None`` on
    the CPU), ``pool`` (pinned buffers, refilled only after the copy that read them completed),
    ``host`` (host tensors for CPU batches, reused only once nothing else references them), ``stats``,
    ``trace``, ``pinned_ok()``, and ``begin()`` / ``seal()``, which time the batch's copies
    and record the event that the consumer's stream waits on. ``rows`` are the source rows of the batch.
    """

    rows: Rows

    @abc.abstractmethod
    def read(self, copier: Copier, stop: threading.Event) -> Delivered:
        """Read the batch into device tensors (host tensors on the CPU) and return it sealed."""


class SourceLoader:
    """Batches of a :class:`~gpufeed.BatchSource`: the rows of each batch, read by the prefetcher.

    The source-side counterpart of a ``DataLoader``: wrap it in a :class:`~gpufeed.CudaPrefetcher`,
    which reads each batch straight into pinned and device buffers::

        loader = SourceLoader(H5Source("train.h5"), batch_size=256, shuffle=True)
        for batch in CudaPrefetcher(loader):        # batch["x"] is on the GPU
            ...

    An iteration that hands out a batch is an epoch, and the next iteration a new one (a new shuffle)
    unless :meth:`set_epoch` chose one; an ``iter()`` that hands out nothing (Lightning's probe) does not
    count. :meth:`state_dict` is the position after the last batch yielded; a prefetcher records the one
    after the batch its consumer received, and resumes there.

    Invariant: :meth:`batches` depends only on its arguments and the configuration, so a prefetcher's
    fetch thread reads while the epoch counter and the resume point change only on the training thread
    (:meth:`upcoming_epoch`, :meth:`begin_epoch`, :meth:`resume_point`).

    Args:
        source: the BatchSource to read (``RawSource``, ``H5Source``, ``GDSSource`` or your own).
        batch_size: samples per batch, >= 1.
        shuffle: ``False``, ``True`` (a new permutation of the samples each epoch), or ``"blocks"``
            (batch-sized blocks of consecutive samples in a random order: each batch is one sequential
            read, for slow disks).
        drop_last: drop a short last round of batches, so that every batch holds ``batch_size`` samples.
        seed: the shuffle's seed, combined with the epoch; the same on every rank.
        rank, world_size: this process's shard (default: from ``torch.distributed`` when initialized).
        pad: repeat samples so that every rank gets as many batches as the others (see
            :func:`gpufeed.sources.plan_batches`).
        num_threads: reader threads (default: up to 8; where a CPU prefetcher has no core to spare and
            reads on the loop's thread, that thread alone), each reading a piece of a batch. A source that
            spreads a read over threads of its own (``parallel_reads``: gpufeed's file sources, where the
            native reader is built; their own ``num_threads`` says how many) is given a whole staging
            chunk per read instead, and these threads take only the reads it cannot start itself
            (shuffled rows gathered from a memory map). For a source that reads into device memory
            (``reads_to == "device"``: ``H5Source(decode="gpu")``, GDS) it is also how many batches are
            read at once, each into device memory of its own.

    """

    def __init__(self, source: BatchSource, batch_size: int, *, shuffle: bool | str = False,
                 drop_last: bool = False, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, pad: bool = False, num_threads: int | None = None) -> None:
        from gpufeed.sources.base import BatchSource

        if not isinstance(source, BatchSource):
            raise TypeError(f"SourceLoader reads a BatchSource (RawSource, H5Source, GDSSource ...); got "
                            f"{type(source).__name__}: wrap a Dataset in a DataLoader instead")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"SourceLoader: batch_size must be an int >= 1, got {batch_size!r}")
        if shuffle not in (False, True, "blocks"):
            raise ValueError(f"SourceLoader: shuffle must be False, True or 'blocks', got {shuffle!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"SourceLoader: num_threads must be an int >= 1, got {num_threads!r}")
        if rank is None and world_size is None and _dist_ready():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        rank, world_size = rank or 0, world_size or 1
        if not 0 <= rank < world_size:
            raise ValueError(f"SourceLoader: rank must be in [0, world_size={world_size}), got {rank}")
        self.source = source
        self.batch_size = batch_size
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)  # docs/design.md: why 8 readers
        self._threads_auto = num_threads is None
        self.config = dict(batch_size=batch_size, shuffle=shuffle, drop_last=bool(drop_last), seed=int(seed),
                           rank=rank, world_size=world_size, pad=bool(pad))
        self.epoch = 0
        self._epoch_set = False
        self._started = False  # a batch of ``epoch`` was handed out: the next iteration is a new epoch
        self._resume: tuple[int, int] | None = None
        self._pos = (0, 0)  # (epoch, batches yielded in it) of direct iteration, or the resume point

    def plan(self, epoch: int | None = None) -> list[Rows]:
        """The rows of every batch of ``epoch`` (default: the current one) for this rank."""
        from gpufeed.sources.sampling import plan_batches

        c = self.config
        return plan_batches(len(self.source), c["batch_size"], shuffle=c["shuffle"], drop_last=c["drop_last"],
                            seed=c["seed"], epoch=self.epoch if epoch is None else epoch, rank=c["rank"],
                            world_size=c["world_size"], pad=c["pad"])

    def __len__(self) -> int:
        # Batches per epoch do not depend on the order (plan_batches cuts every order the same way), and the
        # plan in order holds ranges, not a permutation of every sample.
        from gpufeed.sources.sampling import plan_batches

        c = self.config
        return len(plan_batches(len(self.source), c["batch_size"], drop_last=c["drop_last"], rank=c["rank"],
                                world_size=c["world_size"], pad=c["pad"]))

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (the shuffle) of the next iteration."""
        self.epoch, self._epoch_set = int(epoch), True

    def upcoming_epoch(self) -> int:
        """The epoch the next iteration reads: a new one once a batch of the current one was handed out,
        unless :meth:`set_epoch` chose one."""
        return self.epoch + 1 if self._started and not self._epoch_set else self.epoch

    def begin_epoch(self, epoch: int) -> None:
        """A batch of ``epoch`` was handed out: it is the current epoch, and the next iteration a new one."""
        self.epoch, self._started, self._epoch_set = epoch, True, False

    def batches(self, epoch: int, start: int = 0, *, spare_core: bool = True) -> Iterator[ReadRequest]:
        """The read requests of ``epoch`` from batch ``start`` on; touches no state of this loader, so a
        prefetcher's fetch thread can run it while the training thread uses the loader.

        ``spare_core=False``: the loop's own thread reads them (a CPU prefetcher with no core to spare), and
        an automatic ``num_threads`` is that thread alone: handing pieces of a batch to other threads then
        only adds handoffs, as the loop's compute is waiting anyway (docs/design.md).
        """
        from gpufeed._source_batch import EpochReads

        threads = 1 if self._threads_auto and not spare_core else self.num_threads
        reads = EpochReads(self.source, self.plan(epoch), threads)
        try:
            for i in range(start, len(reads.plan)):
                yield reads.take(i)
        finally:  # stopped, failed or done: reads already started for a batch never delivered end here
            reads.cancel()

    def __iter__(self) -> Iterator[ReadRequest]:
        if self._resume is not None:
            (epoch, start), self._resume = self._resume, None
        else:
            epoch, start = self.upcoming_epoch(), 0
        return self._direct(epoch, start)

    def _direct(self, epoch: int, start: int) -> Iterator[ReadRequest]:
        for request in self.batches(epoch, start):
            if request.index == start:
                self.begin_epoch(epoch)
            self._pos = (epoch, request.index + 1)  # taken by state_dict() right after the yield
            yield request

    def state_at(self, epoch: int, batch: int) -> dict[str, Any]:
        """The state of the position after ``batch`` batches of ``epoch``."""
        return {"gpufeed_source_loader": STATE_VERSION, "epoch": epoch, "batch": batch,
                "num_samples": len(self.source), "config": dict(self.config)}

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch yielded (or the one :meth:`load_state_dict` set), and the
        configuration it is valid for."""
        return self.state_at(*self._pos)

    def resume_point(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, batch)`` to resume at from :meth:`state_dict` (the next epoch when that one was done);
        ValueError when the state is not a SourceLoader's or was saved with another configuration."""
        if not isinstance(state, dict) or state.get("gpufeed_source_loader") != STATE_VERSION:
            raise ValueError("not a SourceLoader state_dict (expected one from SourceLoader.state_dict() "
                             f"version {STATE_VERSION})")
        mine = {**self.config, "num_samples": len(self.source)}
        theirs = {**state.get("config", {}), "num_samples": state.get("num_samples")}
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"this state was saved with another configuration ({what}); "
                             "resume with the same source, batch_size, shuffle, seed, drop_last and ranks")
        epoch, start = int(state["epoch"]), int(state["batch"])
        if start >= len(self.plan(epoch)):  # the epoch was complete: resume at the next one
            epoch, start = epoch + 1, 0
        return epoch, start

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration yields the batches after that position."""
        self._resume = self.resume_point(state)
        self._pos = self._resume

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"SourceLoader({self.source!r}, {args})"


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
