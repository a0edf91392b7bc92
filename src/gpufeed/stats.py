"""PrefetchStats: what the prefetcher did, and whether the loop is input-bound."""

from __future__ import annotations

from dataclasses import dataclass, fields

#: A loop whose body takes at most this long a batch did no work to starve: its waits time the input alone.
#: An empty body measures 1-10 us a batch on a 2-core CPU machine (the iteration, and the scheduler's noise
#: after a wait); a training step's launches alone take far longer.
EMPTY_LOOP_US = 25.0


@dataclass
class PrefetchStats:
    """Counters of one prefetcher, over its whole life (all epochs).

    ``wait_s`` is the time the consumer's thread spent in ``next()`` (taking a batch from the loader and
    issuing its copies), and
    ``wall_s`` the time from each epoch's first batch to its last; the wait for an epoch's first batch
    (the pipeline starting: threads, a DataLoader's workers) is ``startup_s``, counted in neither.
    ``stall_fraction`` is ``wait_s / wall_s``: near 0 means the GPU never waited for data, near 1 that
    the loop is input-bound (or, inline, that fetching took the loop's time while the GPU may have been
    busy). ``fetch_s`` and ``stage_s`` are the time spent pulling from the loader (or
    planning a source's batches) and copying pageable memory into pinned buffers (or waiting for a source
    batch's reads, which start ahead), on whichever thread fetched; ``staged_bytes`` is what they moved.
    ``copy_s`` is the H2D time on the copy stream of the batches timed with CUDA events (one batch in 16:
    a CUDA event costs time on every batch), and ``timed_bytes`` what they copied, so ``h2d_GBps`` is the
    rate the link was fed at over that sample. A pageable batch's copies wait for its chunks to be pinned,
    so its time spans its staging too (and, the first time, the pinning of fresh blocks of torch's caching
    host allocator).
    ``slot_batches`` counts the batches a DataLoader's workers collated into the prefetcher's pinned
    shared slots (``worker_slots``): the main process copied none of their bytes. ``loop_stream_batches``
    counts the batches copied on the loop's own stream, where a copy takes less time than the copy
    stream's own calls would cost the loop.

    Example:
        >>> s = PrefetchStats(batches=10, bytes=10 << 20, wait_s=0.01, wall_s=1.0)
        >>> round(s.stall_fraction, 3)
        0.01
    """

    batches: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    wall_s: float = 0.0
    startup_s: float = 0.0
    fetch_s: float = 0.0
    stage_s: float = 0.0
    copy_s: float = 0.0
    timed_bytes: int = 0
    staged_bytes: int = 0
    slot_batches: int = 0
    loop_stream_batches: int = 0
    #: The loop's GPU work was still running when it asked for a batch (sampled on each epoch's first
    #: batches, on CUDA).
    gpu_busy: bool = False

    @property
    def stall_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def h2d_GBps(self) -> float:
        return self.timed_bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    @property
    def stage_GBps(self) -> float:
        return self.staged_bytes / self.stage_s / 1e9 if self.stage_s > 0 else 0.0

    @property
    def throughput_GBps(self) -> float:
        return self.bytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    @property
    def loop_us(self) -> float:
        """The loop's own time per batch, outside ``next()`` (its step), in microseconds."""
        return (self.wall_s - self.wait_s) / self.batches * 1e6 if self.batches else 0.0

    @property
    def loop_did_work(self) -> bool:
        """Whether the loop's body did anything between batches: more than ``EMPTY_LOOP_US`` a batch on
        the CPU, or work the GPU was still running when the loop asked for a batch (a replayed CUDA graph
        takes the CPU microseconds)."""
        return self.gpu_busy or self.loop_us > EMPTY_LOOP_US

    @property
    def input_bound(self) -> bool:
        """True when a loop that did work spent more than 5% of the time in ``next()`` (waiting, or
        fetching on its own thread): the GPU starves unless it was busy meanwhile. A loop whose body did
        nothing waits for every batch by construction: it times the input alone and is not judged."""
        return self.stall_fraction > 0.05 and self.loop_did_work

    def add(self, *, bytes: int = 0, staged_bytes: int = 0, stage_s: float = 0.0, fetch_s: float = 0.0,
            copy_s: float = 0.0, timed_bytes: int = 0, slot_batches: int = 0) -> None:
        """Add to the counters (all counted on the loop's thread). Named arguments, not a dict of them."""
        self.bytes += bytes
        self.staged_bytes += staged_bytes
        self.stage_s += stage_s
        self.fetch_s += fetch_s
        self.copy_s += copy_s
        self.timed_bytes += timed_bytes
        self.slot_batches += slot_batches

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(stall_fraction=self.stall_fraction, h2d_GBps=self.h2d_GBps,
                 stage_GBps=self.stage_GBps, throughput_GBps=self.throughput_GBps)
        return d

    def summary(self) -> str:
        """One line: input-bound or not, and the figures that say why."""
        if self.batches < 2:
            verdict = "no verdict: fewer than two batches timed"
        elif not self.loop_did_work:
            verdict = f"input alone: the loop did no work ({self.loop_us:.0f} us a batch), no verdict"
        else:
            verdict = "INPUT-BOUND" if self.input_bound else "ok"
        return (
            f"[{verdict}] {self.batches} batches, {self.bytes / 1e9:.2f} GB, consumer waited for data "
            f"{self.stall_fraction:.1%} of {self.wall_s:.2f}s between first and last batches (start-up "
            f"{self.startup_s:.2f}s not counted); {self.slot_batches} collated into pinned slots; "
            f"fetch {self.fetch_s:.2f}s, "
            f"stage {self.stage_s:.2f}s ({self.stage_GBps:.1f} GB/s), H2D {self.h2d_GBps:.1f} GB/s (timed "
            f"batches), {self.throughput_GBps:.1f} GB/s delivered"
        )

    def __str__(self) -> str:
        return self.summary()
