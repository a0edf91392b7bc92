"""HDF5 straight to the GPU with ``H5Source``: contiguous datasets are read by byte offset in parallel.

    python examples/hdf5_to_gpu.py                     # writes a synthetic train.h5 in a temp folder
    python examples/hdf5_to_gpu.py --file data.h5 --fields images labels
    python examples/hdf5_to_gpu.py --smoke             # tiny, on the CPU

gpufeed does the sampling, batching and shuffling (``batch_size=``, ``shuffle=``); the source only reads
rows into the prefetcher's pinned buffers, and each batch is a dict of device tensors, one per field.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

from gpufeed import CudaPrefetcher, SourceLoader


def write_example(path: str, samples: int, features: int) -> None:
    """A small data set: ``x`` (samples, features) float32 and ``y`` = arange(samples), both contiguous."""
    import h5py

    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(0).standard_normal((samples, features), dtype=np.float32)
        f["y"] = np.arange(samples, dtype=np.int64)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", default=None, help="an HDF5 file (default: write a synthetic one)")
    p.add_argument("--fields", nargs="+", default=None, help="datasets to read (default: x y)")
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--smoke", action="store_true", help="tiny and quick, on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.features, args.batch_size, args.device = 1000, 8, 128, args.device or "cpu"
    try:
        from gpufeed.sources import H5Source
    except ImportError as exc:
        print(f"this example needs gpufeed's sources and h5py: {exc}", file=sys.stderr)
        return 1
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    with tempfile.TemporaryDirectory(prefix="gpufeed-example-") as tmp:
        path = args.file
        if path is None:
            path = os.path.join(tmp, "train.h5")
            write_example(path, args.samples, args.features)
        fields = args.fields or ["x", "y"]
        with H5Source(path, fields=fields) as source:
            print(source.describe())  # which read path each field takes, and why
            pf = CudaPrefetcher(SourceLoader(source, batch_size=args.batch_size, shuffle=True),
                                device=device, depth=2)
            with pf:
                for epoch in range(args.epochs):
                    t0, rows, ysum = time.perf_counter(), 0, 0
                    pf.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
                    for batch in pf:
                        first = batch[fields[0]]  # a dict of device tensors, one per field
                        rows += first.shape[0]
                        if args.file is None:
                            ysum += int(batch["y"].sum())  # synthetic y = arange: checks every row came once
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    dt = time.perf_counter() - t0
                    print(f"epoch {epoch}: {rows} samples in {dt:.2f}s on {device}", flush=True)
                    n = len(source)
                    if rows != n or (args.file is None and ysum != n * (n - 1) // 2):
                        print(f"error: read {rows} samples (sum of y {ysum}) from {n}", file=sys.stderr)
                        return 1
                print(pf.stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
