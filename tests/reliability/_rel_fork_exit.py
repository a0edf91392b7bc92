"""Run as a script by test_rel_processes.py: fork while prefetchers run, then let both processes exit.

The parent iterates a RawSource and an H5Source (contiguous) prefetcher; mid-epoch it forks. The child
reads the inherited sources, runs an epoch of its own prefetcher, and returns normally, so interpreter
exit (atexit: gpufeed closes every live prefetcher, including the parent's copies whose threads do not
exist in the child) must end it. The parent finishes its epoch, starts another it never finishes and
exits without closing anything. Each process prints one OK line; any failure exits non-zero.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import H5Source, RawSource


def data(n: int = 400) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, size=(n, 64), dtype=np.uint8)


def check(x: np.ndarray, batches: list) -> None:
    for b in batches:
        rows = b["row"].numpy()
        assert np.array_equal(b["x"].numpy(), x[rows]), "bytes differ"


def main() -> int:
    root = Path(sys.argv[1])
    x = data()
    rows = np.arange(len(x), dtype=np.int64)
    np.save(root / "x.npy", x)
    np.save(root / "row.npy", rows)
    import h5py

    with h5py.File(root / "d.h5", "w") as f:
        f["x"], f["row"] = x, rows
    sources = [RawSource(fields={"x": root / "x.npy", "row": root / "row.npy"}),
               H5Source(root / "d.h5", fields=["x", "row"])]
    pfs = [CudaPrefetcher(SourceLoader(s, batch_size=16, shuffle=True),
                          device="cpu", depth=3) for s in sources]
    its = [iter(pf) for pf in pfs]
    got = [[next(it) for _ in range(5)] for it in its]
    pid = os.fork()
    if pid == 0:  # the child: use the inherited sources, run its own prefetcher, then exit normally
        for s in sources:
            out = {k: torch.empty((len(x), *f.shape), dtype=f.dtype) for k, f in s.fields.items()}
            s.read(range(len(x)), out)
            assert np.array_equal(out["x"].numpy(), x)
        mine = CudaPrefetcher(SourceLoader(sources[0], batch_size=32, shuffle=True), device="cpu")
        n = sum(len(b["row"]) for b in mine)
        assert n == len(x), n
        print(f"CHILD OK {os.getpid()}", flush=True)
        return 0
    for it, g in zip(its, got, strict=True):
        g += list(it)
        check(x, g)
        assert sorted(np.concatenate([b["row"].numpy() for b in g]).tolist()) == rows.tolist()
    t0 = time.monotonic()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    for pf in pfs:  # a new epoch, left unfinished: interpreter exit must still end promptly
        next(iter(pf))
    print(f"PARENT OK child waited {time.monotonic() - t0:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
