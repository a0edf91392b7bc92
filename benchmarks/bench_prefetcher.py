"""Host-to-GPU batch delivery, four ways, against the pinned H2D ceiling of the same run.

Run it on the GPU machine, in one process (about a minute on an H100)::

    PYTHONPATH=src python benchmarks/bench_prefetcher.py         # benchmarks/results/prefetcher-<card>.*
    python benchmarks/bench_prefetcher.py --smoke                # tiny, on the CPU, a few seconds (CI)
    python benchmarks/bench_prefetcher.py --smoke --device cuda  # tiny, every CUDA path once

Every method reads the same pre-generated batches (a 4-tensor dict: ``x`` float32, ``y`` int64, ``mask``
bool, ``idx`` int32; ``--batch-mib`` in all), ``--batches`` distinct ones cycled over ``--iters`` steps:

* ``naive``: ``{k: v.to(device)}`` in the loop.
* ``pin_non_blocking``: ``v.pin_memory().to(device, non_blocking=True)`` in the loop.
* ``tutorial_prefetcher``: one batch ahead on a side stream, the apex ``data_prefetcher`` /
  torchtnt ``CudaDataPrefetcher`` pattern (``wait_stream`` + ``record_stream``).
* ``gpufeed``: ``CudaPrefetcher(loader, depth=--depth)``, one instance per workload.

Workloads: ``unpinned`` (pageable source tensors, nothing else in the loop), ``pinned`` (the same bytes in
pinned memory), ``unpinned_compute`` (a matmul loop on the default stream, calibrated to take 1.2x the
ceiling copy time of one batch, reads each batch) and ``unpinned_compute_sync`` (the same step, which then
reads one value back to the host, as a loop that logs ``loss.item()`` each step does).

Each method runs one warm-up epoch, which also checks every delivered batch against its source by an exact
checksum, then ``--reps`` timed epochs; each figure is the median over those epochs:

* ``GBps``: bytes delivered / wall time of the epoch (from ``iter()`` to a device synchronize after the loop).
* ``frac_of_ceiling``: ``GBps`` / the ceiling, i.e. copies of the same pinned tensors into preallocated
  device tensors, timed with CUDA events (row ``ceiling/pinned_h2d``; ``pinned_h2d_flat`` is one flat copy).
* ``step_over_compute`` (the compute workloads): wall time per step / compute-alone time per step (the
  step alone reads its value back too in ``unpinned_compute_sync``).
* ``wait_fraction``: time the consumer was blocked getting the next batch / wall. gpufeed: the delta of
  ``pf.stats.wait_s``; the others: host time of ``next()``, which includes their copy calls.
* ``wait_floor`` (the compute workloads): the least wait fraction of any method that sends each batch over
  the link (less a few batches of slack). A step that never waits for the GPU asks for a batch every
  ``own`` seconds of its own thread's time (median of its time outside ``next()`` per step); the link
  delivers one every ``copy_s`` (the ceiling's time per batch). When ``own < copy_s`` the training thread
  runs ahead of the link and waits ``copy_s - own`` per step somewhere: in ``next()``.
* ``consumer_us_per_batch``: CPU time of the consumer thread (``time.thread_time_ns``) in ``iter()`` and
  ``next()`` per batch, including the copies the baselines issue there. Blocking waits cost no CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by a test
from _common import card_name, pick_device, print_results, run_info, save_results, targets_table

try:
    import gpufeed  # noqa: F401  (installed; else the checkout's src/ below)
except ImportError:  # a checkout without an install: run the working tree's src/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpufeed import CudaPrefetcher

MiB = 1 << 20
KEYS = ("x", "y", "mask", "idx")
WORKLOADS = ("unpinned", "pinned", "unpinned_compute", "unpinned_compute_sync")
METHODS = ("naive", "pin_non_blocking", "tutorial_prefetcher", "gpufeed")
COMPUTE_OVER_COPY = 1.2
SLOW_S = 20.0  # a method whose timed epochs would take longer than this is timed once
# 256 steps an epoch: the ratios then show the steady state. Each epoch also pays its start-up (the first
# batch staged before the consumer has anything), 1-2% of a 64-step epoch; it is reported apart
# (first_batch_ms).
FULL = {"batch_mib": 64.0, "batches": 24, "iters": 256, "reps": 3}
SMOKE = {"batch_mib": 0.25, "batches": 4, "iters": 8, "reps": 1}

Batch = dict[str, torch.Tensor]


# -- configuration -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    device: torch.device
    batch_bytes: int
    batches: int
    iters: int
    reps: int
    depth: int
    chunk_mib: float | None
    out: Path
    profile: bool
    smoke: bool
    methods: tuple[str, ...] = METHODS

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="folder for prefetcher-<card>.json/.md (default: benchmarks/results)")
    p.add_argument("--batch-mib", type=float, help=f"bytes per batch in MiB (default {FULL['batch_mib']:g})")
    p.add_argument("--batches", type=int, help=f"distinct batches held in RAM (default {FULL['batches']})")
    p.add_argument("--iters", type=int, help=f"steps per timed epoch (default {FULL['iters']})")
    p.add_argument("--reps", type=int, help=f"timed epochs per method, median kept (default {FULL['reps']})")
    p.add_argument("--depth", type=int, default=3, help="gpufeed depth (default 3)")
    p.add_argument("--chunk-mib", type=float, help="gpufeed chunk_bytes in MiB (default: gpufeed's)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available; cpu with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU by default: checks the script runs")
    p.add_argument("--profile", action="store_true", help="also write a torch.profiler trace of gpufeed")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {', '.join(METHODS)} (default: all)")
    a = p.parse_args(argv)
    methods = tuple(m for m in METHODS if m in a.methods.split(","))
    if not methods or set(a.methods.split(",")) - set(METHODS):
        raise SystemExit(f"--methods: a comma-separated subset of {', '.join(METHODS)}, got {a.methods!r}")
    sizes = SMOKE if a.smoke else FULL
    pick = {k: sizes[k] if getattr(a, k) is None else getattr(a, k) for k in sizes}
    return Config(device=pick_device(a.device, a.smoke), batch_bytes=_batch_bytes(pick["batch_mib"]),
                  batches=_positive("batches", pick["batches"]), iters=_positive("iters", pick["iters"]),
                  reps=_positive("reps", pick["reps"]), depth=_positive("depth", a.depth),
                  chunk_mib=a.chunk_mib, out=a.out, profile=a.profile,
                  smoke=a.smoke, methods=methods)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise SystemExit(f"--{name} must be >= 1, got {value}")
    return value


def _batch_bytes(mib: float) -> int:
    nbytes = int(mib * MiB) // 256 * 256  # 256 bytes a row: x 60 float32, y int64, mask 4 bool, idx int32
    if nbytes < 256:
        raise SystemExit(f"--batch-mib must be at least 256 bytes (0.000245), got {mib}")
    return nbytes




# -- data ----------------------------------------------------------------------------------------------


def make_batches(n: int, batch_bytes: int) -> list[Batch]:
    """``n`` distinct batches of ``batch_bytes`` each, in pageable memory (x is 15/16 of the bytes)."""
    rows = batch_bytes // 256
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(rows, 60, generator=g)
    y0 = torch.randint(0, 1 << 40, (rows,), generator=g)
    m0 = torch.rand(rows, 4, generator=g) < 0.5
    return [{"x": x0 + i, "y": y0 + i, "mask": m0.roll(i, 0),
             "idx": torch.arange(i * rows, (i + 1) * rows, dtype=torch.int32)} for i in range(n)]


def pinned_copies(batches: list[Batch], cfg: Config) -> list[Batch]:
    if not cfg.cuda:  # no pinned memory without CUDA: the smoke run reuses the pageable batches
        return batches
    return [{k: v.pin_memory() for k, v in b.items()} for b in batches]


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Sum of the tensor's bytes as int32 words: exact, so equal on host and device."""
    words = t.reshape(-1).view(torch.uint8)
    if words.numel() % 4 == 0:
        words = words.view(torch.int32)
    return words.sum(dtype=torch.int64)


