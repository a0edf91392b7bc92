"""Closing one CudaPrefetcher closes the source it shares with another prefetcher, under that one's reads.

``CudaPrefetcher.close()`` (and ``__del__``/``with``) calls ``source.close()``; ``RawSource.close()`` closes
the process's file descriptors even while another thread is inside ``os.preadv`` on them. The other
prefetcher then fails with ``OSError: [Errno 9] Bad file descriptor`` or, when the descriptor number has
been reused by an unrelated ``open()`` in between, silently reads the bytes of another file. The
source's docstring says "close() must not run while a read is in flight", but the prefetcher does exactly
that to a source it does not own. Realistic: one source shared by a train and an eval prefetcher.

Fix: (1) a prefetcher should not close a source the user passed in (the user owns it; or count the
prefetchers attached to a source and close on the last detach); and (2) make ``_PerProcess.close`` safe
against in-flight reads: readers hold a use count (``with fds.using(i) as fd:``) and ``close`` defers the
``os.close`` until the count drops to zero (descriptors are never closed under a reader).

Exit status: 1 while the bug is present, 0 once fixed.
"""

import os
import sys
import tempfile
import threading
import time

import numpy as np

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import RawSource


def main() -> int:
    sys.setswitchinterval(1e-6)  # widen the race: switch threads as often as possible
    d = tempfile.mkdtemp()
    n = 20000
    x = np.arange(n * 64, dtype=np.int64).reshape(n, 64)
    np.save(os.path.join(d, "x.npy"), x)
    np.save(os.path.join(d, "other.npy"), -x)
    src = RawSource(os.path.join(d, "x.npy"))
    errors, wrong, batches = [], 0, 0

    def long_running():  # e.g. the training prefetcher
        nonlocal wrong, batches
        try:
            with CudaPrefetcher(SourceLoader(src, batch_size=64), device="cpu", depth=4) as pf:
                for _ in range(4):
                    for b in pf:
                        rows = np.arange(int(b["x"][0, 0]) // 64, int(b["x"][0, 0]) // 64 + len(b["x"]))
                        wrong += not np.array_equal(b["x"].numpy(), x[rows])
                        batches += 1
        except OSError as exc:
            errors.append(exc)

    t = threading.Thread(target=long_running)
    t.start()
    deadline = time.monotonic() + 20
    while t.is_alive() and time.monotonic() < deadline:
        with CudaPrefetcher(SourceLoader(src, batch_size=64),
                            device="cpu") as short:  # e.g. a quick eval pass
            next(iter(short))
        with open(os.path.join(d, "other.npy"), "rb"):  # any open() may reuse the closed descriptor number
            pass
    t.join()
    if errors or wrong:
        print(f"BUG: the long-running prefetcher got {errors[:1]} and {wrong} batches of wrong bytes "
              f"(of {batches}) because the short one closed the shared source under it")
        return 1
    print(f"{batches} batches, all exact: fixed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
