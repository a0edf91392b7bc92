"""Grid benchmark: every batch shape, host memory and loop, gpufeed beside the peers users run today.

Run it on the GPU machine, in one process (about 5 minutes on an H100)::

    PYTHONPATH=src python benchmarks/bench_grid.py          # benchmarks/results/grid-<card>.{json,md,png}
    python benchmarks/bench_grid.py --smoke                 # tiny, on the CPU, seconds (CI)

A cell is one batch size (``--sizes``, MiB), number of tensors per batch (``--tensors``), host memory
(``--memory``: pageable, or pinned with ``pin_memory=True``) and loop (``--loops``). Each batch is a dict
``{"t0": ..., "t{j}": ...}`` of float32 tensors whose bytes sum to the batch size. A pool of distinct
batches (``--pool-mib``, at least 2 batches) is made per (size, tensors, memory), so that the CPU caches
cannot serve them; an epoch is a plain list of ``--epoch-mib`` of them (at least ``--min-batches``) cycling
the pool, re-iterable as a DataLoader is.

Loops:

* ``none``: the loop body does nothing with the batch.
* ``compute``: each step sleeps on the GPU (``torch.cuda._sleep``, calibrated with CUDA events) 1.2x the
  batch's copy time at the ceiling, then reads the batch (``acc += x.view(-1)[:1].sum()``).
* ``sync``: the compute step, then ``acc.item()``, as a loop logging ``loss.item()`` does.

Methods (rows; the training thread iterates each):

* ``to``: ``{k: v.to(device)}`` in the loop.
* ``pin_nb``: ``{k: v.pin_memory().to(device, non_blocking=True)}`` in the loop.
* ``side1``: NVIDIA apex's ``data_prefetcher``: one batch ahead on a side stream made per iterator,
  ``wait_stream`` + ``record_stream`` in ``__next__``.
* ``tnt``: torchtnt's ``CudaDataPrefetcher``: a new side stream at every ``iter()``, 2 batches copied ahead
  from the training thread.
* ``spdl``: SPDL's transfer stage: a background thread that pins, copies on its own stream, synchronizes
  it and hands the batch over a bounded queue (2).
* ``gpufeed`` (two rows): ``CudaPrefetcher(epoch, depth=--depth)`` built once and iterated every epoch
  (reuse ``once``), and one built per epoch (reuse ``per_epoch``).

Each measurement: a warm-up (the first ``--warmup-frac`` of an epoch's batches, at least ``--min-batches``;
``--warmup-frac 1`` for a whole epoch), then ``--reps`` timed epochs (a device synchronize before and after,
wall time), the fastest kept; where the warm-up foretells an epoch longer than ``--slow-s`` (1 s: the
per-batch bound cells of small tensors), one timed epoch (the row's ``reps``). This keeps the default grid
near 5 minutes on an H100. ``GBps``: epoch bytes / seconds; ``frac_of_ceiling``: over a warm pinned
copy of 256 MiB into device memory (median of 10, CUDA events); ``consumer_us``: CPU time of the training
thread (``time.thread_time``) in ``iter()`` and ``next()`` of the method per batch (the copies of ``to``
and ``pin_nb`` are made there; a per-epoch gpufeed's construction and close count too);
``step_over_compute`` (compute and sync loops): seconds per step over those of the same loop over one batch
already in VRAM (the ideal), in the steady state: from the end of the first step to the end of the last on
the device (CUDA events on the loop's stream), so the first batch's copy, which nothing can overlap, is not
a step (``first_ms``: the time to the first batch in the loop's hands). Every epoch checks the first tensor
of its first and last batch against the host's (``verified``).

Targets, per cell, for gpufeed (reuse ``once``; ``per_epoch`` reported too): a rate >= 0.97x the best peer,
>= 90% of the ceiling for batches of 8 MiB or more in the ``none`` loop (in the compute and sync loops the
step, 1.2x the copy, caps the rate at 83% of the ceiling), a step <= 1.03x the ideal in compute and sync
loops, and <= 50 us of the training thread's CPU per batch.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import queue
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by a test
from _common import card_name, pick_device, run_info, save_results, targets_table

try:
    import gpufeed  # noqa: F401  (installed; else the checkout's src/ below)
except ImportError:  # a checkout without an install: run the working tree's src/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpufeed import CudaPrefetcher

MiB = 1 << 20
METHODS = ("to", "pin_nb", "side1", "tnt", "spdl", "gpufeed")
PEERS = ("to", "pin_nb", "side1", "tnt", "spdl")
ROWS = (("to", None), ("pin_nb", None), ("side1", "per_epoch"), ("tnt", "per_epoch"),
        ("spdl", "per_epoch"), ("gpufeed", "once"), ("gpufeed", "per_epoch"))
LOOPS = ("none", "compute", "sync")
MEMORY = ("pageable", "pinned")
COMPUTE_OVER_COPY = 1.2
CEILING_BYTES = 256 * MiB
FULL = {"sizes": "0.25,2,8,64,256", "tensors": "1,4,32", "memory": "pageable,pinned",
        "loops": "none,compute,sync", "epoch_mib": 512.0, "pool_mib": 512.0, "min_batches": 8, "reps": 2,
        "warmup_frac": 0.25, "slow_s": 1.0}
SMOKE = {"sizes": "0.25,1", "tensors": "1,4", "memory": "pageable,pinned", "loops": "none,compute,sync",
         "epoch_mib": 4.0, "pool_mib": 8.0, "min_batches": 8, "reps": 1, "warmup_frac": 0.25, "slow_s": 1.0}

Batch = dict[str, torch.Tensor]


# -- configuration -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    device: torch.device
    sizes: tuple[float, ...]
    tensors: tuple[int, ...]
    memory: tuple[str, ...]
    loops: tuple[str, ...]
    methods: tuple[str, ...]
    epoch_bytes: int
    pool_bytes: int
    min_batches: int
    reps: int
    warmup_frac: float
    slow_s: float
    depth: int
    out: Path
    smoke: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def rows(self) -> tuple[tuple[str, str | None], ...]:
        return tuple(r for r in ROWS if r[0] in self.methods)


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="folder for grid-<card>.json/.md/.png (default: benchmarks/results)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available; cpu with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU by default: checks the script runs")
    p.add_argument("--sizes", help=f"batch sizes in MiB, comma-separated (default {FULL['sizes']})")
    p.add_argument("--tensors", help=f"tensors per batch, comma-separated (default {FULL['tensors']})")
    p.add_argument("--memory", help=f"host memory of the batches (default {FULL['memory']})")
    p.add_argument("--loops", help=f"training loops (default {FULL['loops']})")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {', '.join(METHODS)} (default: all)")
    p.add_argument("--epoch-mib", type=float,
                   help=f"bytes per timed epoch in MiB (default {FULL['epoch_mib']:g})")
    p.add_argument("--pool-mib", type=float,
                   help=f"bytes of distinct batches per cell in MiB (default {FULL['pool_mib']:g})")
    p.add_argument("--min-batches", type=int, help=f"least batches an epoch (default {FULL['min_batches']})")
    p.add_argument("--reps", type=int,
                   help=f"timed epochs per measurement, fastest kept (default {FULL['reps']})")
    p.add_argument("--warmup-frac", type=float,
                   help="the warm-up epoch's share of an epoch's batches, at least --min-batches; 1: a whole "
                        f"epoch (default {FULL['warmup_frac']:g})")
    p.add_argument("--slow-s", type=float,
                   help="a measurement whose warm-up foretells an epoch longer than this many seconds is "
                        f"timed once, not --reps times; 0: never (default {FULL['slow_s']:g})")
    p.add_argument("--depth", type=int, default=2, help="gpufeed depth (default 2)")
    a = p.parse_args(argv)
    base = SMOKE if a.smoke else FULL
    pick = {k: base[k] if getattr(a, k) is None else getattr(a, k) for k in base}
    methods = tuple(m for m in METHODS if m in a.methods.split(","))
    if not methods or set(a.methods.split(",")) - set(METHODS):
        raise SystemExit(f"--methods: a comma-separated subset of {', '.join(METHODS)}, got {a.methods!r}")
    return Config(
        device=pick_device(a.device, a.smoke),
        sizes=tuple(_positive("sizes", float(s)) for s in _split(pick["sizes"])),
        tensors=tuple(_positive("tensors", int(s)) for s in _split(pick["tensors"])),
        memory=_choices("memory", pick["memory"], MEMORY),
        loops=_choices("loops", pick["loops"], LOOPS),
        methods=methods,
        epoch_bytes=int(_positive("epoch-mib", pick["epoch_mib"]) * MiB),
        pool_bytes=int(_positive("pool-mib", pick["pool_mib"]) * MiB),
        min_batches=_positive("min-batches", pick["min_batches"]),
        reps=_positive("reps", pick["reps"]),
        warmup_frac=min(1.0, _positive("warmup-frac", pick["warmup_frac"])),
        slow_s=max(0.0, pick["slow_s"]),
        depth=_positive("depth", a.depth),
        out=a.out,
        smoke=a.smoke,
    )


def _split(text: str) -> list[str]:
    return [s.strip() for s in str(text).split(",") if s.strip()]


def _positive(name: str, value: Any) -> Any:
    if value <= 0:
        raise SystemExit(f"--{name} must be > 0, got {value}")
    return value


def _choices(name: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    picked = _split(text)
    if not picked or set(picked) - set(allowed):
        raise SystemExit(f"--{name}: a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return tuple(x for x in allowed if x in picked)


# -- helpers shared with bench_resnet: batches of any nesting ---------------------------------------------


def to_device(batch: Any, device: torch.device, non_blocking: bool = False, pin: bool = False) -> Any:
    """The batch with every tensor copied to ``device`` (pinned first with ``pin``); dicts, lists, tuples."""
    if isinstance(batch, torch.Tensor):
        if pin:
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        if pin:
            return {k: v.pin_memory().to(device, non_blocking=non_blocking) for k, v in batch.items()}
        return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking, pin) for v in batch)
    return batch


def leaves(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of the batch."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from leaves(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from leaves(v)


def record(batch: Any, stream: torch.cuda.Stream) -> None:
    """``record_stream`` of every device tensor of the batch: its memory waits for ``stream``'s work."""
    for t in leaves(batch):
        if t.is_cuda:
            t.record_stream(stream)


