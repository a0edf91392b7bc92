"""``gpufeed bench``: synthetic HDF5 data read to the device by the naive loop, a DataLoader and gpufeed.

Every method reads the same file, the same rows in the same order and the same batches; each touches
every batch (a sum of ``x`` and of ``y`` on the device, accumulated there so no method synchronizes per
step) and synchronizes the device once at the end, inside its timed region. ``sum(y)`` is checked
against its exact expected value, so a method that lost or repeated a row fails instead of looking fast.

A run is sized by time, not bytes: it repeats epochs over the file until it has lasted ``--min-seconds``
(at least one epoch), so a small file on a fast machine still gives a figure that a timer's resolution
and one stray hiccup do not swing. The methods run in ``--repeat`` interleaved rounds; the report keeps
each method's median round and the range of all of them.

Consumer wait: for gpufeed, ``pf.stats.stall_fraction`` (time blocked in ``next()`` / wall time since the
first ``next()``); for the baselines, the host time spent getting a batch and issuing its copy
(``next()`` plus ``.to(device)``) over the wall time of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from gpufeed._cli_util import CLIError, format_bytes, native_reader, parse_size, say, table
from gpufeed.loaders.source_loader import SourceLoader

FEATURES = 1024  # x is (rows, FEATURES) float32: 4 KiB per sample, plus 8 bytes of y
DEFAULT_SIZE_CPU = "256MiB"
DEFAULT_SIZE_CUDA = "4GiB"
DEFAULT_BATCH_SIZE = 2048  # rows: 8 MiB of x per batch
WRITE_BLOCK_BYTES = 64 << 20

DEFAULT_MIN_SECONDS = 1.0
DEFAULT_ROUNDS = 5
#: A method whose fastest round beat its slowest by more than this makes the verdict say to distrust them.
NOISY_RATIO = 1.25

#: What a run without a GPU can and cannot show, printed before its numbers and stored in bench.json.
CPU_NOTE = (
    "no GPU: this run measures reading and batching on the CPU only (every batch lands in host memory);",
    "copies to the device, pinned memory and overlap with GPU compute are not measured, and they are",
    "where gpufeed's speed-up lies. Run it on a GPU machine for what gpufeed is built for.",
)

#: What the ``wait %`` column means, printed under the table.
WAIT_NOTE = (
    "wait %: the share of a run the loop spent waiting for its next batch (baselines: in next() and .to();",
    "gpufeed: blocked in next()). The loop only sums each batch: lower means batches were ready ahead.",
)

#: (key, label) in the order they run; labels may be completed at run time (workers, GDS mode).
METHODS = (
    ("naive", "naive h5py + .to()"),
    ("dataloader", "DataLoader + .to()"),
    ("gpufeed_loader", "gpufeed(DataLoader)"),
    ("gpufeed_h5", "gpufeed H5Source"),
    ("gpufeed_gds", "gpufeed GDSSource"),
)
METHOD_KEYS = tuple(k for k, _ in METHODS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None,
                   help=f"bytes of synthetic data, e.g. 2GiB (default: {DEFAULT_SIZE_CPU} on CPU, "
                        f"{DEFAULT_SIZE_CUDA} on CUDA)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"rows per batch; a row is {FEATURES * 4 + 8} bytes (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--out", default="gpufeed-bench", help="folder for bench.json and bench.png")
    p.add_argument("--json", action="store_true", help="print bench.json to stdout (progress goes to stderr)")
    p.add_argument("--no-chart", action="store_true", help="do not write bench.png")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader num_workers (default: half the CPUs, at most 8, as a user sizes them)")
    p.add_argument("--depth", type=int, default=2, help="gpufeed prefetch depth (default 2)")
    p.add_argument("--repeat", type=int, default=DEFAULT_ROUNDS,
                   help="rounds: runs of each method, interleaved; the median run is reported (the lower "
                        f"middle one for an even count) with the range of all (default {DEFAULT_ROUNDS})")
    p.add_argument("--min-seconds", type=float, default=DEFAULT_MIN_SECONDS,
                   help="each run repeats epochs over the file until it has lasted this long, at least one "
                        f"epoch (default {DEFAULT_MIN_SECONDS:g}; 0: one epoch)")
    p.add_argument("--methods", default=",".join(METHOD_KEYS),
                   help=f"comma-separated subset of: {', '.join(METHOD_KEYS)}")
    p.add_argument("--data-dir", default=None,
                   help="where to write the temporary HDF5 file (default: the system temp folder)")
    p.add_argument("--keep-data", action="store_true", help="keep the HDF5 file (its path is printed)")
    p.add_argument("--trace", action="store_true",
                   help="write a Chrome/Perfetto trace per gpufeed method and run into --out "
                        "(trace-<method>-run<N>.json; trace-<method>.json with --repeat 1)")


@dataclass
class Config:
    device: torch.device
    size: int
    rows: int
    batch_size: int
    workers: int
    depth: int
    methods: tuple[str, ...]
    repeat: int = DEFAULT_ROUNDS
    min_seconds: float = DEFAULT_MIN_SECONDS
    run: int = 1  # the round being measured (1 .. repeat)
    path: str = ""
    row_bytes: int = FEATURES * 4 + 8
    trace_dir: Path | None = None  # write the gpufeed methods' traces here

    @property
    def batches(self) -> int:
        return math.ceil(self.rows / self.batch_size)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def expected_ysum(self) -> int:
        return self.rows * (self.rows - 1) // 2  # y[i] = i


@dataclass
class Result:
    key: str
    name: str
    status: str  # "ok" | "skipped" | "failed"
    reason: str = ""
    seconds: float = 0.0
    bytes: int = 0
    batches: int = 0
    epochs: int = 0
    GBps: float = 0.0
    wait_fraction: float = 0.0
    speedup: float | None = None
    verified: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.status != "ok":
            for k in ("seconds", "bytes", "batches", "epochs", "GBps", "wait_fraction", "speedup",
                      "verified"):
                d.pop(k)
        return d


class Skip(Exception):
    """A method that cannot run here (missing backend, no CUDA); not an error."""


# -- entry point ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    progress: TextIO = sys.stderr if args.json else sys.stdout
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.trace_dir = out if args.trace else None
    data_dir = tempfile.mkdtemp(prefix="gpufeed-bench-", dir=args.data_dir)
    try:
        _header(cfg, progress)
        t0 = time.perf_counter()
        cfg.path = write_dataset(os.path.join(data_dir, "bench.h5"), cfg.rows)
        say(f"  data: {cfg.path} ({format_bytes(cfg.nbytes)} written in {time.perf_counter() - t0:.1f}s; "
            "reads come from the page cache)", progress)
        _warm_device(cfg.device)
        results = run_methods(cfg, progress)
    finally:
        if args.keep_data:
            say(f"  kept the data set: {data_dir}", progress)
        else:
            shutil.rmtree(data_dir, ignore_errors=True)
    doc = report(cfg, results)
    (out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    written = [str(out / "bench.json")]
    if not args.no_chart:
        chart = write_chart(doc, out / "bench.png")
        if chart is None:
            say("  chart skipped: matplotlib is not installed (pip install matplotlib)", progress)
        else:
            written.append(chart)
    say("", progress)
    say(render_table(doc), progress)
    for line in WAIT_NOTE:
        say(line, progress)
    for line in doc["verdict"]:
        say(line, progress)
    written += [m["extra"]["trace"] for m in doc["methods"] if "trace" in m.get("extra", {})]
    say(f"wrote {', '.join(written)}", progress)
    if args.json:
        print(json.dumps(doc, indent=2), flush=True)
    return 1 if any(r.status == "failed" for r in results) else 0


def _config(args: argparse.Namespace) -> Config:
    device = _device(args.device)
    size_text = args.size or (DEFAULT_SIZE_CUDA if device.type == "cuda" else DEFAULT_SIZE_CPU)
    try:
        size = parse_size(size_text)
    except ValueError as exc:
        raise CLIError(f"--size: {exc}") from None
    row_bytes = FEATURES * 4 + 8
    if size < row_bytes:
        raise CLIError(f"--size {size_text} is smaller than one row ({row_bytes} bytes); use e.g. 8MiB")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.workers is None:
        args.workers = min(8, max(1, (os.cpu_count() or 2) // 2))
    if args.workers < 0:
        raise CLIError(f"--workers must be >= 0, got {args.workers}")
    if args.depth < 1:
        raise CLIError(f"--depth must be >= 1, got {args.depth}")
    if args.repeat < 1:
        raise CLIError(f"--repeat must be >= 1, got {args.repeat}")
    if not args.min_seconds >= 0:  # also rejects nan
        raise CLIError(f"--min-seconds must be >= 0, got {args.min_seconds}")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHOD_KEYS]
    if unknown or not methods:
        raise CLIError(f"--methods: unknown {', '.join(unknown) or '(none given)'}; "
                       f"choose from {', '.join(METHOD_KEYS)}")
    return Config(device=device, size=size, rows=size // row_bytes, batch_size=args.batch_size,
                  workers=args.workers, depth=args.depth, methods=methods, repeat=args.repeat,
                  min_seconds=args.min_seconds)


def _device(text: str | None) -> torch.device:
    if text is None:
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        raise CLIError(f"--device must be cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {text}: CUDA is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise CLIError(f"--device must be cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda" and dev.index is None:  # tensors report cuda:N; compare like with like
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _header(cfg: Config, out: TextIO) -> None:
    if cfg.device.type == "cuda":
        where = f"device {cfg.device} ({torch.cuda.get_device_name(cfg.device)})"
    else:
        where = "device cpu"
    batch_bytes = cfg.batch_size * cfg.row_bytes
    say(f"gpufeed bench: {format_bytes(cfg.nbytes)} synthetic HDF5 (x float32 [{cfg.rows}, {FEATURES}], "
        f"y int64 [{cfg.rows}]), batch {cfg.batch_size} rows ({format_bytes(batch_bytes)}), "
        f"{cfg.batches} batches, {where}", out)
    say(f"  read path: {read_path()}", out)
    say(f"  timing: {cfg.repeat} interleaved round(s), each method repeating epochs for >= "
        f"{cfg.min_seconds:g} s a round; shown: the median round and the range", out)
    if cfg.device.type != "cuda":
        for line in CPU_NOTE:
            say(f"  {line}", out)


def read_path() -> str:
    """Which reader gpufeed's sources use here, in words (the check ``gpufeed doctor`` makes)."""
    native, why = native_reader()
    if native:
        return "native C reader (_pread_many.so): gpufeed's sources read files in C, the GIL released"
    return f"Python os.preadv loop: the native C reader _pread_many.so is not in use ({why})"


