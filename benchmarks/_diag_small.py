"""Small source batches (the CLI bench's 8 MiB): where does a batch's time go? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_small.py [--size-gib 2] [--out DIR]

Writes the CLI bench's layout (x: rows x 1024 float32, y: int64; contiguous HDF5 and a raw file), then
reads every batch to the device through H5Source / RawSource under variants: the consumer that sums each
batch (as ``gpufeed bench``) or that only takes it, reads of at least 1 or 4 MiB, 16 readers, more or
fewer batches read ahead, larger batches. Baselines in the same run: threads ``preadv``-ing the file
into pinned memory (no GPU), and the naive h5py + ``.to()`` loop. Prints GB/s, the consumer's wait and
its time outside ``next()`` per batch.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import gpufeed._source_batch as sb
from gpufeed import CudaPrefetcher
from gpufeed.sources import H5Source, RawSource

MiB = 1 << 20
FEATURES = 1024
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script only


def write(dirname: Path, size: int) -> tuple[Path, Path, int]:
    import h5py

    rows = size // (FEATURES * 4 + 8)
    h5, raw = dirname / "d.h5", dirname / "x.raw"
    rng = np.random.default_rng(0)
    block = rng.standard_normal((8192, FEATURES), dtype=np.float32)
    with h5py.File(h5, "w") as f, open(raw, "wb") as fr:
        x = f.create_dataset("x", shape=(rows, FEATURES), dtype="float32")
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64))
        for r in range(0, rows, 8192):
            k = min(8192, rows - r)
            x[r : r + k] = block[:k]
            fr.write(block[:k].tobytes())
    for p in (h5, raw):  # warm the page cache, as the CLI bench (which reads what it just wrote)
        with open(p, "rb") as fh:
            while fh.read(64 * MiB):
                pass
    return h5, raw, rows


def run_pf(src, bs, depth=2, touch=True, trace=None, threads=None):
    """Epoch 0 warms up (pool, allocator), epoch 1 is timed; stats are epoch 1's (differences)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    xsum = torch.zeros((), dtype=torch.float64, device=dev)
    with CudaPrefetcher(src, device=dev, batch_size=bs, depth=depth, trace=trace is not None,
                        num_threads=threads) as pf:
        for _epoch in range(2):
            before = pf.stats.as_dict()
            n = nb = 0
            touch_s = 0.0
            t0 = time.perf_counter()
            for b in pf:
                t_in = time.perf_counter()
                x = b["x"] if isinstance(b, dict) else b
                if touch:
                    xsum += x.sum()
                n += x.numel() * 4
                nb += 1
                touch_s += time.perf_counter() - t_in
            if dev.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        after = pf.stats.as_dict()
        if trace is not None:
            pf.export_trace(trace)
    d = {k: after[k] - before[k] for k in ("wait_s", "copy_s", "fetch_s")}
    return {"GBps": round(n / wall / 1e9, 2), "wait_frac": round(d["wait_s"] / wall, 3),
            "wait_us": round(d["wait_s"] / nb * 1e6, 1), "touch_us": round(touch_s / nb * 1e6, 1),
            "other_us": round((wall - d["wait_s"] - touch_s) / nb * 1e6, 1),
            "read_copy_ms": round(d["copy_s"] / nb * 1e3, 3), "batches": nb}


def pread_threads(path: Path, nbytes: int, piece: int, threads: int, batch: int) -> float:
    """GB/s of reading the file's first ``nbytes`` into a pinned batch buffer, ``piece`` bytes per read,
    ``threads`` readers, a batch at a time (each batch's reads in parallel, then the next batch)."""
    buf = torch.empty(batch, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    mv = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDONLY)
    ex = cf.ThreadPoolExecutor(threads)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes - batch + 1, batch):
            futs = [ex.submit(os.preadv, fd, [mv[o : o + piece]], off + o) for o in range(0, batch, piece)]
            for f in futs:
                f.result()
        return round(nbytes // batch * batch / (time.perf_counter() - t0) / 1e9, 2)
    finally:
        ex.shutdown()
        os.close(fd)


def naive(h5: Path, rows: int, bs: int) -> float:
    import h5py

    xsum = torch.zeros((), dtype=torch.float64, device=DEV)
    with h5py.File(h5, "r") as f:
        x = f["x"]
        t0 = time.perf_counter()
        for r in range(0, rows - bs + 1, bs):
            xsum += torch.from_numpy(x[r : r + bs]).to(DEV).sum()
        if DEV == "cuda":
            torch.cuda.synchronize()
        return round((rows // bs) * bs * FEATURES * 4 / (time.perf_counter() - t0) / 1e9, 2)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = {}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        h5, raw, rows = write(Path(d), int(args.size_gib * (1 << 30)))
        nbytes = rows * FEATURES * 4
        for piece, thr, batch in [(1 * MiB, 8, 8 * MiB), (1 * MiB, 16, 8 * MiB), (8 * MiB, 1, 8 * MiB),
                                  (2 * MiB, 4, 8 * MiB), (8 * MiB, 4, 32 * MiB)]:
            out[f"pread {piece // MiB} MiB x {thr} thr, {batch // MiB} MiB batches"] = pread_threads(
                raw, nbytes, piece, thr, batch)
            print(list(out.items())[-1], flush=True)
        out["naive h5py + .to(), 2048 rows"] = naive(h5, rows, 2048)
        print(list(out.items())[-1], flush=True)
        default_min, default_ahead = sb.MIN_READ_BYTES, sb.READ_AHEAD_BYTES
        variants = [
            ("h5 2048 (as CLI bench)", dict()),
            ("h5 2048 one batch ahead", dict(ahead=1)),
            ("h5 2048 min read 2 MiB", dict(min_read=2 * MiB)),
            ("h5 2048 min read 4 MiB", dict(min_read=4 * MiB)),
            ("h5 2048 min read 4 MiB, one ahead", dict(min_read=4 * MiB, ahead=1)),
            ("h5 2048 read ahead 64 MiB", dict(ahead=64 * MiB)),
            ("h5 2048 16 threads", dict(threads=16)),
            ("h5 8192", dict(bs=8192)),
            ("h5 8192 one batch ahead", dict(bs=8192, ahead=1)),
            ("raw 2048", dict(kind="raw")),
            ("raw 2048 one batch ahead", dict(kind="raw", ahead=1)),
        ]
        for name, v in variants:
            sb.MIN_READ_BYTES = v.get("min_read", default_min)
            sb.READ_AHEAD_BYTES = v.get("ahead", default_ahead)
            old_switch = sys.getswitchinterval()
            if "switch" in v:
                sys.setswitchinterval(v["switch"])
            try:
                src = (RawSource(raw, dtype=torch.float32, shape=FEATURES) if v.get("kind") == "raw"
                       else H5Source(h5, fields=["x", "y"]))
                traced = ("h5 2048 (as CLI bench)", "h5 2048 one batch ahead")
                trace = None
                if args.out and name in traced:
                    trace = args.out / f"trace-{re.sub('[^a-z0-9]+', '-', name)}.json"
                with src:
                    out[name] = run_pf(src, v.get("bs", 2048), v.get("depth", 2), v.get("touch", True), trace,
                                       v.get("threads"))
            except Exception as exc:  # keep going: one broken variant must not hide the others
                out[name] = f"{type(exc).__name__}: {exc}"
            finally:
                sys.setswitchinterval(old_switch)
                sb.MIN_READ_BYTES = default_min
                sb.READ_AHEAD_BYTES = default_ahead
            print(name, out[name], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "diag-small.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