def batch_checksums(batch: Batch) -> list[int]:
    return torch.stack([checksum(batch[k]) for k in KEYS]).tolist()


class Cycle:
    """A re-iterable stand-in for a DataLoader: ``iters`` batches cycling over a fixed list."""

    def __init__(self, batches: list[Batch], iters: int) -> None:
        self.batches = batches
        self.iters = iters

    def __len__(self) -> int:
        return self.iters

    def __iter__(self) -> Iterator[Batch]:
        n = len(self.batches)
        return (dict(self.batches[i % n]) for i in range(self.iters))  # a fresh dict, as a collate makes


# -- timing helpers --------------------------------------------------------------------------------------


def sync(cfg: Config) -> None:
    if cfg.cuda:
        torch.cuda.synchronize(cfg.device)


@contextlib.contextmanager
def nvtx(name: str, cfg: Config) -> Iterator[None]:
    """An NVTX range (for nsys) on CUDA; nothing on the CPU, where NVTX may not exist."""
    if cfg.cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        if cfg.cuda:
            torch.cuda.nvtx.range_pop()


def timepick_device(fn: Callable[[], None], cfg: Config) -> float:
    """Median seconds of ``fn`` over ``cfg.reps`` runs: CUDA events on the current stream, else host time."""
    times = []
    for _ in range(cfg.reps):
        sync(cfg)
        if cfg.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- the ceiling -----------------------------------------------------------------------------------------


