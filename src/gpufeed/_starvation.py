"""GpuWaits: how long the GPU waited for each batch, read from CUDA events batches later."""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from gpufeed.stats import PrefetchStats

# The event calls straight to torch._C, as the stage's stream calls (torch.cuda.Event's methods wrap them).
_Base = torch._C._CudaEventBase
_record, _query, _elapsed = _Base.record, _Base.query, _Base.elapsed_time

#: Batches read a call while the readings keep up; more while they catch up.
_COLLECT, _BACKLOG = 1, 16
#: Every batch is measured until this many were; after, two consecutive batches (a wait and the period
#: it lies in) about every ``SAMPLE``, at random gaps (1 to ``2 * SAMPLE - 1`` batches: random, so that no
#: loader's period lines up with them). A measured batch costs the loop's thread a few event calls (about
#: 20 us on an H200); a pair in 64 costs well under the 2 us a batch measuring may cost (docs/design.md,
#: "The verdict").
FULL_BATCHES, SAMPLE = 64, 64


class _Pending(NamedTuple):
    asked: Any  # timing event on the loop's stream, recorded when next() started
    handed: Any  # timing event there at the hand-over, or None where ``asked`` had not completed by then
    copied: Any  # the batch's copy event, or None where it had completed by the hand-over (or there is none)
    stream: Any  # the loop's stream
    epoch: int
    index: int  # the call's number: a measured batch stands for the calls since the one measured before
    fetch: float  # shares of the thread's time in that next(): the loader's next(), staging
    stage: float


