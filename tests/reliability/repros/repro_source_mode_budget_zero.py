"""Source mode ignores ``pinned_budget=0``: it stages through a pinned buffer anyway, with no warning.

``pinned_budget=0`` is documented as "reads into pageable memory" (now an argument of ``SourceLoader``;
before the one-way pipeline, of ``CudaPrefetcher``). In the code of the time, source mode acquired buffers
from the pool without asking ``pool.available``, and ``PinnedPool.try_acquire`` served a request when
nothing was allocated ("a single request larger than the budget"), which with a budget of 0 is every
request. So the pool pinned memory (cudaHostAlloc: fails where pinning is not allowed) and said nothing.

Fix: when the pool is not ``available``, read into pageable host tensors and copy those to the device,
with one warning; and let ``PinnedPool.try_acquire`` never allocate when ``budget == 0``.

The CPU half shows the pool allocating with a budget of 0; the CUDA half (GPU machine) shows the
SourceLoader's pool holding pinned memory after an epoch with ``pinned_budget=0``, or no warning.
Exit status: 1 while the bug is present, 0 once fixed.
"""

import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.host_memory.pinned_pool import PinnedPool
from gpufeed.sources import RawSource


def main() -> int:
    bug = False
    pool = PinnedPool(budget=0, pin=False)
    buf = pool.try_acquire(8192)
    if buf is not None:
        print(f"BUG (CPU half): PinnedPool(budget=0) allocated {pool.allocated} bytes "
              f"(available={pool.available})")
        bug = True
    if torch.cuda.is_available():
        d = Path(tempfile.mkdtemp())
        np.save(d / "x.npy", np.zeros((256, 4096), np.uint8))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = SourceLoader(RawSource(d / "x.npy"), batch_size=64, pinned_budget=0)
            with CudaPrefetcher(loader) as pf:
                for _ in pf:
                    pass
                pinned = loader._pool.allocated
        said = [w for w in caught if "pinned_budget is 0" in str(w.message)]
        if pinned or len(said) != 1:
            print(f"BUG (CUDA half): source mode with pinned_budget=0 holds {pinned} pinned bytes and warned "
                  f"{len(said)} time(s) (expected 0 bytes and one warning)")
            bug = True
    else:
        print("(no CUDA here: the CUDA half runs on the GPU machine)")
    print("BUG present" if bug else "fixed")
    return 1 if bug else 0


if __name__ == "__main__":
    sys.exit(main())