def measure_ceiling(pinned: list[Batch], cfg: Config) -> dict[str, float]:
    """Copies of the same pinned tensors into preallocated device tensors (one flat copy for reference)."""
    dst = {k: torch.empty_like(v, device=cfg.device) for k, v in pinned[0].items()}
    flat_src = torch.ones(cfg.batch_bytes, dtype=torch.uint8, pin_memory=cfg.cuda)
    flat_dst = torch.empty(cfg.batch_bytes, dtype=torch.uint8, device=cfg.device)

    def dict_copies() -> None:
        for i in range(cfg.iters):
            for k, v in pinned[i % len(pinned)].items():
                dst[k].copy_(v, non_blocking=True)

    def flat_copies() -> None:
        for _ in range(cfg.iters):
            flat_dst.copy_(flat_src, non_blocking=True)

    with nvtx("ceiling", cfg):
        dict_copies()  # warm-up
        flat_copies()
        nbytes = cfg.iters * cfg.batch_bytes
        gbps = nbytes / timepick_device(dict_copies, cfg) / 1e9
        flat = nbytes / timepick_device(flat_copies, cfg) / 1e9
    return {"GBps": gbps, "flat_GBps": flat, "copy_s_per_batch": cfg.batch_bytes / (gbps * 1e9)}


# -- the compute step ------------------------------------------------------------------------------------