class GpuWaits:
    """How long the loop's stream was ready to run a step while its batch was not, batch by batch.

    For each batch but an epoch's first (its start-up), the event ``asked`` is recorded on the loop's
    stream when ``next()`` starts: it completes once the GPU has run the work the loop queued before, when
    the stream could start the next step. The batch's copy event ``copied`` (on the copy stream) completes
    when its data is ready. The step starts at the later of the two and of the moment the loop's thread
    gets the batch; so where ``asked`` has completed by the hand-over (the GPU ran dry while the thread was
    in ``next()``), a second event ``handed`` is recorded there, before the stream waits on ``copied``.
    The batch's wait is ``max(handed, copied) - asked`` (``handed`` taken as ``asked`` where it was not
    recorded), never negative:

    * ``handed - asked``: the GPU idle while the thread was in the loader's ``next()``, staging, or
      issuing copies; split between them as the thread's time was in that ``next()``;
    * the rest, ``copied`` past ``handed``: the copy (and ``transform``) not done when the stream was ready.

    A copy complete at the hand-over completed before both ``handed`` and an ``asked`` still pending then:
    it is dropped there, so the GPU-bound loop's batch costs one event and three queries, and no elapsed
    time is read but the span's. A batch copied on the loop's own stream has no ``copied``: its copy runs
    on the loop's stream between
    the ``asked`` of the call that issued it and the step, so a call that issued one records ``handed``
    and the stream's time on the copy is in its ``handed - asked``.

    A batch measured right after the one before it is counted: its wait, and its period, from the step
    before it to its own, ``elapsed(before.asked, asked) + wait - before.wait`` (``stats.span_s`` sums the
    periods). An epoch's first batch is its start-up, never counted. Past ``FULL_BATCHES`` the batches are
    measured in such pairs, one in about ``SAMPLE``: ``waited_s / span_s`` is then the waits' share of the
    periods sampled, at most 1, and ``waited_batches`` the batches counted.

    Invariants: nothing here waits for the GPU on the loop's thread: events are read only once a later
    event of the same stream has completed (the stream waited on the batch's ``copied`` before it), at
    most a few a call; :meth:`refresh` reads what the GPU has reached, :meth:`close` waits for the rest.
    Events are reused from a free list once read.
    """

    def __init__(self, stats: PrefetchStats) -> None:
        self.stats = stats
        self.inline = False  # the current call issued a copy on the loop's stream
        self._free: list[Any] = []
        self._pending: collections.deque[_Pending] = collections.deque()
        self._asked: tuple[Any, tuple[float, float, float], int] | None = None  # (event, mark, index)
        self._epoch = 0
        self._calls = 0  # asked() calls so far
        self._next = 0  # the call measured next
        self._second = False  # the next call measured ends a sampled pair
        self._before: tuple[Any, float, int, int, Any] | None = None  # (asked, wait, epoch, index, stream)
        self._random = random.Random()  # (the program's own random sequence stays its own)
        self._lock = threading.Lock()

    def new_epoch(self) -> None:
        """An epoch starts: its first batch is its start-up, and the last call of the one before (which
        found the end, and handed nothing over) pairs with no batch."""
        self._epoch += 1
        if self._asked is not None:
            self._free.append(self._asked[0])
            self._asked = None

    def asked(self, current: Callable[[], Any], mark: tuple[float, float, float]) -> None:
        """``next()`` started (``mark``: its time, and the stats' ``fetch_s`` and ``stage_s`` then);
        ``current()`` is the loop's stream, looked up only for a batch measured."""
        self.inline = False
        if self._asked is not None:  # a call that handed nothing over (the end, an error)
            self._free.append(self._asked[0])
            self._asked = None
        index = self._calls
        self._calls = index + 1
        if index < self._next:  # not measured
            return
        if index < FULL_BATCHES or not self._second:  # (a pair's first batch: the next one is measured too)
            self._next = index + 1
            self._second = index >= FULL_BATCHES
        else:
            self._next = index + self._random.randint(1, 2 * SAMPLE - 1)
            self._second = False
        event = self._take()
        _record(event, current())
        self._asked = (event, mark, index)

    def handed(self, stream: Any, copied: Any) -> None:
        """The batch is handed over on ``stream``, which is about to wait on ``copied``."""
        if self._asked is None:  # an epoch's first batch, or a batch not measured
            return
        asked, (t0, fetch0, stage0), index = self._asked
        self._asked = None
        if copied is not None and _query(copied):  # done before the stream could be ready: no copy wait
            copied = None
        handed = None
        if self.inline or _query(asked):
            handed = self._take()
            _record(handed, stream)
        dt = time.perf_counter() - t0
        stats = self.stats
        fetch = (stats.fetch_s - fetch0) / dt if dt > 0 else 0.0
        stage = (stats.stage_s - stage0) / dt if dt > 0 else 0.0
        self._pending.append(_Pending(asked, handed, copied, stream, self._epoch, index, fetch, stage))
        if self._lock.acquire(blocking=False):  # (else a refresh on another thread reads them)
            try:
                self._collect(_COLLECT if len(self._pending) < _BACKLOG else 2 * _COLLECT, keep=1)
            finally:
                self._lock.release()

    def refresh(self) -> None:
        """Read every batch the GPU has reached."""
        with self._lock:
            self._collect(len(self._pending), keep=0)

    def close(self) -> None:
        """Wait for the events still pending and read them (the prefetcher closes)."""
        with self._lock:
            for p in self._pending:
                for event in (p.handed or p.asked, p.copied):
                    if event is not None:
                        event.synchronize()
            self._collect(len(self._pending), keep=0)

    # -- reading -----------------------------------------------------------------------------------

    def _collect(self, limit: int, keep: int) -> None:
        pending = self._pending
        while limit > 0 and len(pending) > keep and self._reached(pending):
            self._count(pending.popleft())
            limit -= 1

    def _reached(self, pending: collections.deque[_Pending]) -> bool:
        p = pending[0]
        if len(pending) > 1 and pending[1].stream is p.stream:
            return bool(_query(pending[1].asked))
        return bool(_query(p.handed or p.asked)) and (p.copied is None or bool(_query(p.copied)))

    def _count(self, p: _Pending) -> None:
        idle = max(0.0, _elapsed(p.asked, p.handed) / 1e3) if p.handed is not None else 0.0
        copy = _elapsed(p.asked, p.copied) / 1e3 if p.copied is not None else 0.0
        wait = max(idle, copy)
        if p.handed is not None:
            self._free.append(p.handed)
        before, self._before = self._before, (p.asked, wait, p.epoch, p.index, p.stream)
        if before is None:
            return
        # (an epoch's first batch, a sampled pair's first, or the loop switched streams: no period)
        if before[2] == p.epoch and before[3] + 1 == p.index and before[4] is p.stream:
            stats = self.stats
            stats.span_s += _elapsed(before[0], p.asked) / 1e3 + wait - before[1]
            stats.waited(wait, fetch=idle * p.fetch, stage=idle * p.stage, copy=wait - idle)
        self._free.append(before[0])  # (read for the last time: the loop's thread may take it now)

    def _take(self) -> Any:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
