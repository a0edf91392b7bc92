"""After a source-mode epoch, the source (and its open file descriptors) stays alive until the cyclic GC
runs, even when the user closed the prefetcher and dropped every reference to the source.

Cause (in the code of the time, before the one-way pipeline): ``gpufeed._source_batch._Chain._made``
held the epoch's last SourceBatch objects and each SourceBatch held its ``chain``: a reference cycle, and
every object in it referenced the source. (Now ``gpufeed.loaders._reads.EpochReads`` holds only the
batches read ahead, in ``_started``, which reference no EpochReads; ``cancel()`` clears them.)
Since a prefetcher no longer closes the user's source (the fix for the shared-source finding), "close
the prefetcher, drop the source" keeps one descriptor per file open until a GC pass; with sources
of many files made per evaluation or per epoch, descriptors pile up towards the open-files limit.

Fix: break the cycle when an epoch ends: ``EpochReads.cancel()`` (called in ``SourceLoader._read``'s
``finally``) also clears what it holds; or a batch keeps a ``weakref`` to its epoch.

Exit status: 1 while the bug is present, 0 once fixed.
"""

import gc
import os
import sys
import tempfile
import weakref

import numpy as np

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import RawSource


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    d = tempfile.mkdtemp()
    paths = []
    for i in range(20):
        paths.append(os.path.join(d, f"part{i}.npy"))
        np.save(paths[-1], np.full((8, 4), i, np.int32))
    gc.disable()
    before = fds()
    src = RawSource(paths)
    ref = weakref.ref(src)
    pf = CudaPrefetcher(SourceLoader(src, batch_size=16), device="cpu")
    n = sum(1 for _ in pf)
    pf.close()
    del pf, src
    alive, held = ref() is not None, fds() - before
    gc.enable()
    gc.collect()
    print(f"{n} batches; after close() and del: source alive={alive}, {held} extra descriptors; "
          f"after gc.collect(): {fds() - before}")
    if alive:
        print("BUG: the source and its descriptors outlive the prefetcher until a GC pass (reference cycle)")
        return 1
    print("freed at once: fixed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