class Compute:
    """A training step stand-in: ``k`` matmuls on the current (default) stream, then a read of the batch."""

    def __init__(self, cfg: Config, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = torch.randn(n, n, generator=g).to(cfg.device)
        self.b = torch.randn(n, n, generator=g).to(cfg.device)
        self.c = torch.empty(n, n, device=cfg.device)
        self.k = 1
        self.sync = False  # read one value back each step, as ``loss.item()`` does

    def __call__(self, batch: Batch) -> None:
        for _ in range(self.k):
            torch.mm(self.a, self.b, out=self.c)
        self.c[:1, :1].add_(batch["x"][:1, :1])  # the step reads the batch, so stream ordering matters
        if self.sync:
            self.c[0, 0].item()

    def synced(self) -> Compute:
        """The same step, reading one value back to the host at its end."""
        step = copy.copy(self)
        step.sync = True
        return step


def compute_alone(step: Compute, batch: Batch, cfg: Config) -> float:
    """Median wall seconds per step of ``cfg.iters`` steps with no data movement, ending with a sync."""
    times = []
    for _ in range(cfg.reps + 1):  # the first is a warm-up
        sync(cfg)
        t0 = time.perf_counter()
        for _ in range(cfg.iters):
            step(batch)
        sync(cfg)
        times.append((time.perf_counter() - t0) / cfg.iters)
    return statistics.median(times[1:])


def calibrate(batch: Batch, copy_s: float, cfg: Config) -> tuple[Compute, float]:
    """A Compute whose step alone takes COMPUTE_OVER_COPY x ``copy_s``, and that time per step."""
    target = COMPUTE_OVER_COPY * copy_s
    step = Compute(cfg, 1024 if cfg.cuda else 32)
    with nvtx("calibrate_compute", cfg):
        alone = compute_alone(step, batch, cfg)
        for _ in range(3):  # k from the time of one matmul, then corrections for the per-step overheads
            k = max(1, round(step.k * target / alone))
            if k == step.k:
                break
            step.k = k
            alone = compute_alone(step, batch, cfg)
        return step, alone


# -- the methods -----------------------------------------------------------------------------------------


def naive(source: Iterable[Batch], cfg: Config) -> Iterator[Batch]:
    return ({k: v.to(cfg.device) for k, v in b.items()} for b in source)


def pin_non_blocking(source: Iterable[Batch], cfg: Config) -> Iterator[Batch]:
    if not cfg.cuda:  # pin_memory() needs CUDA; on the CPU this is the naive loop
        return naive(source, cfg)
    return ({k: v.pin_memory().to(cfg.device, non_blocking=True) for k, v in b.items()} for b in source)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # one for the whole run: a stream per epoch grows reserved memory


class TutorialPrefetcher:
    """One batch ahead on a side stream, like apex ``data_prefetcher`` and torchtnt ``CudaDataPrefetcher``."""

    def __init__(self, source: Iterable[Batch], cfg: Config) -> None:
        self._it = iter(source)
        self._device = cfg.device
        self._stream = _side_stream(cfg.device) if cfg.cuda else None
        self._next: Batch | None = None
        self._preload()

    def _preload(self) -> None:
        batch = next(self._it, None)
        if batch is None or self._stream is None:
            self._next = batch
            return
        with torch.cuda.stream(self._stream):
            self._next = {k: v.to(self._device, non_blocking=True) for k, v in batch.items()}

    def __iter__(self) -> TutorialPrefetcher:
        return self

    def __next__(self) -> Batch:
        batch = self._next
        if batch is None:
            raise StopIteration
        if self._stream is not None:
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_stream(self._stream)
            for t in batch.values():
                t.record_stream(consumer)
        self._preload()
        return batch


class Method:
    """One way to deliver batches; ``epoch()`` gives the iterable for one pass over the source."""

    def __init__(self, name: str, source: Cycle, cfg: Config) -> None:
        self.name = name
        self.pf: CudaPrefetcher | None = None
        if name == "gpufeed":
            kw = {}
            if cfg.chunk_mib is not None:
                kw["chunk_bytes"] = int(cfg.chunk_mib * MiB)
            self.pf = CudaPrefetcher(source, device=cfg.device, depth=cfg.depth, **kw)
        self._epoch: Callable[[], Iterable[Batch]] = {
            "naive": lambda: naive(source, cfg),
            "pin_non_blocking": lambda: pin_non_blocking(source, cfg),
            "tutorial_prefetcher": lambda: TutorialPrefetcher(source, cfg),
            "gpufeed": lambda: self.pf,
        }[name]

    def epoch(self) -> Iterable[Batch]:
        return self._epoch()

    def stats(self) -> tuple[int, float] | None:
        """gpufeed's (batches, wait_s) counters, which cover the prefetcher's whole life."""
        if self.pf is None:
            return None
        return self.pf.stats.batches, self.pf.stats.wait_s

    def stats_dict(self) -> dict[str, float] | None:
        """gpufeed's own counters over warm-up and timed epochs (stage and H2D rates), for diagnosis."""
        as_dict = getattr(getattr(self.pf, "stats", None), "as_dict", None)
        return as_dict() if as_dict is not None else None

    def close(self) -> None:
        if self.pf is not None:
            self.pf.close()


# -- one epoch, one method -------------------------------------------------------------------------------


@dataclass
class Epoch:
    wall_s: float
    batches: int
    wait_s: float  # host time in iter()/next(), copies of the baselines included
    cpu_s: float  # consumer thread CPU time in iter()/next()
    first_s: float  # from iter() to the first batch in hand: the pipeline fill, part of wall_s
    stats_wait_s: float | None = None  # gpufeed's own count, for this epoch
    loop_s: float = 0.0  # from iter() to the loop's end, before the device synchronize


class _Probe:
    """Accumulates the wall and thread-CPU time of the calls it makes."""

    def __init__(self) -> None:
        self.wall_ns = self.cpu_ns = 0

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            self.wall_ns += time.perf_counter_ns() - w0
            self.cpu_ns += time.thread_time_ns() - c0


def run_epoch(method: Method, step: Callable[[Batch], Any], cfg: Config) -> Epoch:
    before = method.stats()
    sync(cfg)
    t0 = time.perf_counter()
    probe, n = _Probe(), 0
    it = probe.call(lambda: iter(method.epoch()))  # the tutorial prefetcher copies its first batch here
    first = None
    while (batch := probe.call(next, it, None)) is not None:
        first = time.perf_counter() - t0 if first is None else first
        step(batch)
        n += 1
    del batch, it
    loop = time.perf_counter() - t0
    sync(cfg)
    wall = time.perf_counter() - t0
    stats_wait = _stats_wait(before, method.stats(), n)
    return Epoch(wall, n, probe.wall_ns / 1e9, probe.cpu_ns / 1e9, first or 0.0, stats_wait, loop)


def _stats_wait(before: tuple[int, float] | None, after: tuple[int, float] | None, n: int) -> float | None:
    if before is None or after is None:
        return None
    if after[0] >= before[0] + n:  # cumulative counters: this epoch is the difference
        return after[1] - before[1]
    return after[1]  # counters reset per epoch


class Checker:
    """A step that records each delivered batch's checksums, to compare with the source's in order."""

    def __init__(self, then: Callable[[Batch], Any]) -> None:
        self.then = then
        self.seen: list[list[int]] = []

    def __call__(self, batch: Batch) -> None:
        self.then(batch)
        self.seen.append(batch_checksums(batch))


def measure(method: Method, step: Callable[[Batch], Any], expected: list[list[int]], cfg: Config
            ) -> tuple[list[Epoch], bool]:
    """A checked warm-up epoch, then ``cfg.reps`` timed ones."""
    checker = Checker(step)
    with nvtx("warmup", cfg):
        warm = run_epoch(method, checker, cfg)
    ok = checker.seen == [expected[i % len(expected)] for i in range(cfg.iters)]
    reps = cfg.reps if warm.wall_s * cfg.reps < SLOW_S else 1  # a pathologically slow method: time it once
    epochs = []
    for r in range(reps):
        with nvtx(f"rep{r}", cfg):
            epochs.append(run_epoch(method, step, cfg))
    for e in epochs:
        if e.batches != cfg.iters:
            raise RuntimeError(f"{method.name} delivered {e.batches} batches in an epoch, not {cfg.iters}")
    return epochs, ok


def summarize(workload: str, name: str, epochs: list[Epoch], ok: bool, ctx: dict[str, Any]) -> dict[str, Any]:
    med = statistics.median
    gbps = [e.batches * ctx["batch_bytes"] / e.wall_s / 1e9 for e in epochs]
    row: dict[str, Any] = {"workload": workload, "method": name, "GBps": med(gbps),
                           "frac_of_ceiling": med(gbps) / ctx["ceiling_GBps"]}
    if ctx.get("compute_s") is not None:
        row["step_over_compute"] = med(e.wall_s / e.batches for e in epochs) / ctx["compute_s"]
        copy_s = ctx["batch_bytes"] / (ctx["ceiling_GBps"] * 1e9)
        own = med((e.loop_s - e.wait_s) / e.batches for e in epochs)  # the step's own time per batch
        row.update(wait_floor=max(0.0, copy_s - own) / med(e.wall_s / e.batches for e in epochs),
                   step_own_us=own * 1e6)
    host_wait = med(e.wait_s / e.wall_s for e in epochs)
    if epochs[0].stats_wait_s is not None:
        row.update(wait_fraction=med(e.stats_wait_s / e.wall_s for e in epochs), wait_source="pf.stats",
                   wait_fraction_host=host_wait)
    else:
        row.update(wait_fraction=host_wait, wait_source="host timer around next()")
    row.update(consumer_us_per_batch=med(e.cpu_s * 1e6 / e.batches for e in epochs), verified=ok,
               first_batch_ms=med(e.first_s * 1e3 for e in epochs), GBps_reps=[round(g, 3) for g in gbps])
    if ctx["smoke"] is False and len(epochs) == 1 and ctx["reps"] > 1:
        row["note"] = f"slow: timed once, not {ctx['reps']} times"
    return row


# -- the whole run ---------------------------------------------------------------------------------------


def run_workload(workload: str, batches: list[Batch], expected: list[list[int]], step: Callable[[Batch], Any],
                 ctx: dict[str, Any], cfg: Config) -> list[dict[str, Any]]:
    rows = []
    for name in cfg.methods:
        with nvtx(f"{workload}/{name}", cfg):
            rows.append(_run_method(workload, name, Cycle(batches, cfg.iters), step, expected, ctx, cfg))
        print(_progress(rows[-1]), flush=True)
    return rows


def _run_method(workload: str, name: str, source: Cycle, step: Callable[[Batch], Any],
                expected: list[list[int]], ctx: dict[str, Any], cfg: Config) -> dict[str, Any]:
    method = None
    try:
        method = Method(name, source, cfg)
        epochs, ok = measure(method, step, expected, cfg)
        row = summarize(workload, name, epochs, ok, ctx)
        if method.pf is not None:
            row["gpufeed_stats"] = method.stats_dict()
        return row
    except Exception as exc:  # keep the other rows of a scarce GPU run; the row says what failed
        traceback.print_exc()
        return {"workload": workload, "method": name, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        try:
            if method is not None:
                method.close()
        except Exception:  # reported, but the run goes on
            traceback.print_exc()


def _progress(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"  {row['workload']:>16} {row['method']:>20}  ERROR {row['error']}"
    return (f"  {row['workload']:>16} {row['method']:>20} {row['GBps']:7.2f} GB/s "
            f"{row['frac_of_ceiling']:6.1%} of ceiling, wait {row['wait_fraction']:6.1%}, "
            f"{row['consumer_us_per_batch']:8.1f} us/batch"
            + (f", step/compute {row['step_over_compute']:.3f}" if "step_over_compute" in row else "")
            + ("" if row["verified"] else "  NOT VERIFIED"))


def run(cfg: Config) -> dict[str, Any]:
    """Every measurement of the benchmark; returns the JSON document."""
    if cfg.cuda:
        torch.cuda.init()
    unpinned = make_batches(cfg.batches, cfg.batch_bytes)
    expected = [batch_checksums(b) for b in unpinned]
    pinned = pinned_copies(unpinned, cfg)
    ceiling = measure_ceiling(pinned, cfg)
    print(f"ceiling: {ceiling['GBps']:.2f} GB/s (flat copy {ceiling['flat_GBps']:.2f} GB/s)", flush=True)
    ctx: dict[str, Any] = {"batch_bytes": cfg.batch_bytes, "ceiling_GBps": ceiling["GBps"], "reps": cfg.reps,
                           "smoke": cfg.smoke}
    rows = [ceiling_row("pinned_h2d", ceiling["GBps"], ceiling),
            ceiling_row("pinned_h2d_flat", ceiling["flat_GBps"], ceiling)]
    rows += run_workload("unpinned", unpinned, expected, lambda b: None, ctx, cfg)
    rows += run_workload("pinned", pinned, expected, lambda b: None, ctx, cfg)
    del pinned
    on_device = {k: v.to(cfg.device) for k, v in unpinned[0].items()}
    step, compute_s = calibrate(on_device, ceiling["copy_s_per_batch"], cfg)
    print(f"compute: {compute_s * 1e3:.3f} ms/step alone ({step.k} matmuls), "
          f"{compute_s / ceiling['copy_s_per_batch']:.2f}x the ceiling copy of one batch", flush=True)
    rows += run_workload("unpinned_compute", unpinned, expected, step, dict(ctx, compute_s=compute_s), cfg)
    synced = step.synced()
    sync_s = compute_alone(synced, on_device, cfg)
    print(f"compute with a value read back each step: {sync_s * 1e3:.3f} ms/step alone", flush=True)
    rows += run_workload("unpinned_compute_sync", unpinned, expected, synced, dict(ctx, compute_s=sync_s),
                         cfg)
    doc = document(cfg, rows, ceiling, step, compute_s)
    doc["compute"]["alone_s_per_step_sync"] = sync_s
    write(doc, cfg)  # before profiling, so that a profiler crash cannot lose the timings
    if cfg.profile:
        doc["trace"] = profile_gpufeed(unpinned, step, cfg)
        write(doc, cfg)
    return doc


def ceiling_row(method: str, gbps: float, ceiling: dict[str, float]) -> dict[str, Any]:
    return {"workload": "ceiling", "method": method, "GBps": gbps, "frac_of_ceiling": gbps / ceiling["GBps"]}


def document(cfg: Config, rows: list[dict[str, Any]], ceiling: dict[str, float], step: Compute,
             compute_s: float) -> dict[str, Any]:
    return {
        **run_info(cfg.device, cfg.smoke),
        "pinned_source": cfg.cuda,  # without CUDA the "pinned" workload reuses pageable tensors
        "batch_bytes": cfg.batch_bytes,
        "batch_keys": {"x": "float32", "y": "int64", "mask": "bool", "idx": "int32"},
        "batches": cfg.batches,
        "iters": cfg.iters,
        "reps": cfg.reps,
        "depth": cfg.depth,
        "chunk_mib": cfg.chunk_mib,
        "ceiling": ceiling,
        "compute": {"matmul_n": step.a.shape[0], "matmuls_per_step": step.k, "alone_s_per_step": compute_s,
                    "over_ceiling_copy": compute_s / ceiling["copy_s_per_batch"]},
        "rows": rows,
        "targets": check_targets(rows),
    }


def write(doc: dict[str, Any], cfg: Config) -> Path:
    """``prefetcher-<card>.json`` and ``.md`` in ``cfg.out``; returns the path without suffix."""
    return save_results(cfg.out, "prefetcher", doc, markdown(doc))


# -- targets and reporting -------------------------------------------------------------------------------

TARGETS = (  # (what, workload, key, comparison, bound) for the gpufeed rows
    ("unpinned >= 80% of ceiling", "unpinned", "frac_of_ceiling", ">=", 0.80),
    ("pinned >= 97% of ceiling", "pinned", "frac_of_ceiling", ">=", 0.97),
    ("step <= 1.03x compute", "unpinned_compute", "step_over_compute", "<=", 1.03),
    ("consumer wait < 3% with compute", "unpinned_compute", "wait_fraction", "<", 0.03),
    ("step <= 1.03x compute (value read each step)", "unpinned_compute_sync", "step_over_compute", "<=",
     1.03),
    ("consumer wait < 3% (value read each step)", "unpinned_compute_sync", "wait_fraction", "<", 0.03),
    ("consumer <= 50 us/batch (unpinned)", "unpinned", "consumer_us_per_batch", "<=", 50.0),
    ("consumer <= 50 us/batch (pinned)", "pinned", "consumer_us_per_batch", "<=", 50.0),
    ("consumer <= 50 us/batch (compute)", "unpinned_compute", "consumer_us_per_batch", "<=", 50.0),
    ("consumer <= 50 us/batch (value read each step)", "unpinned_compute_sync", "consumer_us_per_batch", "<=",
     50.0),
)
_CMP = {">=": float.__ge__, "<=": float.__le__, "<": float.__lt__}


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    gf = {r["workload"]: r for r in rows if r["method"] == "gpufeed"}
    out = []
    for what, workload, key, op, bound in TARGETS:
        value = gf.get(workload, {}).get(key)
        met = value is not None and bool(gf[workload].get("verified")) and _CMP[op](float(value), bound)
        out.append({"target": f"gpufeed {what}", "value": value, "met": met})
    return out


def markdown(doc: dict[str, Any]) -> str:
    c = doc["ceiling"]
    how = "pinned copies of the same tensors, CUDA events" if doc["device"] == "cuda" else "host copies"
    lines = [
        f"# gpufeed prefetcher benchmark: {doc['card']}", "",
        f"torch {doc['torch']}, {doc['batch_bytes'] / MiB:g} MiB batches (dict of x float32, y int64, "
        f"mask bool, idx int32), {doc['batches']} distinct batches cycled over {doc['iters']} steps, "
        f"median of {doc['reps']} timed epochs after a checked warm-up, gpufeed depth {doc['depth']}."
        + (" Smoke run: sizes too small to mean anything." if doc["smoke"] else ""), "",
        f"Ceiling ({how}): {c['GBps']:.2f} GB/s; one flat copy "
        f"{c['flat_GBps']:.2f} GB/s. Compute step alone: {doc['compute']['alone_s_per_step'] * 1e3:.3f} ms "
        f"({doc['compute']['over_ceiling_copy']:.2f}x the ceiling copy of one batch); reading a value back "
        f"each step: {doc['compute'].get('alone_s_per_step_sync', float('nan')) * 1e3:.3f} ms.", "",
        "Wait floor (compute workloads): the least wait fraction of any method that sends each batch over "
        "the link, from the step's own time per batch outside `next()` (step own us) and the ceiling's time "
        "per batch: a step that never waits for the GPU runs ahead of the link and waits in `next()`.", "",
        "| workload | method | GB/s | of ceiling | step / compute | wait | wait floor | step own us | "
        "consumer us/batch |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [_md_row(r) for r in doc["rows"]]
    lines += ["", *targets_table(doc["targets"])]
    return "\n".join(lines) + "\n"


def _md_row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['workload']} | {r['method']} | error: {r['error']} | | | | | | |"
    flag = "" if r.get("verified", True) else " (WRONG DATA)"
    return (f"| {r['workload']} | {r['method']}{flag} | {r['GBps']:.2f} | {r['frac_of_ceiling']:.1%} | "
            f"{_fmt(r.get('step_over_compute'), '.3f')} | {_fmt(r.get('wait_fraction'), '.1%')} | "
            f"{_fmt(r.get('wait_floor'), '.1%')} | {_fmt(r.get('step_own_us'), '.0f')} | "
            f"{_fmt(r.get('consumer_us_per_batch'), '.1f')} |")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def profile_gpufeed(batches: list[Batch], step: Compute, cfg: Config) -> str | None:
    """One epoch of gpufeed per workload under torch.profiler, as a chrome trace beside the results."""
    from torch.profiler import ProfilerActivity, profile, record_function

    path = cfg.out / f"prefetcher-{card_name(cfg.device)}-gpufeed-trace.json"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.cuda else [])
    work = {"unpinned": (batches, lambda b: None), "unpinned_compute": (batches, step),
            "pinned": (pinned_copies(batches[:4], cfg), lambda b: None)}
    methods: dict[str, Method] = {}
    try:
        for w, (b, _) in work.items():
            methods[w] = Method("gpufeed", Cycle(b, cfg.iters), cfg)
            run_epoch(methods[w], work[w][1], cfg)  # warm-up, outside the trace
        with profile(activities=activities) as prof:
            for w, m in methods.items():
                with record_function(f"gpufeed/{w}"):
                    run_epoch(m, work[w][1], cfg)
        prof.export_chrome_trace(str(path))
        return path.name
    except Exception:  # a profiler problem must not lose the timings of the run
        traceback.print_exc()
        return None
    finally:
        for m in methods.values():
            m.close()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    print(f"gpufeed prefetcher benchmark on {cfg.device} ({card_name(cfg.device)}), "
          f"torch {torch.__version__}, {cfg.batch_bytes / MiB:g} MiB x {cfg.batches} batches, "
          f"{cfg.iters} steps x {cfg.reps} reps", flush=True)
    doc = run(cfg)
    stem = cfg.out / f"prefetcher-{doc['card']}"  # written by run()
    print_results(doc, stem, markdown(doc), " (smoke run: not meaningful)" if cfg.smoke else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
