"""Files to GPU batches: gpufeed's sources against the ways people read HDF5 and raw files today.

Run it on the GPU machine, in one process (a few minutes; it writes about 6.5 GiB of data first)::

    PYTHONPATH=src python benchmarks/bench_sources.py       # benchmarks/results/sources-<card>.{json,md}
    python benchmarks/bench_sources.py --smoke              # tiny, on the CPU, seconds (CI)

Data, written once into ``--data-dir`` (a temporary folder by default, removed afterwards): ``--gib`` of
uint8 samples of shape (3, 64, 64) as ``x.npy``, the same bytes as a contiguous and a chunked (about 1 MiB
chunks, uncompressed) dataset of ``data.h5``, and ``--gzip-gib`` of compressible samples in ``gzip.h5``
twice: as a gzip (level 1) uint8 dataset and as a shuffle+gzip (level 1) uint16 one (the same bytes; the
shuffle filter only matters for elements of several bytes). Their rows report the compression ratio.
Every method delivers the whole dataset in order, as ``--batch-mib``
batches on the device; it runs once to warm up and check the first and last batch byte for byte, then
``--reps`` timed epochs, and the figure is the median ``GBps`` (bytes / wall time, up to a device
synchronize after the last batch).

Methods:

* ``pread16_ceiling``: the ceiling. ``--threads`` threads ``os.preadv`` each batch of the same file into one
  of two pinned buffers, and a side stream copies it to the device, overlapped with the next read.
* ``numpy_memmap_to``: ``torch.from_numpy(np.ascontiguousarray(mmap[a:b])).to(device)``.
* ``h5py_slice_to``: ``torch.from_numpy(dset[a:b]).to(device)``, the usual HDF5 loop.
* ``h5py_read_direct_pinned``: ``dset.read_direct`` into two pinned buffers, ``non_blocking`` copies.
* ``gpufeed_raw`` / ``gpufeed_h5`` / ``gpufeed_gds``: ``CudaPrefetcher(SourceLoader(source, batch_size=..),
  depth=3)`` with ``RawSource``, ``H5Source`` and ``GDSSource`` (its ``mode`` is reported).
* ``gpufeed_h5_threads`` / ``gpufeed_h5_gpu`` (gzip workloads): ``H5Source(decode="cpu")``, reader threads
  inflating chunks with zlib, and ``H5Source(decode="gpu")``, compressed chunks copied to the GPU and
  inflated there by nvCOMP (skipped without CUDA or ``gpufeed[nvcomp]``). GB/s count decoded bytes.

``frac_of_ceiling`` divides by the ``pread16_ceiling`` of the same cache state. Cold rows drop the files from
the page cache before each epoch (``posix_fadvise DONTNEED`` per file, and ``/proc/sys/vm/drop_caches``
when writable, except in ``--smoke`` runs); the JSON says which worked and how much of the files stayed
cached. The ``shuffled_<row size>`` workloads read random batches (``shuffle=True``: sorted random rows, one
``pread`` per run) of the same bytes seen as rows of 512 B, 4 KiB and 12 KiB (``--smoke``: 256 B and 768 B),
warm and cold, each beside ``pread16_random``: ``--threads`` threads reading the same rows of the same
shuffled batches (one ``pread`` per run, issued from C with the GIL released where gpufeed's native reader
was built; its ``reader`` says which), into pinned buffers copied as for the ceiling. Their targets divide
by the sequential ``pread16_ceiling`` (warm) and by ``pread16_random`` (cold). Cold shuffled epochs stop
after ``--cold-shuffled-gib``: every method reads the same first batches, and gpufeed's epoch plan ends
there (a prefetcher that broke out of a longer epoch would have read ahead past them). ``gpufeed_h5`` /
``gpufeed_h5_chunked`` read the contiguous and the chunked dataset at the dataset's own row size;
``gpufeed_raw`` reads as a source does by default (rows the page cache holds gathered from a memory map,
others by positional reads); ``gpufeed_raw_pread`` (``mmap_gather=False``) always reads by position,
``gpufeed_raw_mmap`` (``mmap_gather=True``, warm only) always gathers.

On CUDA, the ``compute`` workload adds a matmul loop on the default stream that takes about 1.2x the
method's own warm time per batch and reports ``step_over_compute`` (1.0 = reading hidden behind compute).
``*_read16`` rows are diagnostics: the ceiling's loop with ``source.read`` from 16 threads in place of
``preadv``, no prefetcher, to tell a source's cost from the prefetcher's.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when loaded by a test
from _common import card_name, pick_device, print_results, save_results, targets_table

try:
    import gpufeed
except ImportError:  # a checkout without an install: run the working tree's src/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import gpufeed
from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import GDSSource, H5Source, RawSource, _pread
from gpufeed.sources._files import FileDescriptors
from gpufeed.sources._runs import run_bounds
from gpufeed.sources.sampling import plan_batches

MiB, GiB = 1 << 20, 1 << 30
FULL = {"gib": 2.0, "gzip_gib": 0.25, "batch_mib": 48.0, "reps": 2, "sample": (3, 64, 64)}
SMOKE = {"gib": 1 / 128, "gzip_gib": 1 / 512, "batch_mib": 0.25, "reps": 1, "sample": (3, 16, 16)}
COMPUTE_OVER_COPY = 1.2
TARGETS = (
    (
        "raw file in page cache -> GPU: gpufeed_raw >= 0.9 x pread16_ceiling",
        "raw",
        "warm",
        "gpufeed_raw",
        0.9,
    ),
    ("HDF5 contiguous -> GPU: gpufeed_h5 >= 5 x h5py_slice_to", "h5_contiguous", "warm", "gpufeed_h5", 5.0),
    ("HDF5 gzip -> GPU: gpufeed_h5_gpu >= 5 x h5py_slice_to", "h5_gzip", "warm", "gpufeed_h5_gpu", 5.0),
    ("HDF5 shuffle+gzip -> GPU: gpufeed_h5_gpu >= 5 x h5py_slice_to", "h5_gzip_shuffle", "warm",
     "gpufeed_h5_gpu", 5.0),
    ("HDF5 gzip, CPU threads: gpufeed_h5_threads >= 4 x h5py_slice_to", "h5_gzip", "warm",
     "gpufeed_h5_threads", 4.0),
    ("HDF5 shuffle+gzip, CPU threads: gpufeed_h5_threads >= 4 x h5py_slice_to", "h5_gzip_shuffle", "warm",
     "gpufeed_h5_threads", 4.0),
    ("cold disk -> GPU: gpufeed_raw >= 0.9 x pread16_ceiling (cold)", "raw", "cold", "gpufeed_raw", 0.9),
    # Shuffled rows (issue 15): (text, workload, cache, method, want, (reference workload, method)).
    *(
        (f"shuffled {label} rows in page cache: {method} >= {want} x sequential pread16_ceiling",
         f"shuffled_{label}", "warm", method, want, ("raw", "pread16_ceiling"))
        for label, want, methods in (
            ("12KiB", 0.5, ("gpufeed_raw", "gpufeed_h5", "gpufeed_h5_chunked", "gpufeed_gds")),
            ("4KiB", 0.5, ("gpufeed_raw", "gpufeed_gds")),
            ("512B", 0.2, ("gpufeed_raw", "gpufeed_gds")),
        )
        for method in methods
    ),
    *(
        (f"shuffled {label} rows, cold disk: {method} >= 0.9 x pread16_random (cold)", f"shuffled_{label}",
         "cold", method, 0.9, (f"shuffled_{label}", "pread16_random"))
        for label, methods in (
            ("12KiB", ("gpufeed_raw", "gpufeed_h5", "gpufeed_gds")),
            ("4KiB", ("gpufeed_raw", "gpufeed_gds")),
            ("512B", ("gpufeed_raw", "gpufeed_gds")),
        )
        for method in methods
    ),
)
SHUFFLED_ROWS = (512, 4096, 12288)  # bytes per row of the shuffled workloads (--smoke: SMOKE_SHUFFLED_ROWS)
SMOKE_SHUFFLED_ROWS = (256, 768)
COLD_SHUFFLED_GIB = 0.5


@dataclass(frozen=True)
class Config:
    device: torch.device
    sample: tuple[int, ...]
    rows: int
    gzip_rows: int
    batch_rows: int
    reps: int
    threads: int
    out: Path
    data_dir: Path | None
    keep: bool
    smoke: bool
    cold: bool
    cold_shuffled_bytes: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.sample))


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU unless --device is given (CI)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--gib", type=float, help=f"dataset size in GiB (default {FULL['gib']})")
    p.add_argument("--gzip-gib", type=float, help=f"gzip dataset size in GiB (default {FULL['gzip_gib']})")
    p.add_argument("--batch-mib", type=float, help=f"batch size in MiB (default {FULL['batch_mib']})")
    p.add_argument("--reps", type=int, help=f"timed epochs per method (default {FULL['reps']})")
    p.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1), help="ceiling reader threads")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page cache rows")
    p.add_argument("--cold-shuffled-gib", type=float, default=None,
                   help=f"GiB per cold shuffled epoch (default {COLD_SHUFFLED_GIB}; --smoke: all)")
    p.add_argument(
        "--data-dir", type=Path, default=None, help="where to write the data (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the data files afterwards")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results",
        help="folder for sources-<card>.json/.md (default: benchmarks/results)",
    )
    a = p.parse_args(argv)
    base = SMOKE if a.smoke else FULL
    sample = tuple(base["sample"])
    sample_bytes = int(np.prod(sample))
    gib = a.gib if a.gib is not None else base["gib"]
    gzip_gib = a.gzip_gib if a.gzip_gib is not None else base["gzip_gib"]
    batch_mib = a.batch_mib if a.batch_mib is not None else base["batch_mib"]
    reps = a.reps if a.reps is not None else base["reps"]
    if min(gib, gzip_gib, batch_mib) <= 0 or reps < 1 or a.threads < 1:
        raise SystemExit("--gib, --gzip-gib, --batch-mib must be > 0, --reps and --threads >= 1")
    return Config(
        device=pick_device(a.device, a.smoke),
        sample=sample,
        rows=max(2, int(gib * GiB) // sample_bytes),
        gzip_rows=max(2, int(gzip_gib * GiB) // sample_bytes),
        batch_rows=max(1, int(batch_mib * MiB) // sample_bytes),
        reps=reps,
        threads=a.threads,
        out=a.out,
        data_dir=a.data_dir,
        keep=a.keep,
        smoke=a.smoke,
        cold=not a.no_cold,
        cold_shuffled_bytes=int((a.cold_shuffled_gib or (1e9 if a.smoke else COLD_SHUFFLED_GIB)) * GiB),
    )




# -- data ----------------------------------------------------------------------------------------------


class Data:
    """The dataset files and the deterministic bytes of every row, for checking what methods deliver."""

    BLOCK_BYTES = 64 * MiB

    def __init__(self, cfg: Config, root: Path) -> None:
        self.cfg, self.root = cfg, root
        self.npy, self.h5, self.h5gz = root / "x.npy", root / "data.h5", root / "gzip.h5"
        self.block = max(1, self.BLOCK_BYTES // cfg.sample_bytes)
        rng = np.random.default_rng(0)
        self._base = rng.integers(0, 256, size=(self.block, *cfg.sample), dtype=np.uint8)
        smooth = (np.arange(cfg.sample_bytes) // 64 % 256).astype(np.uint8).reshape(cfg.sample)
        self._gz = smooth + rng.integers(0, 4, size=(self.block, *cfg.sample), dtype=np.uint8)
        self.chunk_rows = max(1, MiB // cfg.sample_bytes)

    def rows(self, kind: str, a: int, b: int) -> np.ndarray:
        if kind == "gzip16":  # the gzip bytes as uint16 elements (the shuffle+gzip dataset)
            return self.rows("gzip", a, b).view(np.uint16)
        idx = np.arange(a, b)
        base = self._gz if kind == "gzip" else self._base
        tag = (idx // self.block % 251).astype(np.uint8).reshape(-1, *([1] * len(self.cfg.sample)))
        return base[idx % self.block] ^ tag

    def write(self) -> float:
        import h5py

        t0 = time.perf_counter()
        cfg = self.cfg
        mm = np.lib.format.open_memmap(self.npy, mode="w+", dtype=np.uint8, shape=(cfg.rows, *cfg.sample))
        with h5py.File(self.h5, "w") as f:
            contiguous = f.create_dataset("contiguous", (cfg.rows, *cfg.sample), np.uint8)
            chunked = f.create_dataset(
                "chunked", (cfg.rows, *cfg.sample), np.uint8, chunks=(self.chunk_rows, *cfg.sample)
            )
            for a in range(0, cfg.rows, self.block):
                b = min(cfg.rows, a + self.block)
                block = self.rows("raw", a, b)
                mm[a:b] = block
                contiguous[a:b] = block
                chunked[a:b] = block
        mm.flush()
        del mm
        with h5py.File(self.h5gz, "w") as f:
            gz = f.create_dataset(
                "gzip",
                (cfg.gzip_rows, *cfg.sample),
                np.uint8,
                chunks=(self.chunk_rows, *cfg.sample),
                compression="gzip",
                compression_opts=1,
            )
            shape16 = (*cfg.sample[:-1], cfg.sample[-1] // 2)
            gz16 = f.create_dataset("gzip_shuffle", (cfg.gzip_rows, *shape16), "<u2",
                                    chunks=(self.chunk_rows, *shape16), compression="gzip",
                                    compression_opts=1, shuffle=True)
            for a in range(0, cfg.gzip_rows, self.block):
                b = min(cfg.gzip_rows, a + self.block)
                gz[a:b] = self.rows("gzip", a, b)
                gz16[a:b] = self.rows("gzip16", a, b)
        os.sync()
        return time.perf_counter() - t0


# -- page cache ----------------------------------------------------------------------------------------


def drop_cache(paths: Iterable[Path], system: bool) -> str:
    """Evict ``paths`` from the page cache; returns the way that worked (``system``: also drop_caches)."""
    paths = list(paths)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not system:
        return "posix_fadvise"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return "drop_caches+posix_fadvise"
    except OSError:
        return "posix_fadvise"


def cached_fraction(paths: Iterable[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (kvikio's mincore helper), or None without kvikio."""
    try:
        import kvikio

        pages = [kvikio.get_page_cache_info(str(p)) for p in paths]
    except Exception:
        return None
    total = sum(t for _, t in pages)
    return sum(c for c, _ in pages) / total if total else 0.0


