"""A file truncated while shuffled batches are read kills the process with SIGBUS (no exception).

For scattered rows (a shuffled batch: ``Runs.scattered``) RawSource/H5Source/GDSSource gathered rows from
a memory map of the file (``sources/_gather.py``: ``_gather_file``). It checked the file's size and then
ran ``torch.index_select`` over the mapping; if the file shrinks between the check and the copy (or during
the copy), touching a page past the new end raises SIGBUS and the whole training process dies: no OSError,
no traceback, no cleanup. The ``pread`` path (contiguous batches) reports the same event as
``OSError: short read from <file> ...``, which is what DESIGN.md promises for truncated files.

The fix: the gather copies rows in native code (``gpufeed_gather``) that catches the SIGBUS in the
gathering thread and reports the row, which becomes the same OSError (there is no way to do that from
Python, hence the native library). By default a source gathers only where that library is built (and only
rows in the page cache, as here: the file was just written); without it, only ``mmap_gather=True`` maps
files, and keeps the risk.

Each trial runs in a forked child: two reader threads read shuffled rows while the main thread truncates
the file after a random delay; 10 trials with the default settings, then 10 with the memory-map gather
forced on. Exit status: 1 if a child died of SIGBUS with the default settings, or with the gather where
the native library is built; 0 otherwise.
"""

import os
import random
import signal
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from gpufeed.sources import RawSource, _pread


def child(path: str, n: int, row: int, gather: bool | None) -> None:
    src = RawSource(path, mmap_gather=gather)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = {"x": torch.empty(512, row, dtype=torch.uint8)}
        try:
            while True:
                src.read(np.sort(rng.choice(n, 512, replace=False)), out)
        except OSError:
            pass  # the clean outcome: "short read from ..."

    threads = [threading.Thread(target=reader, args=(s,), daemon=True) for s in range(2)]
    for t in threads:
        t.start()
    time.sleep(random.random() * 0.3 + 0.05)
    os.truncate(path, row * (n // 2))
    for t in threads:
        t.join()
    os._exit(0)


def trials(path: str, x: np.ndarray, gather: bool | None) -> dict[str, int]:
    n, row = x.shape
    outcomes: dict[str, int] = {}
    for _ in range(10):
        np.save(path, x)
        pid = os.fork()
        if pid == 0:
            child(path, n, row, gather)
        _, status = os.waitpid(pid, 0)
        what = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else "OSError (clean)"
        outcomes[what] = outcomes.get(what, 0) + 1
    return outcomes


def main() -> int:
    x = np.random.default_rng(0).integers(0, 256, (20000, 4096), dtype=np.uint8)
    path = os.path.join(tempfile.mkdtemp(), "x.npy")
    default = trials(path, x, gather=None)
    print(f"default settings, 10 trials: {default}")
    gathered = trials(path, x, gather=True)
    print(f"memory-map gather forced on, 10 trials: {gathered}")
    if default.get("SIGBUS"):
        print("BUG: with the default settings, a truncation during shuffled reads killed the process "
              "(SIGBUS)")
        return 1
    if gathered.get("SIGBUS") and _pread.GATHER is not None:
        print("BUG: the native gather let a truncation kill the process (SIGBUS)")
        return 1
    print("clean OSError every time: fixed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
