"""Convert HDF5 to raw files once, then read them with GPUDirect Storage (``GDSSource``) or ``RawSource``.

    python examples/gds_raw.py                 # synthetic HDF5 -> raw files + manifest.json -> GPU
    python examples/gds_raw.py --file data.h5 --fields images labels --out data.raw
    python examples/gds_raw.py --smoke         # tiny, on the CPU (RawSource)

``convert_h5_to_raw`` writes one raw file per field plus ``manifest.json`` and is cached: a second run
with an unchanged source returns at once. ``GDSSource`` needs kvikio (``pip install 'gpufeed[gds]'``) and
CUDA; it reports whether GPUDirect Storage runs (``mode == "gds"``) or kvikio's compat mode (POSIX reads
to host, the usual case on cloud VMs). Elsewhere this example falls back to ``RawSource`` and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import numpy as np
import torch

from gpufeed import CudaPrefetcher, SourceLoader


def write_example(path: str, samples: int, features: int) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        x = np.ones((samples, features), np.float32)
        # gzip-compressed: the case where converting once pays off most (h5py decodes on one thread).
        f.create_dataset("x", data=x, chunks=(min(samples, 256), features), compression="gzip")
        f["y"] = np.arange(samples, dtype=np.int64)


def open_source(manifest: str, device: torch.device) -> tuple[object, str]:
    """``GDSSource`` where kvikio and CUDA are present, else ``RawSource``; and a line saying which."""
    from gpufeed.sources import GDSSource, RawSource

    if device.type != "cuda":
        return RawSource(manifest), "RawSource (no CUDA device, so no GPUDirect Storage)"
    if importlib.util.find_spec("kvikio") is None:
        return RawSource(manifest), "RawSource (kvikio is not installed: pip install 'gpufeed[gds]')"
    src = GDSSource(manifest)
    gds = src.mode == "gds"
    how = "GPUDirect Storage into GPU memory" if gds else "kvikio compat mode, reads to pinned host"
    return src, f"GDSSource, mode {src.mode!r} ({how})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", default=None, help="an HDF5 file (default: write a synthetic one)")
    p.add_argument("--fields", nargs="+", default=None, help="datasets to convert (default: x y)")
    p.add_argument("--out", default=None, help="folder for the raw files (default: a temp folder)")
    p.add_argument("--samples", type=int, default=50_000)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--smoke", action="store_true", help="tiny and quick, on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.features, args.batch_size, args.device = 1000, 8, 100, args.device or "cpu"
    try:
        from gpufeed.convert import convert_h5_to_raw
    except ImportError as exc:
        print(f"this example needs gpufeed.convert and h5py: {exc}", file=sys.stderr)
        return 1
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    with tempfile.TemporaryDirectory(prefix="gpufeed-example-") as tmp:
        h5 = args.file or os.path.join(tmp, "train.h5")
        if args.file is None:
            write_example(h5, args.samples, args.features)
        out = args.out or os.path.join(tmp, "train.raw")
        for attempt in ("converted", "cached"):  # the second call finds the manifest up to date
            t0 = time.perf_counter()
            manifest = convert_h5_to_raw(h5, out, fields=args.fields or ["x", "y"])
            print(f"{attempt}: {manifest} in {time.perf_counter() - t0:.2f}s", flush=True)
        source, which = open_source(str(manifest), device)
        print(f"reading with {which}", flush=True)
        rows = 0
        with CudaPrefetcher(SourceLoader(source, batch_size=args.batch_size), device=device, depth=2) as pf:
            for batch in pf:  # in order here; pass shuffle=True for training
                rows += next(iter(batch.values())).shape[0]
            print(pf.stats.summary())
        if rows != len(source):
            print(f"error: read {rows} samples, the source holds {len(source)}", file=sys.stderr)
            return 1
        print(f"read {rows} samples to {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
