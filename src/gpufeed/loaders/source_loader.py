"""SourceLoader: batch, shuffle and shard a BatchSource, as a DataLoader does a Dataset.

A :class:`SourceLoader` owns every decision about which rows make up each batch (``batch_size``,
``shuffle``, ``drop_last``, ``seed``, the rank's shard, ``pad``), the epoch and resume position, its reader
threads and the pinned memory its reads may hold. Iterating it yields batches (dicts of host tensors, one
per field); a :class:`~gpufeed.CudaPrefetcher` wrapping it copies each batch straight from the pinned buffer
it was read into.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data

from gpufeed.host_memory import HostBatch, warn_pageable
from gpufeed.host_memory.cpu_buffers import CpuBuffers
from gpufeed.host_memory.pinned_pool import DEFAULT_PINNED_BUDGET, PinnedPool
from gpufeed.loaders._epochs import Epochs

if TYPE_CHECKING:
    from gpufeed.sources.base import BatchSource, Rows

STATE_VERSION = 1
#: The version of a prefetcher's state_dict around a SourceLoader's (the same as around any loader's).
PREFETCHER_STATE_VERSION = 1


class SourceLoader(Epochs):
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

    Invariant: it owns the epoch and the resume position; a prefetcher wrapping it only takes the state
    that came with each batch (the position after it) and tells it when an iteration handed out its
    first batch (:meth:`epoch_started`).

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
        num_threads: reader threads (default: up to 8), each reading a piece of a batch. A source that
            spreads a read over threads of its own (``parallel_reads``: gpufeed's file sources, where the
            native reader is built; their own ``num_threads`` says how many) is given a whole batch per
            read instead. For a source that reads into device memory (``reads_to == "device"``:
            ``H5Source(decode="gpu")``, GDS) it is also how many batches are read at once, each into
            device memory of its own.
        pinned_budget: bytes of pinned memory the reads may hold (default 512 MiB), a few batches read
            ahead of the one being copied; a batch larger than the budget still gets one buffer. 0 reads
            into pageable memory. Without CUDA nothing is pinned and the value is ignored with a warning.

    """

    def __init__(self, source: BatchSource, batch_size: int, *, shuffle: bool | str = False,
                 drop_last: bool = False, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, pad: bool = False, num_threads: int | None = None,
                 pinned_budget: int | None = None) -> None:
        from gpufeed.sources.base import BatchSource

        if not isinstance(source, BatchSource):
            raise TypeError(f"SourceLoader reads a BatchSource (RawSource, H5Source, GDSSource ...); got "
                            f"{type(source).__name__}: {_what_instead(source)}")
        if pinned_budget is not None and (not isinstance(pinned_budget, int) or pinned_budget < 0):
            raise ValueError(f"SourceLoader: pinned_budget must be an int >= 0 (bytes), "
                             f"got {pinned_budget!r}")
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
        self.pinned_budget = pinned_budget
        self._pool: PinnedPool | None = None  # made at the first epoch read for a CUDA device
        self._cpu = CpuBuffers(slots=8)
        self._warned = False
        self._iterating = (0, 0)  # (epoch, first batch) of the iteration a prefetcher runs
        self.config = dict(batch_size=batch_size, shuffle=shuffle, drop_last=bool(drop_last), seed=int(seed),
                           rank=rank, world_size=world_size, pad=bool(pad))
        super().__init__()
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

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The next epoch's batches on the host (without a prefetcher: the loop's thread reads them)."""
        if self._resume is not None:
            (epoch, start), self._resume = self._resume, None
        else:
            epoch, start = self.upcoming_epoch(), 0
        return self._direct(epoch, start)

    def _direct(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        for i, hb in enumerate(self._read(epoch, start, torch.device("cpu")), start):
            if i == start:
                self.begin_epoch(epoch)
            self._pos = (epoch, i + 1)  # taken by state_dict() right after the yield
            yield hb.batch

    # -- what a prefetcher asks -------------------------------------------------------------------

    def host_batches(self, device: torch.device, arena: Any = None) -> Iterator[HostBatch]:
        """The next iteration's batches read for ``device`` (pinned host memory for a CUDA device), each with
        the position after it; the resume point of :meth:`load_state_dict` holds until a batch is handed
        out (:meth:`epoch_started`)."""
        self._iterating = self._resume if self._resume is not None else (self.upcoming_epoch(), 0)
        return self._with_state(*self._iterating, device)

    def _with_state(self, epoch: int, start: int, device: torch.device) -> Iterator[HostBatch]:
        for i, hb in enumerate(self._read(epoch, start, device), start):
            yield hb._replace(state=self.state_at(epoch, i + 1))

    @property
    def iteration_epoch(self) -> int:
        """The epoch of the iteration a prefetcher runs (or last ran, or resumes in)."""
        return self._iterating[0]

    def epoch_started(self) -> None:
        """The current iteration handed out its first batch."""
        self._resume = None
        self.begin_epoch(self._iterating[0])

    def end_state(self) -> None:
        """None: the position after an epoch's last batch already resumes at the next epoch."""
        return None

    def initial_state(self) -> dict[str, Any]:
        """The position before the current iteration's first batch."""
        return self.state_at(*self._iterating)

    def prefetcher_state(self, last: Any) -> dict[str, Any]:
        """A prefetcher's state: ``last`` is the position after the last batch it handed out."""
        last = last if last is not None else self.state_dict()
        return {"gpufeed": PREFETCHER_STATE_VERSION, "mode": "loader", "epoch": last["epoch"], "loader": last}

    def load_prefetcher_state(self, state: dict[str, Any]) -> None:
        from gpufeed.loaders.dataloader import check_state

        check_state(state)
        self.load_state_dict(state["loader"])
        self._iterating = self._resume

    def free_memory(self) -> None:
        """Free the pinned buffers that no copy reads (a later epoch allocates them again)."""
        if self._pool is not None:
            self._pool.clear()

    def _read(self, epoch: int, start: int, device: torch.device) -> Iterator[HostBatch]:
        from gpufeed.loaders._reads import EpochReads

        stop = threading.Event()
        reads = EpochReads(self.source, self.plan(epoch), self.num_threads, self._pinned(device),
                           self._cpu, device, stop)
        try:
            for i in range(start, len(reads.plan)):
                yield reads.take(i)
        finally:  # stopped, failed or done: reads started for a batch never handed out end here
            stop.set()
            reads.cancel()

    def _pinned(self, device: torch.device) -> PinnedPool | None:
        """The pool reads for ``device`` go to (None: pageable memory, as on the CPU)."""
        if device.type != "cuda":
            if self.pinned_budget and not self._warned:
                self._warned = True
                warnings.warn(f"SourceLoader: pinned_budget={self.pinned_budget} sizes pinned reads for a "
                              f"CUDA "
                              f"device; reading for {device}, batches go to pageable memory", RuntimeWarning,
                              stacklevel=4)
            return None
        if self._pool is None:
            budget = DEFAULT_PINNED_BUDGET if self.pinned_budget is None else self.pinned_budget
            self._pool = PinnedPool(budget, pin=True)
        if not self._pool.available and not self._warned:
            self._warned = True
            warn_pageable("pinned_budget is 0" if self._pool.budget == 0 else "pinned allocation failed",
                          "raise the locked-memory limit (ulimit -l) or SourceLoader's pinned_budget")
        return self._pool

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


def _what_instead(source: Any) -> str:
    if isinstance(source, torch.utils.data.DataLoader):
        return "a DataLoader already makes batches: wrap it directly, CudaPrefetcher(loader)"
    return "wrap a Dataset in a DataLoader and that in CudaPrefetcher(loader)"


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
