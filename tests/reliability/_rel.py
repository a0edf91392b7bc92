"""Shared helpers of the reliability suite: sources on disk, fault injectors, exact checks, counters.

Every test that verifies delivered bytes calls :func:`checked`; every test states what it saw with
:func:`note`. The report plugin (``_rel_plugin.py``, loaded by ``report.py``) reads both per test to write
``docs/reliability.md``; in a plain ``pytest`` run they only count.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpufeed.sources import RawSource

# -- counters read by the report -------------------------------------------------------------------

_LOCK = threading.Lock()
COUNTS = {"batches": 0, "mismatches": 0, "bytes": 0}
NOTES: list[str] = []


def checked(batches: int = 1, mismatches: int = 0, nbytes: int = 0) -> None:
    """Count batches whose every byte was compared with the source (thread-safe)."""
    with _LOCK:
        COUNTS["batches"] += batches
        COUNTS["mismatches"] += mismatches
        COUNTS["bytes"] += nbytes


def note(text: str) -> None:
    """Record what a case observed, for the report's "what happened" column (deduplicated there)."""
    with _LOCK:
        NOTES.append(text)


# -- sources on disk -------------------------------------------------------------------------------

#: Every host source kind the CPU suite covers (GDSSource runs in the cuda part).
KINDS = ["raw", "raw-multi", "manifest", "h5-contiguous", "h5-chunked", "h5-gzip", "h5-lzf"]
#: Kinds read with os.preadv (gzip chunks by their offsets in the chunk index); lzf goes through h5py.
BY_OFFSET = [k for k in KINDS if k != "h5-lzf"]
#: Kinds read straight from the file's bytes (the memory-map gather applies to them).
RAW_BYTES = [k for k in KINDS if k not in ("h5-gzip", "h5-lzf")]