def _warm_device(device: torch.device) -> None:
    """Create the CUDA context before any timed region."""
    if device.type == "cuda":
        torch.empty(1, device=device).add_(1)
        torch.cuda.synchronize(device)


# -- data ----------------------------------------------------------------------------------------------


def write_dataset(path: str, rows: int) -> str:
    """Write ``x`` (rows, FEATURES) float32 and ``y`` = arange(rows) int64, both contiguous, in blocks."""
    from gpufeed._extras import require

    h5py = require("h5py", "gpufeed bench")
    block = max(1, WRITE_BLOCK_BYTES // (FEATURES * 4))
    pattern = (np.arange(block * FEATURES, dtype=np.int64) % 251).astype(np.float32).reshape(block, FEATURES)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", shape=(rows, FEATURES), dtype="float32")  # contiguous: no chunks
        y = f.create_dataset("y", shape=(rows,), dtype="int64")
        for a in range(0, rows, block):
            b = min(rows, a + block)
            x[a:b] = pattern[: b - a]
            y[a:b] = np.arange(a, b, dtype=np.int64)
    # Finish the write-back before timing, so no method's reads compete with it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


class H5Batches(torch.utils.data.Dataset):
    """Map-style dataset whose item ``i`` is batch ``i`` (an h5py slice); the file opens lazily per worker."""

    def __init__(self, path: str, rows: int, batch_size: int) -> None:
        self.path, self.rows, self.batch_size = path, rows, batch_size
        self._file: Any = None  # opened in the process that reads (each DataLoader worker), never pickled

    def __len__(self) -> int:
        return math.ceil(self.rows / self.batch_size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self._file is None:
            import h5py

            self._file = h5py.File(self.path, "r")
        a, b = i * self.batch_size, min(self.rows, (i + 1) * self.batch_size)
        return {"x": torch.from_numpy(self._file["x"][a:b]), "y": torch.from_numpy(self._file["y"][a:b])}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None}


def make_loader(cfg: Config) -> torch.utils.data.DataLoader:
    """The DataLoader both the baseline and gpufeed(DataLoader) use: one batch per item, in order."""
    return torch.utils.data.DataLoader(
        H5Batches(cfg.path, cfg.rows, cfg.batch_size),
        batch_size=None,  # items are already batches
        shuffle=False,
        num_workers=cfg.workers,
        pin_memory=cfg.device.type == "cuda",
    )


# -- methods -------------------------------------------------------------------------------------------


class _Meter:
    """Touches every batch on the device and keeps the consumer's wait time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.xsum = torch.zeros((), dtype=torch.float64, device=device)
        self.ysum = torch.zeros((), dtype=torch.int64, device=device)
        self.batches = 0
        self.rows = 0
        self.epochs = 0
        self.wait_s = 0.0
        self.stall_fraction: float | None = None  # set by gpufeed runs, from pf.stats

    def touch(self, batch: dict[str, torch.Tensor]) -> None:
        x, y = batch["x"], batch["y"]
        if x.device != self.device or y.device != self.device:
            raise RuntimeError(f"a batch arrived on {x.device}, expected {self.device}")
        self.xsum += x.sum()
        self.ysum += y.sum()
        self.batches += 1
        self.rows += int(y.shape[0])

    def finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


Move = Callable[[Any], dict[str, torch.Tensor]]


def _epochs(cfg: Config, meter: _Meter) -> Iterator[int]:
    """Epoch numbers until the run has lasted ``cfg.min_seconds``, at least one; counted in ``meter``."""
    t0 = time.perf_counter()
    while meter.epochs == 0 or time.perf_counter() - t0 < cfg.min_seconds:
        yield meter.epochs
        meter.epochs += 1


def _timed_loop(cfg: Config, epoch: Callable[[], Iterable[Any]], move: Move) -> _Meter:
    """Run ``epoch()``'s batches through ``move`` and the meter, epoch after epoch (see ``_epochs``)."""
    meter = _Meter(cfg.device)
    for _ in _epochs(cfg, meter):
        it = iter(epoch())
        while True:
            t = time.perf_counter()
            raw = next(it, None)
            if raw is None:
                meter.wait_s += time.perf_counter() - t
                break
            batch = move(raw)
            meter.wait_s += time.perf_counter() - t
            meter.touch(batch)
    meter.finish()
    return meter


def _naive(cfg: Config) -> tuple[_Meter, str, dict[str, Any]]:
    import h5py

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with h5py.File(cfg.path, "r") as f:
            x, y = f["x"], f["y"]
            for a in range(0, cfg.rows, cfg.batch_size):
                b = min(cfg.rows, a + cfg.batch_size)
                yield x[a:b], y[a:b]

    def move(raw: tuple[np.ndarray, np.ndarray]) -> dict[str, torch.Tensor]:
        return {"x": torch.from_numpy(raw[0]).to(cfg.device), "y": torch.from_numpy(raw[1]).to(cfg.device)}

    return _timed_loop(cfg, batches, move), "", {}


def _dataloader(cfg: Config) -> tuple[_Meter, str, dict[str, Any]]:
    loader = make_loader(cfg)  # one loader over the epochs, as a training loop keeps it
    nb = cfg.device.type == "cuda"

    def move(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(cfg.device, non_blocking=nb) for k, v in raw.items()}

    pin = ", pinned" if loader.pin_memory else ""
    meter = _timed_loop(cfg, lambda: loader, move)
    return meter, f"DataLoader ({cfg.workers} workers{pin}) + .to()", {}


def _prefetched(cfg: Config, key: str, source: Any, **kw: Any) -> tuple[_Meter, dict[str, Any]]:
    from gpufeed import CudaPrefetcher

    meter = _Meter(cfg.device)
    extra: dict[str, Any] = {}
    if cfg.trace_dir is not None:
        kw["trace"] = True
    with CudaPrefetcher(source, device=cfg.device, depth=cfg.depth, **kw) as pf:
        for _ in _epochs(cfg, meter):  # one prefetcher over the epochs, as a training loop keeps it
            for batch in pf:
                meter.touch(batch)
        meter.finish()
        meter.stall_fraction = pf.stats.stall_fraction
        extra["stats"] = pf.stats.as_dict()
        if cfg.trace_dir is not None:
            name = f"trace-{key}.json" if cfg.repeat == 1 else f"trace-{key}-run{cfg.run}.json"
            extra["trace"] = str(pf.export_trace(cfg.trace_dir / name))
    return meter, extra


def _gpufeed_loader(cfg: Config) -> tuple[_Meter, str, dict[str, Any]]:
    meter, extra = _prefetched(cfg, "gpufeed_loader", make_loader(cfg))
    return meter, f"gpufeed(DataLoader, {cfg.workers} workers)", extra


def _gpufeed_h5(cfg: Config) -> tuple[_Meter, str, dict[str, Any]]:
    H5Source = _import_source("H5Source")
    with H5Source(cfg.path, fields=["x", "y"]) as src:
        paths = dict(src.paths_taken)
        meter, extra = _prefetched(cfg, "gpufeed_h5", SourceLoader(src, batch_size=cfg.batch_size))
    extra["paths_taken"] = paths
    return meter, "", extra


def _gpufeed_gds(cfg: Config) -> tuple[_Meter, str, dict[str, Any]]:
    if cfg.device.type != "cuda":
        raise Skip("needs CUDA (GPUDirect Storage reads into GPU memory)")
    import importlib.util

    if importlib.util.find_spec("kvikio") is None:
        raise Skip("kvikio is not installed (pip install 'gpufeed[gds]')")
    GDSSource = _import_source("GDSSource")
    src = GDSSource(cfg.path, fields=["x", "y"])
    try:
        meter, extra = _prefetched(cfg, "gpufeed_gds", SourceLoader(src, batch_size=cfg.batch_size))
    finally:
        src.close()
    extra["mode"] = src.mode
    return meter, f"gpufeed GDSSource ({src.mode})", extra


def _import_source(name: str) -> Any:
    try:
        import gpufeed.sources as sources
    except ImportError as exc:
        raise Skip(f"gpufeed.sources is not importable here ({exc})") from None
    cls = getattr(sources, name, None)
    if cls is None:
        raise Skip(f"gpufeed.sources.{name} does not exist in this version of gpufeed")
    return cls


_RUNNERS: dict[str, Callable[[Config], tuple[_Meter, str, dict[str, Any]]]] = {
    "naive": _naive,
    "dataloader": _dataloader,
    "gpufeed_loader": _gpufeed_loader,
    "gpufeed_h5": _gpufeed_h5,
    "gpufeed_gds": _gpufeed_gds,
}


def run_methods(cfg: Config, progress: TextIO) -> list[Result]:
    """Run every selected method ``cfg.repeat`` times, in rounds (so drift in the machine's state hits
    every method alike), and keep each method's median run."""
    selected = [(k, label) for k, label in METHODS if k in cfg.methods]
    runs: dict[str, list[Result]] = {k: [] for k, _ in selected}
    for round_ in range(1, cfg.repeat + 1):
        for i, (key, label) in enumerate(selected, 1):
            if runs[key] and runs[key][-1].status != "ok":
                continue  # skipped or failed: once is enough
            cfg.run = round_
            res = _measure(cfg, key, label)
            if res.status == "failed" and round_ > 1:  # its earlier runs were fine
                res.reason = f"run {round_} of {cfg.repeat}: {res.reason}"
            runs[key].append(res)
            tag = f"{i}/{len(selected)}" + (f", run {round_}/{cfg.repeat}" if round_ > 1 else "")
            say(f"  [{tag}] {res.name:<34} {_progress_tail(res)}", progress)
    results = [_median_run(runs[k]) for k, _ in selected]
    base = next((r for r in results if r.key == "naive" and r.status == "ok"), None)
    for r in results:
        if r.status == "ok" and base is not None and base.GBps > 0:
            r.speedup = r.GBps / base.GBps
    return results


def _median_run(runs: list[Result]) -> Result:
    if runs[-1].status != "ok":
        return runs[-1]
    ranked = sorted(runs, key=lambda r: r.GBps)
    res = ranked[(len(ranked) - 1) // 2]
    res.extra["runs_GBps"] = [round(r.GBps, 3) for r in runs]
    res.extra["range_GBps"] = [round(ranked[0].GBps, 3), round(ranked[-1].GBps, 3)]
    return res


def _measure(cfg: Config, key: str, label: str) -> Result:
    gc.collect()  # a full collection of earlier methods' garbage would land in this method's time
    t0 = time.perf_counter()
    try:
        meter, name, extra = _RUNNERS[key](cfg)
    except Skip as exc:
        return Result(key, label, "skipped", reason=str(exc))
    except Exception as exc:  # one broken method must not hide the others' numbers
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return Result(key, label, "failed", reason=detail)
    seconds = time.perf_counter() - t0
    wait = meter.stall_fraction if meter.stall_fraction is not None else meter.wait_s / seconds
    ysum = int(meter.ysum.item())
    res = Result(key, name or label, "ok", seconds=seconds, bytes=meter.rows * cfg.row_bytes,
                 batches=meter.batches, epochs=meter.epochs, GBps=meter.rows * cfg.row_bytes / seconds / 1e9,
                 wait_fraction=min(1.0, wait), extra=extra)
    rows, want = meter.epochs * cfg.rows, meter.epochs * cfg.expected_ysum
    res.verified = meter.rows == rows and ysum == want
    if not res.verified:
        res.status = "failed"
        over = f" over {meter.epochs} epochs" if meter.epochs > 1 else ""
        res.reason = (f"delivered {meter.rows} rows with sum(y) = {ysum}{over}; expected {rows} rows "
                      f"with sum(y) = {want} (rows lost, repeated or corrupted)")
    return res


def _progress_tail(r: Result) -> str:
    if r.status == "ok":
        return f"{r.GBps:7.2f} GB/s  wait {r.wait_fraction:6.1%}  {r.seconds:6.2f} s  {r.epochs:3d} epochs"
    return f"{r.status}: {r.reason}"


# -- report --------------------------------------------------------------------------------------------


def report(cfg: Config, results: list[Result]) -> dict[str, Any]:
    from gpufeed import __version__

    cuda = cfg.device.type == "cuda"
    doc = {
        "gpufeed": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(cfg.device),
        "device_name": torch.cuda.get_device_name(cfg.device) if cuda else platform.processor() or "cpu",
        "cuda": cuda,
        "note": "" if cuda else " ".join(CPU_NOTE),
        "read_path": {"native": native_reader()[0], "description": read_path()},
        "config": {
            "size_bytes": cfg.nbytes,
            "rows": cfg.rows,
            "row_bytes": cfg.row_bytes,
            "batch_size": cfg.batch_size,
            "batches": cfg.batches,
            "workers": cfg.workers,
            "depth": cfg.depth,
            "rounds": cfg.repeat,
            "min_seconds": cfg.min_seconds,
            "cpu_count": os.cpu_count(),
        },
        "methods": [r.as_json() for r in results],
    }
    doc["verdict"] = verdict(doc)
    return doc


TABLE_HEADER = ("method", "GB/s", "range", "wait %", "vs naive", "time s", "epochs", "note")


def render_table(doc: dict[str, Any]) -> str:
    """The results table: one row per method (its median round; ``range``: the GB/s of its slowest and
    fastest rounds), skipped and failed ones with the reason in ``note``."""
    rows = []
    for m in doc["methods"]:
        if m["status"] == "ok":
            speed = f"{m['speedup']:.2f}x" if m["speedup"] is not None else "-"
            lo, hi = m["extra"].get("range_GBps", (m["GBps"], m["GBps"]))
            rows.append([m["name"], f"{m['GBps']:.2f}", f"{lo:.2f}-{hi:.2f}", f"{m['wait_fraction']:.1%}",
                         speed, f"{m['seconds']:.2f}", m["epochs"], ""])
        else:
            rows.append([m["name"], "-", "-", "-", "-", "-", "-", f"{m['status']}: {m['reason']}"])
    return table(TABLE_HEADER, rows, "lrrrrrrl")


def verdict(doc: dict[str, Any]) -> list[str]:
    """What the run shows on this machine, in plain words: the first line starts ``verdict:``."""
    ok = [m for m in doc["methods"] if m["status"] == "ok"]
    if not ok:
        return ["verdict: no method ran here; the table's notes say why"]
    lines = [] if doc["cuda"] else [
        "no GPU here: this measures the CPU path only; gpufeed's speed-up is on a GPU, where it overlaps "
        "reading and copying with compute."]
    lines += _against_naive(doc, ok)
    best = max(ok, key=lambda m: m["GBps"])
    vs = f", {best['speedup']:.1f}x the naive loop" if best["speedup"] and best["key"] != "naive" else ""
    lines.append(f"fastest: {best['name']} at {best['GBps']:.2f} GB/s{vs}")
    lines.append(_spread(ok, doc["config"]["rounds"]))
    return [f"verdict: {lines[0]}"] + [f"  {line}" for line in lines[1:]]


def _against_naive(doc: dict[str, Any], ok: list[dict[str, Any]]) -> list[str]:
    mine = [m for m in ok if m["key"].startswith("gpufeed")]
    if not mine or not any(m["key"] == "naive" for m in ok):
        return []
    top = max(mine, key=lambda m: m["GBps"])
    ratio = top["speedup"]
    if ratio >= 1.15:
        return [f"gpufeed's best here, {top['name']}, delivered {ratio:.1f}x the naive loop's rate."]
    if ratio > 1 / 1.15:
        return [f"gpufeed's best here, {top['name']}, is level with the naive loop ({ratio:.2f}x)."]
    why = (f" On a CPU its reader threads share {doc['config']['cpu_count']} cores with the loop and there "
           "is no device copy to hide behind." if not doc["cuda"] else "")
    return [f"gpufeed's best here, {top['name']}, was slower than the naive loop ({ratio:.2f}x).{why}"]


def _spread(ok: list[dict[str, Any]], rounds: int) -> str:
    if rounds < 2:
        return "one round only: no measure of how much the figures vary (use --repeat 3 or more)."
    worst = max(ok, key=lambda m: m["extra"]["range_GBps"][1] / max(m["extra"]["range_GBps"][0], 1e-12))
    lo, hi = worst["extra"]["range_GBps"]
    ratio = hi / max(lo, 1e-12)
    if ratio > NOISY_RATIO:
        return (f"the rounds disagree: {worst['name']} ran {lo:.2f}-{hi:.2f} GB/s ({ratio:.1f}x); the "
                "machine is busy or its state drifts: trust the medians less, or run again with a larger "
                "--min-seconds.")
    return f"the rounds agree: every method's fastest round within {ratio:.2f}x of its slowest."


def write_chart(doc: dict[str, Any], path: Path) -> str | None:
    """A bar chart of GB/s per method (Agg backend, no display needed); None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    ok = [m for m in doc["methods"] if m["status"] == "ok"]
    fig = Figure(figsize=(8, 0.6 * max(3, len(ok)) + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = [m["name"] for m in ok][::-1]
    values = [m["GBps"] for m in ok][::-1]
    colors = ["#76b900" if m["key"].startswith("gpufeed") else "#888888" for m in ok][::-1]
    bars = ax.barh(names, values, color=colors)
    for bar, m in zip(bars, ok[::-1], strict=True):
        ax.annotate(f" {m['GBps']:.2f} GB/s, wait {m['wait_fraction']:.0%}",
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    ax.set_xlabel("GB/s delivered to the device (higher is better)")
    ax.set_xlim(0, max(values, default=1) * 1.45 or 1)
    title = f"gpufeed bench: {format_bytes(doc['config']['size_bytes'])} HDF5 -> {doc['device']}"
    ax.set_title(title if doc["cuda"] else title + " (CPU only: no H2D copy)", fontsize=10)
    with contextlib.suppress(AttributeError):
        ax.spines[["top", "right"]].set_visible(False)
    fig.savefig(path, dpi=120)
    return str(path)
