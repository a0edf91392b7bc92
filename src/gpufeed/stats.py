"""PrefetchStats: what the prefetcher did, and whether the loop is input-bound."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from gpufeed._verdict import EMPTY_LOOP_US, Verdict, WaitHistogram, judge

#: ``Verdict`` is what :meth:`PrefetchStats.verdict` returns: public here, though defined beside the rules.
__all__ = ["PrefetchStats", "Verdict"]

#: What each stage is called in the summary; ``fetch`` is the loader's ``next()`` (a SourceLoader's reads).
_STAGE_NAMES = {"fetch": "loader", "stage": "staging", "copy": "H2D copy", "other": "hand-over"}


@dataclass
class PrefetchStats:
    """Counters of one prefetcher, over its whole life (all epochs), and the verdict they support.

    **The verdict** (:meth:`summary`, :meth:`verdict`, :meth:`as_dict`) reads how long the consumer waited
    for data, batch by batch, after each epoch's first batch (its start-up, ``startup_s``, is not judged):

    * on CUDA, the GPU's waits: for each batch, how long the loop's stream was ready to run the step while
      the batch was not (CUDA events read batches later, never a synchronization; ``measure=False`` turns
      them off). ``waited_s`` sums them over ``span_s``, the periods (step to step) of the batches timed:
      every batch of the first 64, then consecutive pairs about one batch in 64 (so that measuring costs
      the loop's thread about 1 us a batch);
    * on the CPU, the loop thread's waits in ``next()`` (``waited_s`` is ``wait_s``, ``span_s`` is
      ``wall_s``): there the loop's own time is the truth. A CPU run cannot show what a GPU would wait for
      its copies.

    ``starved_fraction`` is ``waited_s / span_s``; ``waited_fetch_s``, ``waited_stage_s`` and
    ``waited_copy_s`` are the parts of ``waited_s`` spent in the loader's ``next()`` (a SourceLoader's
    reads), pinning pageable batches, and the host-to-device copy; the rest is gpufeed's own hand-over.
    The verdict is ``INPUT-BOUND`` from 10% (``gpufeed._verdict.INPUT_BOUND_SHARE``), with one next step.

    **The counters.** ``wait_s`` is the time the loop's thread spent in ``next()`` and ``wall_s`` the time
    from each epoch's first batch to its last (``stall_fraction`` is their ratio: on CUDA the thread's
    waits, not the GPU's). ``fetch_s`` and ``stage_s`` are the time spent pulling from the loader (or
    planning a source's batches) and copying pageable memory into pinned buffers, on whichever thread
    fetched; ``staged_bytes`` is what they moved. ``copy_s`` is the H2D time on the copy stream of the
    batches timed with CUDA events (one in 16 of the copy stream's batches; of small batches copied on
    the loop's stream, about one in 256), and ``timed_bytes`` what they copied, so
    ``h2d_GBps`` is the rate the link was fed at over that sample (a pageable batch's time spans its
    staging too). ``slot_batches`` counts the batches a DataLoader's workers collated into the
    prefetcher's pinned shared slots (``worker_slots``); ``loop_stream_batches`` the batches copied on the
    loop's own stream, where a copy takes less time than the copy stream's own calls would cost the loop.

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
    #: What the verdict judges: ``"cuda"`` (the GPU's waits) or ``"cpu"`` (the loop thread's).
    device: str = "cpu"
    #: ``CudaPrefetcher(measure=...)``: without it, no verdict.
    measure: bool = True
    #: ``"DataLoader"``, ``"SourceLoader"``, or the wrapped iterable's type; its ``num_workers``; the
    #: prefetcher's ``depth``: what the next step names.
    loader: str = ""
    num_workers: int = 0
    depth: int = 0
    waited_batches: int = 0
    waited_s: float = 0.0
    span_s: float = 0.0
    waited_fetch_s: float = 0.0
    waited_stage_s: float = 0.0
    waited_copy_s: float = 0.0
    _histogram: WaitHistogram = field(default_factory=WaitHistogram, repr=False, compare=False)
    #: Brings the GPU's figures up to date (reads the events the GPU has reached): a weak reference to the
    #: prefetcher's meter, set on CUDA.
    _refresh: weakref.WeakMethod[Callable[[], None]] | None = field(default=None, repr=False, compare=False)

    # -- figures -----------------------------------------------------------------------------------

    @property
    def stall_fraction(self) -> float:
        """The loop thread's time in ``next()`` over ``wall_s`` (on CUDA not the GPU's waits)."""
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def starved_fraction(self) -> float:
        """The share of the consumer's timeline spent waiting for data: the GPU's on CUDA, the loop
        thread's on the CPU (what the verdict judges)."""
        self._update()
        return self.waited_s / self.span_s if self.span_s > 0 else 0.0

    @property
    def step_us(self) -> float:
        """The consumer's time a batch that was not a wait for data (its step), in microseconds."""
        self._update()
        return (self.span_s - self.waited_s) / self.waited_batches * 1e6 if self.waited_batches else 0.0

    @property
    def burst_share(self) -> float:
        """The share of the waiting held by the tenth of the batches that waited longest."""
        return self._histogram.top_share(0.1)

    def wait_shares(self) -> dict[str, float]:
        """``waited_s`` split by stage: ``fetch``, ``stage``, ``copy`` and ``other`` (shares summing to 1)."""
        if self.waited_s <= 0:
            return {"fetch": 0.0, "stage": 0.0, "copy": 0.0, "other": 0.0}
        parts = {"fetch": self.waited_fetch_s, "stage": self.waited_stage_s, "copy": self.waited_copy_s}
        parts["other"] = max(0.0, self.waited_s - sum(parts.values()))
        return {k: v / self.waited_s for k, v in parts.items()}

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
        """The loop thread's own time per batch, outside ``next()``, in microseconds."""
        return (self.wall_s - self.wait_s) / self.batches * 1e6 if self.batches else 0.0

    @property
    def loop_did_work(self) -> bool:
        """Whether the loop did work between its batches: on the CPU, a step of more than ``EMPTY_LOOP_US``
        a batch; on CUDA, a loop thread busy for more than that outside ``next()``, or a GPU step of more
        than twice it. An empty loop waits for every batch by construction, and is not judged."""
        if self.device != "cuda":
            return self.step_us > EMPTY_LOOP_US
        return self.loop_us > EMPTY_LOOP_US or self.step_us > 2 * EMPTY_LOOP_US

    @property
    def input_bound(self) -> bool:
        return self.verdict().label == "INPUT-BOUND"

    def verdict(self) -> Verdict:
        """``(label, reason, next_step)``: a :class:`gpufeed.stats.Verdict`."""
        return judge(self)

    # -- counting ----------------------------------------------------------------------------------

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

    def mark(self) -> tuple[float, float, float]:
        """When the loop asks for a batch, with ``fetch_s`` and ``stage_s`` then (see :meth:`served`)."""
        return (time.perf_counter(), self.fetch_s, self.stage_s)

    def served(self, mark: tuple[float, float, float], last: float | None, judged: bool) -> float:
        """Count the time since ``mark`` as the loop's wait (``last``: when the loop got its previous batch),
        or as start-up for an epoch's first batch (``last`` None); ``judged``: on the CPU, a wait the verdict
        reads too (a batch handed over, a step following). Returns now, the next call's ``last``."""
        now = time.perf_counter()
        t0 = mark[0]
        if last is None:  # the pipeline starting up: not a wait of the training loop
            self.startup_s += now - t0
        else:
            self.wait_s += now - t0
            self.wall_s += now - last
            if judged:
                self.span_s += now - last
                self.waited(now - t0, fetch=self.fetch_s - mark[1], stage=self.stage_s - mark[2])
        return now

    def waited(self, seconds: float, *, fetch: float = 0.0, stage: float = 0.0, copy: float = 0.0) -> None:
        """Count one batch's wait for data (``fetch + stage + copy <= seconds``; the rest is gpufeed's)."""
        self.waited_batches += 1
        self.waited_s += seconds
        self.waited_fetch_s += fetch
        self.waited_stage_s += stage
        self.waited_copy_s += copy
        self._histogram.add(seconds)

    def _update(self) -> None:
        refresh = self._refresh() if self._refresh is not None else None
        if refresh is not None:
            refresh()

    # -- reading -----------------------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        """Every counter and the summary's figures, as plain ints, floats and strings (the verdict's
        ``verdict``, ``reason``, ``next_step`` and ``timeline``; drop the strings to log the rest with
        Lightning's ``self.log_dict`` or TensorBoard)."""
        self._update()
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name[0] != "_"}
        d.update(self._figures())
        return d

    def _figures(self) -> dict[str, Any]:
        v = self.verdict()
        shares = self.wait_shares()
        return {
            "verdict": v.label, "reason": v.reason, "next_step": v.next_step,
            "input_bound": int(v.label == "INPUT-BOUND"),
            "timeline": "gpu" if self.device == "cuda" else "loop thread",
            "starved_fraction": self.starved_fraction, "step_us": self.step_us, "loop_us": self.loop_us,
            "burst_share": self.burst_share, **{f"share_{k}": x for k, x in shares.items()},
            "stall_fraction": self.stall_fraction, "h2d_GBps": self.h2d_GBps, "stage_GBps": self.stage_GBps,
            "throughput_GBps": self.throughput_GBps,
        }

    def summary(self) -> str:
        """One line: the verdict, the waiting it rests on with its stages, the next step, then what the
        prefetcher moved; a figure that does not apply to the run (no staging, no H2D copy on the CPU) is
        left out."""
        f = self._figures()
        head = f"[{f['verdict']}: {f['reason']}]" if f["reason"] else f"[{f['verdict']}]"
        parts = [" ".join(filter(None, (head, self._waited_phrase(f))))]
        if f["next_step"]:
            parts.append(f"next step: {f['next_step']}")
        return "; ".join(parts) + ". " + self._moved_phrase(f)

    def _waited_phrase(self, f: dict[str, Any]) -> str:
        if not self.waited_batches:
            return ""
        who = "the GPU" if self.device == "cuda" else "the loop"
        where = "" if self.device == "cuda" else (
            "its thread's time in next(); a CPU run shows no GPU waits and no H2D copy; ")
        names = dict(_STAGE_NAMES, fetch="reads" if self.loader == "SourceLoader" else "loader")
        stages = ", ".join(f"{names[k]} {f[f'share_{k}']:.0%}" for k in names if f[f"share_{k}"] >= 0.005)
        return (f"{who} waited for data {f['starved_fraction']:.1%} of {self.span_s:.2f}s ({where}"
                f"{self.waited_batches} batches timed after start-up, step {f['step_us']:.0f} us a batch"
                + (f"; waits: {stages}" if stages else "") + ")")

    def _moved_phrase(self, f: dict[str, Any]) -> str:
        out = [f"{self.batches} batches, {self.bytes / 1e9:.2f} GB, {_rate(f['throughput_GBps'])} "
               f"delivered, start-up {self.startup_s:.2f}s, fetch {self.fetch_s:.2f}s"]
        if self.stage_s > 0:
            out.append(f"stage {self.stage_s:.2f}s ({_rate(f['stage_GBps'])})")
        if self.copy_s > 0:
            out.append(f"H2D {_rate(f['h2d_GBps'])} (timed batches)")
        if self.slot_batches:
            out.append(f"{self.slot_batches} collated into pinned slots")
        if self.loop_stream_batches:
            out.append(f"{self.loop_stream_batches} copied on the loop's stream")
        return "; ".join(out)

    def __str__(self) -> str:
        return self.summary()


def _rate(gbps: float) -> str:
    """A rate in GB/s, or in MB/s below 1 GB/s (a small run's ``40 MB/s``, not ``0.0 GB/s``)."""
    if gbps >= 1:
        return f"{gbps:.1f} GB/s"
    mbps = gbps * 1e3
    return f"{mbps:.0f} MB/s" if mbps >= 10 else f"{mbps:.2g} MB/s"
