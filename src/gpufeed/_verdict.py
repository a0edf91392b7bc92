"""The verdict of :class:`~gpufeed.PrefetchStats`: whether data costs the loop a share of its time worth
acting on, and the one next step that would help (docs/design.md, "The verdict").

The thresholds below are judgement calls, each argued in docs/design.md; nothing here is tuned to a card.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

# The functions below read a gpufeed.PrefetchStats (typed Any: stats.py imports this module, not back).
PrefetchStats = Any

#: Input-bound from this share of the timeline spent waiting for data: removing every wait would speed the
#: loop up by 1 / (1 - 0.10) = 1.11x at most, and below that the gain is within two or three times the
#: run-to-run spread of steps/s (2-4% between rounds of the same benchmark on one machine).
INPUT_BOUND_SHARE = 0.10
#: No verdict on fewer batches after each epoch's start-up: one slow batch (a page fault, a collection)
#: would be a tenth of the time by itself.
MIN_BATCHES = 10
#: A step (the consumer's time a batch that is not a wait for data) of at most this long did no work to
#: starve: the loop's waits time the input alone. An empty loop measures 5-20 us a batch on the CPU (the
#: iteration, the scheduler's noise); a training step's kernel launches alone take longer. On CUDA an
#: empty loop's thread spends a few microseconds a batch outside ``next()``, and its GPU step holds
#: gpufeed's own calls between the hand-over and the next batch's first event (27-64 us on H200 hosts):
#: there a loop did no work when its thread's time outside ``next()`` is at most this, and its GPU step
#: at most twice this.
EMPTY_LOOP_US = 50.0
#: Waits come in bursts when the tenth of the batches that waited longest hold at least this share of the
#: waiting: the input keeps up on average, and more batches ahead absorb its slow ones.
BURST_SHARE = 0.5
#: Batches of at least this many bytes on average are large: a DataLoader's workers spend their time
#: collating (copying every sample once more); a SourceLoader reads a batch in place.
LARGE_BATCH_BYTES = 8 << 20


class Verdict(NamedTuple):
    """``label`` is ``"INPUT-BOUND"``, ``"ok"`` or ``"no verdict"``; ``reason`` says why there is none;
    ``next_step`` is one concrete thing to do (empty without a verdict)."""

    label: str
    reason: str
    next_step: str


def judge(s: PrefetchStats) -> Verdict:
    """The verdict on ``s``'s waits (the GPU's on CUDA, the loop thread's on the CPU)."""
    if not s.measure:
        return Verdict("no verdict", "measuring is off (measure=False)", "")
    if s.waited_batches < MIN_BATCHES:
        return Verdict("no verdict", f"fewer than {MIN_BATCHES} batches timed after start-up", "")
    if not s.loop_did_work:
        us = s.loop_us if s.device == "cuda" else s.step_us
        return Verdict("no verdict", f"the loop did no work ({us:.0f} us a batch): its waits time the "
                                     "input alone", "")
    if s.starved_fraction < INPUT_BOUND_SHARE:
        return Verdict("ok", "", f"none: {_limit(s)} is the limit, not the input")
    return Verdict("INPUT-BOUND", "", next_step(s))


#: On CUDA, a loop whose thread is busy outside ``next()`` for at least this share of the GPU's step is held
#: by its own thread (Python, kernel launches), not by the GPU: the GPU's step cannot be shorter than the
#: time the thread takes to queue it.
THREAD_BOUND_SHARE = 0.9


def _limit(s: PrefetchStats) -> str:
    """What holds a loop the input does not hold."""
    if s.device != "cuda":
        return "the loop's own work"
    if s.loop_us >= THREAD_BOUND_SHARE * s.step_us:
        return "the loop's own work on its thread (Python, kernel launches)"
    return "the GPU's work"


def next_step(s: PrefetchStats) -> str:
    """What would cut the waits of an input-bound loop: more batches ahead for bursts, else the fix of the
    stage that holds most of the waiting."""
    if s.burst_share >= BURST_SHARE:
        return (f"raise depth (now {s.depth}): the longest tenth of the waits hold {s.burst_share:.0%} of "
                "the waiting, bursts that more batches ahead absorb")
    stage = max(s.wait_shares().items(), key=lambda kv: kv[1])[0]
    if stage == "fetch":
        return _fetch_step(s)
    if stage == "stage":
        return ("batches arrive in pageable memory and are pinned on your thread: give the DataLoader "
                "workers (their batches then arrive pinned) or read with a SourceLoader")
    if stage == "copy":
        return (f"the host-to-device copy is the limit ({s.h2d_GBps:.1f} GB/s timed): ship fewer bytes "
                "(uint8, converted on the GPU by a transform)")
    return "gpufeed's own calls a batch are the limit: make batches larger (fewer, bigger copies)"


def _fetch_step(s: PrefetchStats) -> str:
    if s.loader == "SourceLoader":
        return ("the source's reads are the limit: raise its num_threads, or check the disk "
                "(gpufeed doctor)")
    if s.loader != "DataLoader":
        return ("the loader's next() is the limit, on your loop's thread: produce batches in a DataLoader "
                "with workers")
    if s.num_workers == 0:
        return "the DataLoader runs on your loop's thread: give it num_workers > 0"
    if s.batches and s.bytes / s.batches >= LARGE_BATCH_BYTES:
        return (f"the DataLoader's workers are the limit on large batches ({s.bytes / s.batches / 2**20:.0f} "
                f"MiB): read with a SourceLoader, or raise num_workers (now {s.num_workers})")
    return f"the DataLoader's workers are the limit: raise num_workers (now {s.num_workers})"


class WaitHistogram:
    """Each timed batch's wait, counted in bins of powers of two of microseconds (a few dozen integers
    however long the run), enough to say how much of the waiting the longest waits hold.

    Invariant: ``counts[i]`` and ``sums[i]`` are the number and total seconds of the waits ``w`` with
    ``floor(log2(w * 1e6)) == i`` (bin 0 also holds every wait under 2 us, zero included).
    """

    BINS = 40  # 2**39 us: six days

    def __init__(self) -> None:
        self.counts = [0] * self.BINS
        self.sums = [0.0] * self.BINS

    def add(self, seconds: float) -> None:
        us = seconds * 1e6
        i = min(self.BINS - 1, int(math.log2(us))) if us >= 2.0 else 0
        self.counts[i] += 1
        self.sums[i] += max(seconds, 0.0)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def top_share(self, fraction: float) -> float:
        """The share of the total wait held by the ``fraction`` of the batches that waited longest (a bin
        taken in part counts at its mean)."""
        total = sum(self.sums)
        left = math.ceil(fraction * self.count)
        if total <= 0 or left == 0:
            return 0.0
        taken = 0.0
        for n, w in zip(reversed(self.counts), reversed(self.sums), strict=True):
            k = min(n, left)
            taken += w * k / n if n else 0.0
            left -= k
            if left == 0:
                break
        return taken / total