def sample_data(n: int = 240, seed: int = 0) -> dict[str, np.ndarray]:
    """Three fields; ``y`` is the row number, so a batch says which rows it holds."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.integers(0, 256, size=(n, 4, 8), dtype=np.uint8),
        "y": np.arange(n, dtype=np.int64),
        "w": rng.standard_normal((n, 3)).astype(np.float32),
    }


class OnDisk:
    """A source of one kind over :func:`sample_data`, with the file to damage for each fault."""

    def __init__(self, kind: str, root: Path, n: int = 240, seed: int = 0) -> None:
        self.kind = kind
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.data = sample_data(n, seed)
        self.n = n
        self.late_file: Path  # holds the last rows of field x: truncate it to break the end of an epoch
        self.early_file: Path  # holds the first rows of field x: read (and so opened) by the first batch
        getattr(self, "_write_" + kind.replace("-", "_"))()

    def open(self, **kw: Any) -> Any:
        """A new source object over the files; ``kw`` goes to its constructor (e.g. ``mmap_gather``)."""
        return self._open(**kw)

    # one writer per kind; each sets _open, early_file and late_file
    def _write_raw(self) -> None:
        d = self.data
        np.save(self.root / "x.npy", d["x"])
        d["y"].tofile(self.root / "y.bin")
        np.save(self.root / "w.npy", d["w"])
        self.early_file = self.late_file = self.root / "x.npy"
        self._open = lambda **kw: RawSource(fields={"x": self.root / "x.npy",
                                                    "y": {"paths": self.root / "y.bin", "dtype": "int64"},
                                                    "w": self.root / "w.npy"}, **kw)

    def _write_raw_multi(self) -> None:
        d, n = self.data, self.n
        cuts = [0, n // 5, n // 2, n]
        xs = []
        for i, (a, b) in enumerate(itertools.pairwise(cuts)):
            xs.append(self.root / f"x{i}.npy")
            np.save(xs[-1], d["x"][a:b])
        (self.root / "y.bin").write_bytes(b"HDR-0123" + d["y"].tobytes())
        ws = []
        for i, (a, b) in enumerate([(0, n // 3), (n // 3, n)]):
            ws.append(self.root / f"w{i}.f32")
            d["w"][a:b].tofile(ws[-1])
        self.early_file, self.late_file = xs[0], xs[-1]
        self._open = lambda **kw: RawSource(fields={
            "x": xs, "y": {"paths": self.root / "y.bin", "dtype": "int64", "offset": 8},
            "w": {"paths": ws, "dtype": "float32", "shape": (3,)}}, **kw)

    def _write_manifest(self) -> None:
        from gpufeed.convert import convert_h5_to_raw

        self._h5(self.root / "in.h5", {})
        manifest = convert_h5_to_raw(self.root / "in.h5", self.root / "raw", align=1)
        x_file = json.loads(manifest.read_text())["fields"]["x"]["file"]  # x.gen-<id>.bin
        self.early_file = self.late_file = manifest.parent / x_file
        self._open = lambda **kw: RawSource(manifest, **kw)

    def _write_h5_contiguous(self) -> None:
        self._h5_kind({})

    def _write_h5_chunked(self) -> None:
        self._h5_kind({"x": {"chunks": (7, 4, 8)}, "y": {"chunks": (9,)}, "w": {"chunks": (5, 3)}})

    def _write_h5_gzip(self) -> None:
        gz = {"compression": "gzip", "shuffle": True}
        self._h5_kind({"x": {"chunks": (8, 4, 8), **gz}, "y": {"chunks": (8,), **gz},
                       "w": {"chunks": (8, 3), **gz}})

    def _write_h5_lzf(self) -> None:  # a filter gpufeed does not decode: the h5py path
        lzf = {"compression": "lzf"}
        self._h5_kind({"x": {"chunks": (8, 4, 8), **lzf}, "y": {"chunks": (8,), **lzf},
                       "w": {"chunks": (8, 3), **lzf}})

    def _h5_kind(self, kw: dict) -> None:
        from gpufeed.sources import H5Source

        path = self.root / "data.h5"
        self._h5(path, kw)
        self.early_file = self.late_file = path
        self._open = lambda **kw: H5Source(path, fields=["x", "y", "w"], **kw)

    def _h5(self, path: Path, kw: dict) -> None:
        import h5py

        with h5py.File(path, "w") as f:
            for name, arr in self.data.items():
                f.create_dataset(name, data=arr, **kw.get(name, {}))


def expected_rows(batch: Mapping[str, torch.Tensor]) -> np.ndarray:
    return batch["y"].cpu().numpy()


def batch_mismatches(batch: Mapping[str, torch.Tensor], data: Mapping[str, np.ndarray],
                     rows: np.ndarray | None = None) -> int:
    """Fields of ``batch`` whose bytes differ from ``data[rows]`` (rows default to the batch's ``y``)."""
    if rows is None:
        rows = expected_rows(batch)
    bad = 0
    for name, arr in data.items():
        got = batch[name].cpu().contiguous().numpy()
        want = arr[rows]
        if got.shape != want.shape or got.dtype != want.dtype or got.tobytes() != want.tobytes():
            bad += 1
    return bad


def plan_rows(rows: Any) -> np.ndarray:
    return np.arange(rows.start, rows.stop) if isinstance(rows, range) else np.asarray(rows)


def check_epoch(batches: list[Mapping[str, torch.Tensor]], data: Mapping[str, np.ndarray], plan: list[Any],
                complete: bool = True) -> None:
    """Assert the batches equal the plan's rows byte for byte, in order (a prefix unless ``complete``)."""
    if complete:
        assert len(batches) == len(plan), (len(batches), len(plan))
    else:
        assert len(batches) <= len(plan)
    bad = 0
    for b, rows in zip(batches, plan, strict=False):  # a prefix when incomplete
        r = plan_rows(rows)
        assert np.array_equal(expected_rows(b), r), "batch rows differ from the plan"
        bad += batch_mismatches(b, data, r)
    checked(len(batches), bad, sum(sum(t.numel() * t.element_size() for t in b.values()) for b in batches))
    assert bad == 0, f"{bad} fields differ from the source"


def keep(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu().clone() for k, v in batch.items()}


# -- fault injectors -------------------------------------------------------------------------------

class Injected(OSError):
    """The error a fault injector raises (an OSError, like a failing disk)."""


class FaultySource:
    """Wraps a BatchSource: ``read`` raises ``exc`` for rows containing ``fail_row`` (``times`` times),
    or, for rows containing ``block_row``, waits up to ``block_s`` seconds on ``gate`` (an Event)."""

    def __init__(self, inner: Any, fail_row: int | None = None, times: int = 1,
                 exc: BaseException | None = None, block_row: int | None = None,
                 block_s: float = 20.0) -> None:
        self.inner = inner
        self.fail_row = fail_row
        self.times = times
        self.exc = exc or Injected(5, f"injected read error at row {fail_row}")
        self.block_row = block_row
        self.gate = threading.Event()
        self.block_s = block_s
        self.reads = 0
        self._lock = threading.Lock()

    @property
    def fields(self) -> Any:
        return self.inner.fields

    @property
    def reads_to(self) -> str:
        return self.inner.reads_to

    def __len__(self) -> int:
        return len(self.inner)

    def read(self, rows: Any, out: Any) -> None:
        r = plan_rows(rows)
        with self._lock:
            self.reads += 1
            fail = self.fail_row is not None and self.times > 0 and bool(np.isin(self.fail_row, r))
            if fail:
                self.times -= 1
        if fail:
            raise self.exc
        if self.block_row is not None and bool(np.isin(self.block_row, r)):
            self.gate.wait(self.block_s)
        self.inner.read(rows, out)

    def close(self) -> None:
        self.inner.close()


@contextmanager
def failing_preadv(after: int, times: int = 1) -> Iterator[dict]:
    """A positional read raises EIO on call number ``after`` (0-based) and ``times - 1`` calls after it:
    ``os.preadv``, and the native reader's calls (each one call, however many reads it makes)."""
    from gpufeed.sources import _pread

    real, native = os.preadv, _pread._NATIVE
    state = {"calls": 0, "raised": 0}
    lock = threading.Lock()

    def failing(what: str, call: Any) -> Any:
        def wrapper(*a: Any) -> Any:
            with lock:
                k = state["calls"]
                state["calls"] += 1
                fail = after <= k < after + times
                if fail:
                    state["raised"] += 1
            if fail:
                raise OSError(5, f"Input/output error (injected into {what})")
            return call(*a)

        return wrapper

    os.preadv = failing("os.preadv", real)
    if native is not None:
        _pread._NATIVE = failing("the native reader", native)
    try:
        yield state
    finally:
        os.preadv, _pread._NATIVE = real, native


@contextmanager
def failing_read_direct(after: int) -> Iterator[dict]:
    """h5py's ``Dataset.read_direct`` raises on call ``after`` (the h5py path of H5Source)."""
    import h5py

    real = h5py.Dataset.read_direct
    state = {"calls": 0}
    lock = threading.Lock()

    def read_direct(self: Any, *a: Any, **kw: Any) -> Any:
        with lock:
            k = state["calls"]
            state["calls"] += 1
        if k == after:
            raise OSError(5, "Can't read data (injected into h5py read_direct)")
        return real(self, *a, **kw)

    h5py.Dataset.read_direct = read_direct
    try:
        yield state
    finally:
        h5py.Dataset.read_direct = real


# -- process resources -----------------------------------------------------------------------------

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


def open_fds() -> list[str]:
    """Targets of this process's open file descriptors."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the descriptor listdir itself used
    return out


def seconds(fn: Any) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def shut_down_loader_workers(exc: BaseException) -> int:
    """Shut down the workers of every DataLoader iterator in ``exc``'s traceback; returns how many.

    A DataLoader whose worker failed is referenced by the exception's frames (and by a reference cycle
    torch's worker-exception path creates), so its other workers live until a GC pass, where torch's
    finalizer takes 5 s per worker and reports closed descriptors. Tests shut them down explicitly.
    """
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    n = 0
    tb = exc.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, _MultiProcessingDataLoaderIter):
            _shut_down(obj)
            n += 1
        tb = tb.tb_next
    # A worker's death can also surface in the main thread, raised by the SIGCHLD handler that a
    # DataLoader first iterated there installs: that traceback holds no iterator.
    for obj in gc.get_objects():
        if type(obj) is _MultiProcessingDataLoaderIter and not obj._shutdown:  # (no __class__ lookups)
            _shut_down(obj)
            n += 1
    return n


def _shut_down(it: Any) -> None:
    """``it._shutdown_workers()``. The SIGCHLD handler torch installs in the main thread may report the
    worker's death (which the test has already seen reach the consumer) once more while this joins the
    other workers: that late report is not an error of the shutdown, which then runs to its end."""
    try:
        it._shutdown_workers()
    except RuntimeError as e:
        if "is killed by signal" not in str(e):
            raise
        it._shutdown_workers()
