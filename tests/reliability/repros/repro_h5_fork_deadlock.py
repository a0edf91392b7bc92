"""H5Source (h5py path: gzip, chunks that split samples, ...) hangs in a child forked while another thread
of the parent was inside an h5py-path read.

Cause: ``gpufeed.sources.h5._H5PY_LOCK`` is a module-level ``threading.Lock`` held around every
``read_direct``; a fork copies it *locked* into the child, where no thread will ever release it. (h5py's own
lock is safe: h5py takes it before fork.) Realistic trigger: DataLoader workers forked while a
CudaPrefetcher over a compressed HDF5 file runs in the same process, e.g. an evaluation loader mid-epoch.

Fix: re-create the lock in the child, e.g. in ``h5.py``:
``os.register_at_fork(after_in_child=_reset_h5py_lock)``, where ``_reset_h5py_lock`` does
``global _H5PY_LOCK; _H5PY_LOCK = threading.Lock()`` (h5py's before-fork hook holds h5py's own lock, so
no HDF5 call is in flight at the fork).

Exit status: 1 while the bug is present (the child hangs and is killed), 0 once fixed.
"""

import os
import sys
import tempfile
import threading
import time

import h5py
import numpy as np
import torch

from gpufeed.sources import H5Source
from gpufeed.sources import h5 as h5mod


def main() -> int:
    path = os.path.join(tempfile.mkdtemp(), "z.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(4000, dtype=np.float32).reshape(1000, 4), chunks=(10, 4),
                         compression="gzip")
    src = H5Source(path, fields=["x"])
    # Stand-in for a prefetcher's reader thread caught inside read_direct at the moment of the fork.
    held, release = threading.Event(), threading.Event()

    def reader_inside_read():
        with h5mod._H5PY_LOCK:
            held.set()
            release.wait()

    t = threading.Thread(target=reader_inside_read)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # the child: any h5py-path read of any H5Source
        out = {"x": torch.empty(4, 4)}
        src.read(range(4), out)
        os._exit(0)
    release.set()
    t.join()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child read fine: fixed")
            return 0
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("BUG: the forked child hung for 10 s in H5Source.read (gzip dataset): _H5PY_LOCK was inherited "
          "locked")
    return 1


if __name__ == "__main__":
    sys.exit(main())