# -- methods -------------------------------------------------------------------------------------------

BatchIter = Callable[[], Iterator[torch.Tensor]]


def _pinned(cfg: Config, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8, pin_memory=cfg.cuda)


def _bounds(rows: int, b: int) -> list[tuple[int, int]]:
    return [(a, min(rows, a + b)) for a in range(0, rows, b)]


class Pread16:
    """The ceiling: threaded ``preadv`` into two pinned buffers, each copied to the GPU on a side stream."""

    def __init__(
        self, cfg: Config, path: Path, offset: int, rows: int, row_bytes: int | None = None
    ) -> None:
        self.cfg, self.path, self.offset, self.rows = cfg, path, offset, rows
        self.row_bytes = row_bytes or cfg.sample_bytes
        self.row_shape = cfg.sample if self.row_bytes == cfg.sample_bytes else (self.row_bytes,)
        self.batch_rows = max(1, cfg.batch_rows * cfg.sample_bytes // self.row_bytes)  # the same bytes
        self.pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="bench-pread")
        self.bufs = [_pinned(cfg, (cfg.batch_rows * cfg.sample_bytes,)) for _ in range(2)]
        self.stream = torch.cuda.Stream(cfg.device) if cfg.cuda else None
        self.fd = os.open(path, os.O_RDONLY)

    def batches(self) -> list[Any]:
        """What ``_read`` reads, batch by batch: ``(a, b)`` row bounds here."""
        return _bounds(self.rows, self.batch_rows)

    def _read(self, buf: torch.Tensor, batch: tuple[int, int]) -> int:
        (a, b), rb = batch, self.row_bytes
        mv = memoryview(buf.numpy())[: (b - a) * rb]
        step = -(-len(mv) // self.cfg.threads)

        def piece(o: int) -> None:
            part, done = mv[o : o + step], 0
            while done < len(part):
                got = os.preadv(self.fd, [part[done:]], self.offset + a * rb + o + done)
                if got <= 0:
                    raise OSError(f"short read from {self.path}")
                done += got

        list(self.pool.map(piece, range(0, len(mv), step)))
        return b - a

    def __call__(self) -> Iterator[torch.Tensor]:
        cfg = self.cfg
        events: list[Any] = [None, None]
        for i, batch in enumerate(self.batches()):
            buf = self.bufs[i % 2]
            if events[i % 2] is not None:
                events[i % 2].synchronize()
            n = self._read(buf, batch)
            host = buf[: n * self.row_bytes].view(n, *self.row_shape)
            if self.stream is None:
                yield host.clone()  # the buffer is reused; a CPU "device" batch must own its bytes
                continue
            with torch.cuda.stream(self.stream):
                out = host.to(cfg.device, non_blocking=True)
                events[i % 2] = torch.cuda.Event()
                events[i % 2].record(self.stream)
            torch.cuda.current_stream().wait_stream(self.stream)
            out.record_stream(torch.cuda.current_stream())
            yield out

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


class SourceRead16(Pread16):
    """The ceiling's loop with ``source.read`` in place of ``preadv``: each thread reads its rows.

    It isolates what a source costs from what the prefetcher adds (a diagnostic, not a way to load data).
    """

    def __init__(self, cfg: Config, path: Path, rows: int, source: Any) -> None:
        super().__init__(cfg, path, 0, rows)
        self.source, self.name = source, next(iter(source.fields))

    def _read(self, buf: torch.Tensor, batch: tuple[int, int]) -> int:
        (a, b), rb, step = batch, self.cfg.sample_bytes, -(-(batch[1] - batch[0]) // self.cfg.threads)
        flat = buf.numpy()

        def piece(r: int) -> None:
            k = min(step, b - r)
            # Views made with numpy + from_numpy: torch's slicing ops hand the GIL over on every call,
            # which costs a third of the throughput with 16 reader threads (measured).
            view = torch.from_numpy(flat[(r - a) * rb : (r - a + k) * rb].reshape(k, *self.cfg.sample))
            self.source.read(range(r, r + k), {self.name: view})

        list(self.pool.map(piece, range(a, b, step)))
        return b - a

    def close(self) -> None:
        super().close()
        self.source.close()


class RandomPread16(Pread16):
    """The ceiling of shuffled reads: the rows of the batches ``SourceLoader(shuffle=True)`` plans (same
    seed, epoch after epoch), each thread one share of a batch, one ``pread`` per run of consecutive rows.

    A thread's preads go out in one ``pread_many`` call, from C with the GIL released, where gpufeed's
    native reader was built (``reader`` says ``native``): a Python loop would measure the GIL, not the disk.
    Each is one blocking ``pread`` (``ahead=False``): gpufeed's own read-ahead of uncached rows is not part
    of the baseline.
    """

    def __init__(self, cfg: Config, path: Path, offset: int, row_bytes: int, limit_bytes: int | None) -> None:
        super().__init__(cfg, path, offset, (os.path.getsize(path) - offset) // row_bytes, row_bytes)
        self.epoch = 0
        self.limit = None if limit_bytes is None else max(1, limit_bytes // (self.batch_rows * row_bytes))
        self.fds = FileDescriptors([str(path)])
        self.reader = _pread.backend()

    def batches(self) -> list[Any]:
        plan = plan_batches(self.rows, self.batch_rows, shuffle=True, epoch=self.epoch)
        self.epoch += 1
        return plan[: self.limit]

    def _read(self, buf: torch.Tensor, rows: np.ndarray) -> int:
        rb, step = self.row_bytes, -(-len(rows) // self.cfg.threads)

        def piece(a: int) -> None:
            starts, stops = run_bounds(rows[a : a + step])
            sizes = (stops - starts) * rb
            dst = a * rb + np.cumsum(sizes) - sizes
            _pread.pread_many(self.fds, [str(self.path)], 0, self.offset + starts * rb, sizes, dst,
                              buf.data_ptr(), buf.numel(), ahead=False)

        list(self.pool.map(piece, range(0, len(rows), step)))
        return len(rows)

    def close(self) -> None:
        super().close()
        self.fds.close()


def memmap_to(cfg: Config, path: Path, rows: int) -> BatchIter:
    def run() -> Iterator[torch.Tensor]:
        mm = np.load(path, mmap_mode="r")
        for a, b in _bounds(rows, cfg.batch_rows):
            with warnings.catch_warnings():  # read-only mapping; the tensor is only read
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(np.ascontiguousarray(mm[a:b]))
            yield t.to(cfg.device)

    return run


def h5py_slice_to(cfg: Config, path: Path, name: str, rows: int) -> BatchIter:
    import h5py

    def run() -> Iterator[torch.Tensor]:
        with h5py.File(path, "r") as f:
            dset = f[name]
            for a, b in _bounds(rows, cfg.batch_rows):
                yield torch.from_numpy(dset[a:b]).to(cfg.device)

    return run


def h5py_read_direct_pinned(cfg: Config, path: Path, name: str, rows: int) -> BatchIter:
    import h5py

    bufs = [_pinned(cfg, (cfg.batch_rows, *cfg.sample)) for _ in range(2)]

    def run() -> Iterator[torch.Tensor]:
        events: list[Any] = [None, None]
        with h5py.File(path, "r") as f:
            dset = f[name]
            for i, (a, b) in enumerate(_bounds(rows, cfg.batch_rows)):
                buf = bufs[i % 2]
                if events[i % 2] is not None:
                    events[i % 2].synchronize()
                dset.read_direct(buf.numpy(), np.s_[a:b], np.s_[0 : b - a])
                out = buf[: b - a].to(cfg.device, non_blocking=True, copy=True)
                if cfg.cuda:
                    events[i % 2] = torch.cuda.Event()
                    events[i % 2].record()
                yield out

    return run


class FirstBatches(SourceLoader):
    """A ``SourceLoader`` whose epochs end after their first ``limit`` batches."""

    def __init__(self, source: Any, batch_size: int, limit: int | None, **kwargs: Any) -> None:
        super().__init__(source, batch_size, **kwargs)
        self.limit = limit

    def plan(self, epoch: int | None = None) -> list[Any]:
        return super().plan(epoch)[: self.limit]


class Gpufeed:
    """``CudaPrefetcher`` over a source, made once and iterated once per epoch."""

    def __init__(
        self, cfg: Config, source: Any, shuffle: bool = False, limit_bytes: int | None = None
    ) -> None:
        self.source = source
        self.name = next(iter(source.fields))
        row_bytes = source.fields[self.name].sample_nbytes
        batch_rows = max(1, cfg.batch_rows * cfg.sample_bytes // row_bytes)  # the same bytes a batch
        limit = None if limit_bytes is None else max(1, limit_bytes // (batch_rows * row_bytes))
        self.pf = CudaPrefetcher(FirstBatches(source, batch_rows, limit, shuffle=shuffle), device=cfg.device,
                                 depth=3)

    def __call__(self) -> Iterator[torch.Tensor]:
        for batch in self.pf:  # (a new iteration starts the next epoch, as in training)
            yield batch[self.name]

    def release(self) -> None:
        """Close (and unmap) the source's files until its next read: pages a memory map holds stay in the
        page cache through a cold epoch's drop."""
        self.source.close()

    def close(self) -> None:
        self.pf.close()
        self.source.close()


# -- harness -------------------------------------------------------------------------------------------


def sync(cfg: Config) -> None:
    if cfg.cuda:
        torch.cuda.synchronize(cfg.device)


def epoch(
    make: BatchIter, cfg: Config, step: Callable[[torch.Tensor], None] | None = None
) -> tuple[float, int, list]:
    """Wall seconds, bytes delivered and the first and last batch (device tensors) of one epoch."""
    sync(cfg)
    t0 = time.perf_counter()
    nbytes, first, last = 0, None, None
    for t in make():
        if step is not None:
            step(t)
        nbytes += t.numel() * t.element_size()
        first = t if first is None else first
        last = t
    sync(cfg)
    return time.perf_counter() - t0, nbytes, [first, last]


def verify(data: Data, kind: str, rows: int, batches: list, cfg: Config) -> bool:
    bounds = _bounds(rows, cfg.batch_rows)
    for (a, b), t in zip((bounds[0], bounds[-1]), batches, strict=True):
        if t is None or not np.array_equal(t.cpu().numpy(), data.rows(kind, a, b)):
            return False
    return True


def measure(
    cfg: Config,
    data: Data,
    workload: str,
    method: str,
    make: BatchIter,
    *,
    kind: str,
    rows: int,
    cache: str,
    files: list[Path],
    check: bool = True,
    step: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": workload, "method": method, "cache": cache}
    try:
        _, _, ends = epoch(make, cfg, step)
        row["verified"] = verify(data, kind, rows, ends, cfg) if check else None
        del ends
        times, nbytes = [], 0
        for _ in range(cfg.reps):
            if cache == "cold":
                getattr(make, "release", lambda: None)()  # mapped pages stay cached through a drop
                row["cold_method"] = drop_cache(files, system=not cfg.smoke)
                was, cached = row.get("cached_before"), cached_fraction(files)
                row["cached_before"] = cached if cached is None or was is None else max(was, cached)
            t, nbytes, _ = epoch(make, cfg, step)
            times.append(t)
        row["seconds"] = statistics.median(times)
        row["GBps"] = nbytes / row["seconds"] / 1e9
        row["bytes"] = nbytes
    except Exception as exc:  # one broken method must not hide the others' figures
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    _print_row(row)
    return row


def _print_row(row: dict[str, Any]) -> None:
    if "GBps" in row:
        gbps = f"{row['GBps']:7.2f} GB/s"
    else:
        gbps = f"skipped: {row['skipped']}" if "skipped" in row else f"ERROR {row.get('error')}"
    print(f"  {row['workload']:<16} {row['cache']:<5} {row['method']:<26} {gbps}", flush=True)


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if close is not None:
        close()


def run(cfg: Config, data: Data) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    npy_offset = int(np.load(data.npy, mmap_mode="r").offset)
    gds_source, gds_note = _gds(cfg, data)
    makers = {"gpufeed_raw": lambda: RawSource(data.npy), "gpufeed_gds": gds_source}

    def add(workload, method, make, *, kind="raw", n=cfg.rows, cache="warm", files=(data.npy,), **kw):
        rows.append(
            measure(
                cfg, data, workload, method, make, kind=kind, rows=n, cache=cache, files=list(files), **kw
            )
        )
        return rows[-1]

    caches = ["warm", "cold"] if cfg.cold else ["warm"]
    for cache in caches:
        ceiling = Pread16(cfg, data.npy, npy_offset, cfg.rows)
        add("raw", "pread16_ceiling", ceiling, cache=cache)
        ceiling.close()
        if cache == "warm":  # where does the time go: the source's read, or the prefetcher around it?
            diag = [("raw", "raw_read16", data.npy, lambda: RawSource(data.npy))]
            diag.append(("h5_contiguous", "h5_read16", data.h5, lambda: H5Source(data.h5, ["contiguous"])))
            if gds_source is not None:
                diag.append(("raw", "gds_read16", data.npy, gds_source))
            for workload, method, path, make in diag:
                d = SourceRead16(cfg, path, cfg.rows, make())
                add(workload, method, d, files=(path,))
                d.close()
        add("raw", "numpy_memmap_to", memmap_to(cfg, data.npy, cfg.rows), cache=cache)
        for method, make in makers.items():
            if make is None:
                rows.append({"workload": "raw", "method": method, "cache": cache, "skipped": gds_note})
                _print_row(rows[-1])
                continue
            g = Gpufeed(cfg, make())
            add("raw", method, g, cache=cache)
            g.close()
        h5_files = (data.h5,)
        g = Gpufeed(cfg, H5Source(data.h5, fields=["contiguous"]))
        add("h5_contiguous", "gpufeed_h5", g, cache=cache, files=h5_files)
        g.close()
        if cache == "cold":
            continue
        add(
            "h5_contiguous",
            "h5py_slice_to",
            h5py_slice_to(cfg, data.h5, "contiguous", cfg.rows),
            files=h5_files,
        )
        add(
            "h5_contiguous",
            "h5py_read_direct_pinned",
            h5py_read_direct_pinned(cfg, data.h5, "contiguous", cfg.rows),
            files=h5_files,
        )
        n, path = cfg.rows, data.h5
        add("h5_chunked", "h5py_slice_to", h5py_slice_to(cfg, path, "chunked", n), files=(path,))
        add("h5_chunked", "h5py_read_direct_pinned", h5py_read_direct_pinned(cfg, path, "chunked", n))
        g = Gpufeed(cfg, H5Source(path, fields=["chunked"]))
        add("h5_chunked", "gpufeed_h5", g, files=(path,))
        rows[-1]["h5_path"] = g.source.paths_taken["chunked"]
        g.close()
        rows += gzip_rows(cfg, data, add, rows)
    for cache in caches:
        rows += shuffled_rows(cfg, data, add, cache, npy_offset, gds_source is not None, gds_note)
    if cfg.cuda and not cfg.smoke:
        rows += compute_rows(cfg, data, rows, makers)
    _fill_fractions(rows)
    return _doc(cfg, data, rows, gds_note)


def shuffled_rows(cfg: Config, data: Data, add: Callable[..., None], cache: str, npy_offset: int,
                  gds: bool, gds_note: str) -> list[dict[str, Any]]:
    """The shuffled workloads of one cache state, each row size beside ``pread16_random`` of the same rows
    (added by ``add``); returns the rows of methods that cannot run here, marked skipped."""
    skipped = []
    limit = cfg.cold_shuffled_bytes if cache == "cold" else None
    as_raw = data.root / "x.u8"  # the .npy's bytes, for rows of any size (a RawSource reads .npy as saved)
    if not as_raw.exists():
        as_raw.symlink_to(data.npy.name)
    sizes = SMOKE_SHUFFLED_ROWS if cfg.smoke else SHUFFLED_ROWS
    for rb in (r for r in sizes if cfg.sample_bytes % r == 0):
        w = f"shuffled_{_size_label(rb)}"

        def raw(rb: int = rb, gather: bool | None = None) -> RawSource:
            if rb == cfg.sample_bytes:
                return RawSource(data.npy, mmap_gather=gather)
            return RawSource(as_raw, dtype="uint8", shape=(rb,), offset=npy_offset, mmap_gather=gather)

        ceiling = RandomPread16(cfg, data.npy, npy_offset, rb, limit)
        add(w, "pread16_random", ceiling, cache=cache, check=False)["reader"] = ceiling.reader
        ceiling.close()
        makers: dict[str, Callable[[], Any] | None] = {
            "gpufeed_raw": raw, "gpufeed_raw_pread": lambda raw=raw: raw(gather=False)}
        if cache == "warm":
            makers["gpufeed_raw_mmap"] = lambda raw=raw: raw(gather=True)
        if rb == cfg.sample_bytes:
            makers["gpufeed_h5"] = lambda: H5Source(data.h5, fields=["contiguous"])
            if cache == "warm":
                makers["gpufeed_h5_chunked"] = lambda: H5Source(data.h5, fields=["chunked"])
        makers["gpufeed_gds"] = (lambda raw=raw: GDSSource(raw())) if gds else None
        for method, make in makers.items():
            if make is None:
                skipped.append({"workload": w, "method": method, "cache": cache, "skipped": gds_note})
                _print_row(skipped[-1])
                continue
            g = Gpufeed(cfg, make(), shuffle=True, limit_bytes=limit)
            files = (data.h5,) if "h5" in method else (data.npy,)
            add(w, method, g, cache=cache, check=False, files=files)
            g.close()
    return skipped


def _size_label(nbytes: int) -> str:
    return f"{nbytes >> 10}KiB" if nbytes % 1024 == 0 else f"{nbytes}B"


def gzip_rows(cfg: Config, data: Data, add: Callable[..., None], rows: list[dict[str, Any]]) -> list:
    """The gzip and shuffle+gzip workloads: h5py slicing, gpufeed's CPU threads and its GPU decode (added to
    ``rows`` by ``add``); returns the rows of methods that cannot run here, marked skipped."""
    import h5py

    path, n, skipped = data.h5gz, cfg.gzip_rows, []
    gpu_note = _gzip_gpu_note(cfg)
    for name, kind in (("gzip", "gzip"), ("gzip_shuffle", "gzip16")):
        w = f"h5_{name}"
        with h5py.File(path, "r") as f:
            ratio = f[name].nbytes / max(1, f[name].id.get_storage_size())
        start = len(rows)
        add(w, "h5py_slice_to", h5py_slice_to(cfg, path, name, n), kind=kind, n=n, files=(path,))
        if name == "gzip":  # read_direct fills uint8 buffers: the uint8 dataset only
            add(w, "h5py_read_direct_pinned", h5py_read_direct_pinned(cfg, path, name, n), kind=kind, n=n)
        for method, decode in (("gpufeed_h5_threads", "cpu"), ("gpufeed_h5_gpu", "gpu")):
            if decode == "gpu" and gpu_note:
                skipped.append({"workload": w, "method": method, "cache": "warm", "skipped": gpu_note,
                                "compression_ratio": ratio})
                _print_row(skipped[-1])
                continue
            g = Gpufeed(cfg, H5Source(path, fields=[name], decode=decode))
            add(w, method, g, kind=kind, n=n, files=(path,))
            rows[-1]["h5_path"] = g.source.paths_taken[name]
            g.close()
        for r in rows[start:]:
            r["compression_ratio"] = ratio
    return skipped


def _gzip_gpu_note(cfg: Config) -> str:
    """Why gzip chunks cannot be decoded on the GPU here, or ``""``."""
    if not cfg.cuda:
        return "needs CUDA"
    try:
        from gpufeed.sources import _nvcomp

        _nvcomp.load()
    except ImportError as exc:
        return str(exc)
    return ""


def _gds(cfg: Config, data: Data) -> tuple[Callable[[], GDSSource] | None, str]:
    """A maker of the GDSSource, or None with the reason it cannot run here."""
    if not cfg.cuda:
        return None, "needs CUDA"
    try:
        probe = GDSSource(data.npy)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    note = probe.describe()
    probe.close()
    return (lambda: GDSSource(data.npy)), note


def compute_rows(cfg: Config, data: Data, rows: list[dict[str, Any]], makers: dict) -> list[dict[str, Any]]:
    """gpufeed with a default-stream matmul loop per batch that takes ~1.2x the method's own batch time.

    ``step_over_compute`` near 1.0 means reading and copying hid behind the compute; a source whose
    reads serialize with the default stream would show about 1 + 1/1.2.
    """
    warm = {r["method"]: r for r in rows if (r["workload"], r["cache"]) == ("raw", "warm") and "GBps" in r}
    # Few big kernels, like a training step: hundreds of small launches would measure how fast the
    # consumer thread gets the GIL past 16 reader threads, not the overlap. Not one huge kernel either:
    # the step is a whole number of kernels, and one that is the whole 1.2x would round it coarsely.
    a = torch.randn(4096, 4096, device=cfg.device, dtype=torch.bfloat16) / 64.0
    one = _time_matmuls(a, 2, cfg) / 2
    steps = len(_bounds(cfg.rows, cfg.batch_rows))
    out = []
    for method, make in makers.items():
        if make is None or method not in warm:
            continue
        batch_s = warm[method]["seconds"] / steps
        reps = max(1, math.ceil(COMPUTE_OVER_COPY * batch_s / one))

        def step(t: torch.Tensor, reps: int = reps) -> None:
            x = a + t[:1].float().mean()  # the step reads the batch
            for _ in range(reps):
                x = x @ a

        compute_s = _time_matmuls(a, reps, cfg)
        g = Gpufeed(cfg, make())
        row = measure(
            cfg, data, "compute", method, g, kind="raw", rows=cfg.rows, cache="warm", files=[], step=step
        )
        g.close()
        if "seconds" in row:
            row["compute_s_per_step"] = compute_s
            row["step_over_compute"] = row["seconds"] / steps / compute_s
        out.append(row)
    return out


def _time_matmuls(a: torch.Tensor, reps: int, cfg: Config) -> float:
    x = a
    for _ in range(3):
        x = x @ a
    sync(cfg)
    t0 = time.perf_counter()
    for _ in range(10):
        x = a
        for _ in range(reps):
            x = x @ a
    sync(cfg)
    return (time.perf_counter() - t0) / 10


def _fill_fractions(rows: list[dict[str, Any]]) -> None:
    ceilings = {r["cache"]: r.get("GBps") for r in rows if r["method"] == "pread16_ceiling"}
    randoms = {(r["workload"], r["cache"]): r.get("GBps") for r in rows if r["method"] == "pread16_random"}
    for r in rows:
        c = ceilings.get(r["cache"])
        if "GBps" in r and c:
            r["frac_of_ceiling"] = r["GBps"] / c
        c = randoms.get((r["workload"], r["cache"]))
        if "GBps" in r and c and r["method"] != "pread16_random":
            r["frac_of_random"] = r["GBps"] / c


def _doc(cfg: Config, data: Data, rows: list[dict[str, Any]], gds_note: str) -> dict[str, Any]:
    import h5py

    def gbps(workload: str, cache: str, method: str) -> float | None:
        return next(
            (
                r.get("GBps")
                for r in rows
                if (r["workload"], r["cache"], r["method"]) == (workload, cache, method)
            ),
            None,
        )

    targets = []
    for text, workload, cache, method, want, *of in TARGETS:
        ref_workload, ref_method = of[0] if of else (
            workload, "h5py_slice_to" if "h5py_slice_to" in text else "pread16_ceiling")
        got, ref = gbps(workload, cache, method), gbps(ref_workload, cache, ref_method)
        value = got / ref if got and ref else None
        targets.append({"target": text, "value": value, "met": value is not None and value >= want})
    cold = [r for r in rows if r["cache"] == "cold" and "cold_method" in r]
    return {
        "card": card_name(cfg.device),
        "device": str(cfg.device),
        "torch": torch.__version__,
        "gpufeed": gpufeed.__version__,
        "h5py": h5py.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "smoke": cfg.smoke,
        "sample_shape": list(cfg.sample),
        "rows": rows,
        "num_samples": cfg.rows,
        "gzip_samples": cfg.gzip_rows,
        "batch_rows": cfg.batch_rows,
        "batch_bytes": cfg.batch_rows * cfg.sample_bytes,
        "reps": cfg.reps,
        "threads": cfg.threads,
        "gds": gds_note,
        "cold_method": cold[0]["cold_method"] if cold else None,
        "cold_cached_fraction_max": max((r["cached_before"] or 0.0 for r in cold), default=None)
        if cold and any(r.get("cached_before") is not None for r in cold)
        else None,
        "targets": targets,
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# gpufeed sources benchmark: {doc['card']}",
        "",
        f"torch {doc['torch']}, h5py {doc['h5py']}, {doc['cpus']} CPUs, {doc['num_samples']} samples of "
        f"{doc['sample_shape']} "
        f"uint8 ({doc['num_samples'] * int(np.prod(doc['sample_shape'])) / GiB:.2f} GiB), batches of "
        f"{doc['batch_bytes'] / MiB:.1f} MiB, median of {doc['reps']} epochs. GDS: {doc['gds']}. "
        f"Cold cache by {doc['cold_method']} (max fraction still cached: {doc['cold_cached_fraction_max']}).",
        "",
        "| workload | cache | method | GB/s | of ceiling | verified | notes |",
        "| --- | --- | --- | ---: | ---: | --- | --- |",
    ]
    for r in doc["rows"]:
        notes = r.get("error") or r.get("skipped") or ""
        if "h5_path" in r:
            notes = f"H5Source path: {r['h5_path']}"
        if "compression_ratio" in r:
            notes = f"{notes}; " if notes else ""
            notes += f"compression ratio {r['compression_ratio']:.2f}"
        if "frac_of_random" in r:
            notes = f"{r['frac_of_random']:.2f} x pread16_random"
        if "reader" in r:
            notes = f"reads issued by the {r['reader']} reader"
        if "step_over_compute" in r:
            notes = f"step / compute = {r['step_over_compute']:.3f}"
        gbps = f"{r['GBps']:.2f}" if "GBps" in r else "-"
        frac = f"{r['frac_of_ceiling']:.2f}" if "frac_of_ceiling" in r else "-"
        cells = [r["workload"], r["cache"], r["method"], gbps, frac, str(r.get("verified", "-")), notes]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *targets_table(doc["targets"], digits=2)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    root = cfg.data_dir or Path(tempfile.mkdtemp(prefix="gpufeed-bench-sources-"))
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"gpufeed sources benchmark on {cfg.device} ({card_name(cfg.device)}), torch {torch.__version__}, "
        f"{cfg.rows} x {cfg.sample} uint8, batches of {cfg.batch_rows} rows, data in {root}",
        flush=True,
    )
    try:
        data = Data(cfg, root)
        print(f"wrote the data in {data.write():.1f} s", flush=True)
        doc = run(cfg, data)
    finally:
        if not cfg.keep and cfg.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    md = markdown(doc)
    print_results(doc, save_results(cfg.out, "sources", doc, md), md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