# -- the peers ---------------------------------------------------------------------------------------------


class SideOne:
    """NVIDIA apex ``data_prefetcher``: one batch ahead on a side stream made per iterator."""

    def __init__(self, source: Iterable[Any], device: torch.device) -> None:
        self._it = iter(source)
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._end = False
        self._next: Any = None
        self._preload()

    def _preload(self) -> None:
        try:
            batch = next(self._it)
        except StopIteration:
            self._end, self._next = True, None
            return
        if self._stream is None:
            self._next = to_device(batch, self._device)
            return
        with torch.cuda.stream(self._stream):
            self._next = to_device(batch, self._device, non_blocking=True)

    def __iter__(self) -> SideOne:
        return self

    def __next__(self) -> Any:
        if self._end:
            raise StopIteration
        batch = self._next
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._stream)
            record(batch, current)
        self._preload()
        return batch


class TntPrefetcher:
    """torchtnt's ``CudaDataPrefetcher``: a new side stream at every ``iter()``, ``num_prefetch_batches``
    copied ahead from the training thread, ``wait_stream`` + ``record_stream`` in ``__next__``."""

    def __init__(self, source: Iterable[Any], device: torch.device, num_prefetch_batches: int = 2) -> None:
        self.source = source
        self.device = device
        self.num_prefetch_batches = num_prefetch_batches
        self._stream: torch.cuda.Stream | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=num_prefetch_batches)
        self._it: Iterator[Any] | None = None
        self._prefetched = False

    def __iter__(self) -> TntPrefetcher:
        self._it = iter(self.source)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queue = queue.Queue(maxsize=self.num_prefetch_batches)
        self._prefetched = False
        return self

    def _fetch_next(self) -> None:
        assert self._it is not None
        try:
            batch = next(self._it)
        except StopIteration:
            return
        if self._stream is None:
            self._queue.put(to_device(batch, self.device))
            return
        with torch.cuda.stream(self._stream):
            self._queue.put(to_device(batch, self.device, non_blocking=True))

    def __next__(self) -> Any:
        if not self._prefetched:
            for _ in range(self.num_prefetch_batches):
                self._fetch_next()
            self._prefetched = True
        if self._queue.empty():
            raise StopIteration
        batch = self._queue.get()
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            record(batch, current)
        self._fetch_next()
        return batch


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class SpdlTransfer:
    """SPDL's transfer stage: a background thread pins each batch and copies it on a stream of its own,
    synchronizes that stream, ``record_stream``-s it for the consumer's and puts it on a bounded queue."""

    def __init__(self, source: Iterable[Any], device: torch.device, pin: bool, maxsize: int = 2) -> None:
        self.source = source
        self.device = device
        self.pin = pin and device.type == "cuda"
        self.maxsize = maxsize
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __iter__(self) -> SpdlTransfer:
        self.close()
        self._queue = queue.Queue(maxsize=self.maxsize)
        self._stop = threading.Event()
        consumer = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, args=(self._queue, self._stop, consumer),
                                        name="spdl-transfer", daemon=True)
        self._thread.start()
        return self

    def _run(self, q: queue.Queue, stop: threading.Event, consumer: torch.cuda.Stream | None) -> None:
        try:
            stream = None
            if consumer is not None:
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
            for batch in self.source:
                if stop.is_set():
                    return
                if stream is None:
                    out = to_device(batch, self.device)
                else:
                    with torch.cuda.stream(stream):
                        out = to_device(batch, self.device, non_blocking=True, pin=self.pin)
                    stream.synchronize()
                    record(out, consumer)
                if not self._put(q, stop, out):
                    return
            self._put(q, stop, _END)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(q, stop, _Failure(exc))

    @staticmethod
    def _put(q: queue.Queue, stop: threading.Event, item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread (it may be blocked on a full queue) and join it."""
        if self._thread is None:
            return
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join()
        self._thread = None


# -- the methods, as the grid runs them --------------------------------------------------------------------


class Runner:
    """One row: ``start()`` gives one epoch's iterator, ``end()`` closes what the epoch made."""

    def __init__(self, method: str, reuse: str | None, epoch: list[Batch], cfg: Config) -> None:
        self.method, self.reuse, self.epoch, self.cfg = method, reuse, epoch, cfg
        self.pf: CudaPrefetcher | None = None
        self._live: Any = None
        if method == "gpufeed" and reuse == "once":
            self.pf = CudaPrefetcher(epoch, device=cfg.device, depth=cfg.depth)

    def start(self) -> Iterator[Any]:
        dev, cuda = self.cfg.device, self.cfg.cuda
        m = self.method
        if m == "to":
            return ({k: v.to(dev) for k, v in b.items()} for b in self.epoch)
        if m == "pin_nb":
            if not cuda:  # no pinned memory without CUDA
                return ({k: v.to(dev, non_blocking=True) for k, v in b.items()} for b in self.epoch)
            return ({k: v.pin_memory().to(dev, non_blocking=True) for k, v in b.items()} for b in self.epoch)
        if m == "side1":
            return SideOne(self.epoch, dev)
        if m == "tnt":
            return iter(TntPrefetcher(self.epoch, dev, num_prefetch_batches=2))
        if m == "spdl":
            self._live = SpdlTransfer(self.epoch, dev, pin=True)
            return iter(self._live)
        if self.reuse == "once":
            assert self.pf is not None
            return iter(self.pf)
        self._live = CudaPrefetcher(self.epoch, device=dev, depth=self.cfg.depth)
        return iter(self._live)

    def end(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.close()

    def close(self) -> None:
        self.end()
        if self.pf is not None:
            self.pf.close()
            self.pf = None


# -- data --------------------------------------------------------------------------------------------------


@dataclass
class Data:
    """One (size, tensors, memory)'s batches: the pool, and one epoch cycling it."""

    batch_bytes: int
    tensors: int
    memory: str
    pool: list[Batch]
    epoch: list[Batch]

    def __post_init__(self) -> None:
        self._sums: dict[int, float] = {}

    @property
    def epoch_bytes(self) -> int:
        return len(self.epoch) * self.batch_bytes

    def expected(self, i: int) -> float:
        """The float64 sum of ``t0`` of the epoch's batch ``i``, on the host (exact: integer values)."""
        i %= len(self.pool)
        if i not in self._sums:
            self._sums[i] = _sum(self.pool[i]["t0"])
        return self._sums[i]


def make_data(size_mib: float, tensors: int, memory: str, cfg: Config) -> Data:
    """Distinct batches filled with distinct nonzero values (pinned for ``pinned`` on CUDA)."""
    numel = max(1, int(size_mib * MiB) // tensors // 4)
    batch_bytes = numel * 4 * tensors
    n_pool = max(2, math.ceil(cfg.pool_bytes / batch_bytes))
    n_epoch = max(cfg.min_batches, round(cfg.epoch_bytes / batch_bytes))
    pin = memory == "pinned" and cfg.cuda
    pool = []
    for i in range(n_pool):
        batch = {}
        for j in range(tensors):
            t = torch.empty(numel, dtype=torch.float32, pin_memory=pin)
            t.fill_(float((i * tensors + j) % 4_000_000 + 1))  # exact in float32, and so are the sums
            batch[f"t{j}"] = t
        pool.append(batch)
    epoch = [pool[i % n_pool] for i in range(n_epoch)]
    return Data(batch_bytes, tensors, memory, pool, epoch)


def _sum(t: torch.Tensor) -> float:
    return float(t.sum(dtype=torch.float64))


def free_host_cache() -> None:
    """Drop the freed cells' memory: the device cache and, where torch has it, the pinned host cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()


# -- timing ------------------------------------------------------------------------------------------------


def sync(cfg: Config) -> None:
    if cfg.cuda:
        torch.cuda.synchronize(cfg.device)


def measure_ceiling(cfg: Config) -> float:
    """GB/s of a warm pinned copy of 256 MiB into a device tensor: median of 10, CUDA events."""
    nbytes = CEILING_BYTES if cfg.cuda else 16 * MiB
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cfg.cuda).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=cfg.device)
    times = []
    for i in range(13):
        if cfg.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - t0
        if i >= 3:  # three warm-up copies
            times.append(elapsed)
    return nbytes / statistics.median(times) / 1e9


def sleep_cycles_per_s(cfg: Config) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per second, from CUDA events (the median of 5)."""
    if not cfg.cuda:
        return 0.0
    cycles = 4_000_000
    torch.cuda._sleep(cycles)
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / (start.elapsed_time(end) / 1e3))
    return statistics.median(rates)


def make_step(loop: str, cycles: int, cfg: Config) -> Callable[[Batch], None]:
    """The loop body: nothing, a GPU step that reads the batch, or that step and a value read back."""
    if loop == "none":
        return lambda batch: None
    acc = torch.zeros((), device=cfg.device)
    sync_each = loop == "sync"
    if cfg.cuda:
        sleep = torch.cuda._sleep

        def work() -> None:
            sleep(cycles)
    else:  # the CPU stand-in: a small torch op
        a = torch.rand(48, 48)
        c = torch.empty(48, 48)

        def work() -> None:
            torch.mm(a, a, out=c)

    def step(batch: Batch) -> None:
        work()
        acc.add_(batch["t0"].view(-1)[:1].sum())
        if sync_each:
            acc.item()

    return step


@dataclass
class Epoch:
    wall_s: float
    batches: int
    cpu_s: float  # the training thread's CPU time in iter()/next() (and a per-epoch gpufeed's set-up/close)
    verified: bool
    first_s: float = 0.0  # from the epoch's start to its first batch in the loop's hands
    step_s: float = 0.0  # seconds per step from the end of the first step to the end of the last (device)


def run_epoch(runner: Runner, step: Callable[[Batch], None], data: Data, cfg: Config,
              limit: int | None = None) -> Epoch:
    """One epoch (its first ``limit`` batches only, for a warm-up) and its check: the first tensor of the
    first and last batch summed on the device, compared with the host's after the clock stops."""
    want = len(data.epoch) if limit is None else min(limit, len(data.epoch))
    clock = time.thread_time_ns
    sync(cfg)
    t0 = time.perf_counter()
    c0 = clock()
    it = runner.start()
    cpu = clock() - c0
    n = 0
    first = last = None
    first_s = 0.0
    marks: list[torch.cuda.Event] = []  # on the loop's stream: after the first step, after the last
    while True:
        c0 = clock()
        batch = next(it, None)
        cpu += clock() - c0
        if batch is None:
            break
        if first is None:
            first_s = time.perf_counter() - t0
            first = batch["t0"].sum(dtype=torch.float64)  # on the device, read after the clock stops
        last = batch["t0"]
        step(batch)
        n += 1
        if cfg.cuda and n == 1:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[0].record()
        if limit is not None and n == want:  # a warm-up stops early; an epoch runs to StopIteration
            break
    if cfg.cuda and n > 1:
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[1].record()
    del batch, it  # a warm-up that stopped early drops its iterator here: its threads end
    c0 = clock()
    runner.end()
    cpu += clock() - c0
    sync(cfg)
    wall = time.perf_counter() - t0
    ok = (n == want and first is not None and last is not None
          and float(first) == data.expected(0) and _sum(last) == data.expected(n - 1))
    if len(marks) == 2:  # steps 2..n on the device: the loop's steady state, whatever the host did
        step_s = marks[0].elapsed_time(marks[1]) / 1e3 / (n - 1)
    else:
        step_s = (wall - first_s) / max(1, n)
    return Epoch(wall, n, cpu / 1e9, ok, first_s, step_s)


def measure(runner: Runner, step: Callable[[Batch], None], data: Data, cfg: Config
            ) -> tuple[Epoch, bool, int]:
    """A warm-up (``cfg.warmup_frac`` of an epoch), then ``cfg.reps`` timed epochs, or one where the
    warm-up foretells an epoch longer than ``cfg.slow_s``: the fastest, whether every epoch was right, and
    how many were timed."""
    n = len(data.epoch)
    warm = run_epoch(runner, step, data, cfg, limit=max(cfg.min_batches, math.ceil(n * cfg.warmup_frac)))
    foretold = warm.wall_s * n / max(1, warm.batches)
    reps = 1 if cfg.slow_s and foretold > cfg.slow_s else cfg.reps
    epochs = [run_epoch(runner, step, data, cfg) for _ in range(reps)]
    return min(epochs, key=lambda e: e.wall_s), warm.verified and all(e.verified for e in epochs), reps


def measure_ideal(step: Callable[[Batch], None], data: Data, cfg: Config) -> float:
    """Seconds of the loop over one batch already in device memory, as many steps as an epoch: the fastest."""
    resident = {k: v.to(cfg.device) for k, v in data.pool[0].items()}
    sync(cfg)
    times = []
    for _ in range(1 + cfg.reps):
        sync(cfg)
        t0 = time.perf_counter()
        for _ in range(len(data.epoch)):
            step(resident)
        sync(cfg)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


# -- the grid ----------------------------------------------------------------------------------------------


def cell_name(row: dict[str, Any]) -> str:
    return f"{row['bytes'] / MiB:g} MiB x{row['tensors']} {row['memory']} {row['loop']}"


def run(cfg: Config) -> dict[str, Any]:
    """Every measurement of the grid; returns the JSON document."""
    if cfg.cuda:
        torch.cuda.init()
    ceiling = measure_ceiling(cfg)
    rate = sleep_cycles_per_s(cfg)
    print(f"ceiling: {ceiling:.2f} GB/s (pinned {CEILING_BYTES // MiB} MiB copy)"
          + (f"; torch.cuda._sleep: {rate / 1e9:.3f} G cycles/s" if cfg.cuda else ""), flush=True)
    cells = [(s, t, m) for s in cfg.sizes for t in cfg.tensors for m in cfg.memory]
    total = len(cells) * len(cfg.loops) * len(cfg.rows)
    rows: list[dict[str, Any]] = []
    ideals: dict[tuple[int, int, str], float] = {}
    done = 0
    t_start = time.perf_counter()
    for size, tensors, memory in cells:
        data = make_data(size, tensors, memory, cfg)
        for loop in cfg.loops:
            copy_s = data.batch_bytes / (ceiling * 1e9)
            cycles = int(COMPUTE_OVER_COPY * copy_s * rate)
            step = make_step(loop, cycles, cfg)
            base = {"bytes": data.batch_bytes, "tensors": tensors, "memory": memory, "loop": loop}
            ideal = None
            if loop != "none":
                key = (data.batch_bytes, tensors, loop)
                if key not in ideals:
                    ideals[key] = measure_ideal(step, data, cfg)
                ideal = ideals[key]
            for method, reuse in cfg.rows:
                row = dict(base, method=method, reuse=reuse)
                row.update(_measure_row(method, reuse, step, data, ideal, ceiling, cfg))
                rows.append(row)
                done += 1
                print(_progress(row, done, total, time.perf_counter() - t_start), flush=True)
        del data
        free_host_cache()
    _compare(rows)
    doc = {
        **run_info(cfg.device, cfg.smoke),
        "pinned_memory": cfg.cuda,  # without CUDA the "pinned" cells hold pageable tensors
        "ceiling_GBps": ceiling,
        "sleep_cycles_per_s": rate,
        "config": {"sizes_mib": list(cfg.sizes), "tensors": list(cfg.tensors), "memory": list(cfg.memory),
                   "loops": list(cfg.loops), "methods": list(cfg.methods), "epoch_bytes": cfg.epoch_bytes,
                   "pool_bytes": cfg.pool_bytes, "min_batches": cfg.min_batches, "reps": cfg.reps,
                   "warmup_frac": cfg.warmup_frac, "slow_s": cfg.slow_s,
                   "depth": cfg.depth, "compute_over_copy": COMPUTE_OVER_COPY},
        "seconds": time.perf_counter() - t_start,
        "rows": rows,
    }
    doc["targets"] = check_targets(rows)
    return doc


def _measure_row(method: str, reuse: str | None, step: Callable[[Batch], None], data: Data,
                 ideal: float | None, ceiling: float, cfg: Config) -> dict[str, Any]:
    runner = None
    try:
        runner = Runner(method, reuse, data.epoch, cfg)
        best, ok, reps = measure(runner, step, data, cfg)
        gbps = data.epoch_bytes / best.wall_s / 1e9
        out: dict[str, Any] = {"GBps": gbps, "frac_of_ceiling": gbps / ceiling,
                               "consumer_us": best.cpu_s * 1e6 / max(1, best.batches),
                               "batches": best.batches, "seconds": best.wall_s, "reps": reps}
        out["first_ms"] = best.first_s * 1e3
        if ideal is not None:
            out["step_over_compute"] = best.step_s / (ideal / len(data.epoch))
            out["ideal_us_per_step"] = ideal * 1e6 / len(data.epoch)
        out["verified"] = ok
        return out
    except Exception as exc:  # keep the other rows of a scarce GPU run; the row says what failed
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if runner is not None:
            try:
                runner.close()
            except Exception:
                traceback.print_exc()


def _progress(row: dict[str, Any], done: int, total: int, elapsed: float) -> str:
    head = (f"[{done:4d}/{total} {elapsed:6.1f}s] {row['bytes'] / MiB:7.3g} MiB x{row['tensors']:<3d} "
            f"{row['memory']:>8} {row['loop']:>7} {row['method']:>7} {row['reuse'] or '':>9}")
    if "error" in row:
        return f"{head}  ERROR {row['error']}"
    return (f"{head} {row['GBps']:7.2f} GB/s {row['frac_of_ceiling']:6.1%} of ceiling "
            f"{row['consumer_us']:7.1f} us/batch"
            + (f"  step/ideal {row['step_over_compute']:.3f}" if "step_over_compute" in row else "")
            + ("" if row["verified"] else "  NOT VERIFIED"))


def _cell_key(row: dict[str, Any]) -> tuple[int, int, str, str]:
    return row["bytes"], row["tensors"], row["memory"], row["loop"]


def _compare(rows: list[dict[str, Any]]) -> None:
    """Adds ``best_peer`` and ``vs_best_peer`` (GB/s over the best peer's) to each gpufeed row."""
    cells: dict[tuple[int, int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault(_cell_key(r), []).append(r)
    for group in cells.values():
        peers = [r for r in group if r["method"] in PEERS and "error" not in r]
        best = max(peers, key=lambda r: r["GBps"], default=None)
        for r in group:
            if r["method"] == "gpufeed" and "error" not in r and best is not None:
                r["best_peer"] = best["method"]
                r["vs_best_peer"] = r["GBps"] / best["GBps"]


# -- targets and reporting ---------------------------------------------------------------------------------

# (what, key, comparison, bound, applies to the row)
TARGETS: tuple[tuple[str, str, str, float, Callable[[dict[str, Any]], bool]], ...] = (
    ("rate >= 0.97x the best peer", "vs_best_peer", ">=", 0.97, lambda r: True),
    # Only where nothing else bounds the rate: a compute step of 1.2x the copy caps it at 1/1.2 = 83%.
    ("rate >= 0.90 of the ceiling (batches >= 8 MiB, loop none)", "frac_of_ceiling", ">=", 0.90,
     lambda r: r["bytes"] >= 8 * MiB and r["loop"] == "none"),
    ("step <= 1.03x the ideal (compute, sync)", "step_over_compute", "<=", 1.03,
     lambda r: r["loop"] in ("compute", "sync")),
    ("consumer <= 50 us/batch", "consumer_us", "<=", 50.0, lambda r: True),
)


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (reuse, target): cells met / cells, the worst value (``value``) and the worst misses."""
    out = []
    for reuse in ("once", "per_epoch"):
        gf = [r for r in rows if r["method"] == "gpufeed" and r["reuse"] == reuse]
        for what, key, op, bound, applies in TARGETS:
            cells = [r for r in gf if "error" in r or applies(r)]
            if not cells:
                continue
            values = []
            for r in cells:
                v = r.get(key)
                good = (v is not None and bool(r.get("verified"))
                        and (v >= bound if op == ">=" else v <= bound))
                values.append((cell_name(r), v, good))
            sign = 1.0 if op == ">=" else -1.0  # the worst first: the least of >=, the largest of <=
            misses = sorted((x for x in values if not x[2]),
                            key=lambda x: (x[1] is not None, 0.0 if x[1] is None else sign * x[1]))
            known = [v for _, v, _ in values if v is not None]
            worst = (min(known) if op == ">=" else max(known)) if known else None
            out.append({"target": f"gpufeed {reuse}: {what}", "reuse": reuse, "key": key, "bound": bound,
                        "cells": len(values), "cells_met": sum(g for _, _, g in values), "value": worst,
                        "met": all(g for _, _, g in values),
                        "worst_misses": [{"cell": c, "value": v} for c, v, _ in misses[:5]]})
    return out


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [
        f"# gpufeed grid benchmark: {doc['card']}", "",
        f"torch {doc['torch']}; ceiling (pinned {CEILING_BYTES // MiB} MiB copy, CUDA events) "
        f"{doc['ceiling_GBps']:.2f} GB/s; epochs of {cfg['epoch_bytes'] / MiB:g} MiB (at least "
        f"{cfg['min_batches']} batches) cycling {cfg['pool_bytes'] / MiB:g} MiB of distinct batches; "
        f"fastest of {cfg['reps']} timed epochs (1 where an epoch takes over {cfg['slow_s']:g} s) after a "
        f"warm-up of {cfg['warmup_frac']:.0%} of an epoch; gpufeed depth {cfg['depth']}; "
        f"{doc['seconds']:.0f} s in all."
        + (" Smoke run: sizes too small to mean anything." if doc["smoke"] else "")
        + ("" if doc["pinned_memory"] else " No CUDA: the pinned cells hold pageable memory."), "",
        "Each cell: fraction of the ceiling per method; best peer; gpufeed (once) GB/s over the best peer's; "
        "gpufeed's step over the ideal's (the same loop over one batch in VRAM) and its training thread's "
        "CPU per batch.", "",
    ]
    peers = [m for m in PEERS if m in cfg["methods"]]
    gf = "gpufeed" in cfg["methods"]
    cols = (["gpufeed once", "gpufeed per_epoch"] if gf else []) + peers
    for loop in cfg["loops"]:
        lines += [f"## loop: {loop}", "",
                  "| MiB | tensors | memory | " + " | ".join(cols)
                  + " | best peer | gpufeed/best | step/ideal | consumer us |",
                  "| ---: | ---: | --- | " + " | ".join("---:" for _ in cols)
                  + " | --- | ---: | ---: | ---: |"]
        cells: dict[tuple[int, int, str], dict[tuple[str, str | None], dict[str, Any]]] = {}
        for r in doc["rows"]:
            if r["loop"] == loop:
                cells.setdefault((r["bytes"], r["tensors"], r["memory"]), {})[(r["method"], r["reuse"])] = r
        for (nbytes, tensors, memory), by in cells.items():
            vals = []
            keys = ([("gpufeed", "once"), ("gpufeed", "per_epoch")] if gf else []) + [
                (m, dict(ROWS)[m]) for m in peers]
            for k in keys:
                r = by.get(k, {})
                v = "err" if "error" in r else _f(r.get("frac_of_ceiling"), ".1%")
                vals.append(v + ("" if r.get("verified", True) else " (WRONG)"))
            once = by.get(("gpufeed", "once"), {})
            lines.append(f"| {nbytes / MiB:g} | {tensors} | {memory} | " + " | ".join(vals)
                         + f" | {once.get('best_peer', '-')} | {_f(once.get('vs_best_peer'), '.3f')} | "
                           f"{_f(once.get('step_over_compute'), '.3f')} | "
                           f"{_f(once.get('consumer_us'), '.1f')} |")
        lines.append("")
    lines += ["## targets", "", *targets_table(doc["targets"])]
    lines += ["", "| target | cells met | worst misses |", "| --- | ---: | --- |"]
    for t in doc["targets"]:
        misses = "; ".join(f"{m['cell']}: {_f(m['value'], '.3f')}" for m in t["worst_misses"][:3]) or "-"
        lines.append(f"| {t['target']} | {t['cells_met']}/{t['cells']} | {misses} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """One panel per loop: x = cell, bars of gpufeed's fraction of the ceiling (both reuses) and the best
    peer's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loops = doc["config"]["loops"]
    fig, axes = plt.subplots(len(loops), 1, figsize=(14, 3.6 * len(loops)), squeeze=False)
    for ax, loop in zip(axes[:, 0], loops, strict=True):
        cells: dict[tuple[int, int, str], dict[str, float]] = {}
        for r in doc["rows"]:
            if r["loop"] != loop or "error" in r:
                continue
            c = cells.setdefault((r["bytes"], r["tensors"], r["memory"]), {})
            if r["method"] == "gpufeed":
                c[f"gpufeed {r['reuse']}"] = r["frac_of_ceiling"]
            else:
                c["best peer"] = max(c.get("best peer", 0.0), r["frac_of_ceiling"])
        labels = [f"{b / MiB:g}M x{t} {'pin' if m == 'pinned' else 'pg'}" for b, t, m in cells]
        series = ("gpufeed once", "gpufeed per_epoch", "best peer")
        colors = ("tab:green", "tab:olive", "tab:gray")
        width = 0.27
        for k, (name, color) in enumerate(zip(series, colors, strict=True)):
            xs = [i + (k - 1) * width for i in range(len(cells))]
            ax.bar(xs, [c.get(name, 0.0) for c in cells.values()], width, label=name, color=color)
        ax.axhline(0.9, color="tab:red", lw=0.8, ls="--")
        ax.set_xticks(range(len(cells)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("fraction of ceiling")
        ax.set_title(f"loop: {loop}  (ceiling {doc['ceiling_GBps']:.1f} GB/s, {doc['card']})", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(doc: dict[str, Any]) -> str:
    lines = ["summary" + (" (smoke run: not meaningful)" if doc["smoke"] else "") + ":"]
    for t in doc["targets"]:
        misses = ", ".join(f"{m['cell']} ({_f(m['value'], '.3f')})" for m in t["worst_misses"][:3])
        lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: "
                     f"{t['cells_met']}/{t['cells']} cells"
                     + (f"; worst: {misses}" if misses else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    print(f"gpufeed grid benchmark on {cfg.device} ({card_name(cfg.device)}), torch {torch.__version__}: "
          f"sizes {','.join(f'{s:g}' for s in cfg.sizes)} MiB, tensors {','.join(map(str, cfg.tensors))}, "
          f"{','.join(cfg.memory)}, loops {','.join(cfg.loops)}, rows "
          f"{','.join(m + ('' if r is None else '/' + r) for m, r in cfg.rows)}", flush=True)
    doc = run(cfg)
    md = markdown(doc)
    stem = save_results(cfg.out, "grid", doc, md)
    plot(doc, stem.with_suffix(".png"))
    print(f"\n{md}\nwrote {stem}.json, .md and .png\n")
    print(summary(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
