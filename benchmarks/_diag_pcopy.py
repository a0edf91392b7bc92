"""Would a staging copy with its own threads (dynamic pieces, optionally non-temporal stores) beat torch's?

    cc -O3 -mavx2 -shared -fPIC -pthread -o /tmp/_pcopy.so benchmarks/_pcopy.c
    PYTHONPATH=src python benchmarks/_diag_pcopy.py /tmp/_pcopy.so

Runs the 4 x 32 MiB ring of ``_diag_ring.py`` from a background thread over 24 distinct 64 MiB pageable
batches with torch's copy and with ``_pcopy.c`` (threads, piece size, regular or streaming stores), end
to end and staging alone. ``_pcopy.c`` is the prototype of ``src/gpufeed/_hostcopy.c``.
"""

import ctypes
import os
import sys

import torch
from _diag_ring import SIZE, MiB, in_thread, ring

lib = ctypes.CDLL(sys.argv[1])
vp, size, cint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
lib.pcopy.argtypes = [vp, vp, size, size, cint, cint]
lib.pcopy.restype = None
NCPU = os.cpu_count()
lib.pcopy_init(NCPU)


def pfill(threads, piece, nt):
    def fill(dst, src):
        lib.pcopy(dst.data_ptr(), src.data_ptr(), dst.numel(), piece, nt, threads)

    return fill


def main():
    flat = [torch.full((SIZE,), i, dtype=torch.uint8) for i in range(24)]
    print("cpus", NCPU, flush=True)
    cases = {"torch": None}
    for threads in (NCPU, NCPU * 3 // 4, NCPU // 2):
        for piece in (256 << 10, 1 * MiB, 4 * MiB):
            for nt in (0, 1):
                name = f"pcopy t{threads} piece {piece >> 10} KiB {'nt' if nt else 'reg'}"
                cases[name] = pfill(threads, piece, nt)
    for name, fill in cases.items():
        e2e = in_thread(lambda fill=fill: ring(32 * MiB, 4, flat, fill=fill))
        alone = in_thread(lambda fill=fill: ring(32 * MiB, 4, flat, dma=False, fill=fill))
        print(f"ring 4x32 thread, {name}: e2e {e2e} GB/s, staging alone {alone}", flush=True)
    for nt in (0, 1):
        fill = pfill(NCPU, 1 * MiB, nt)
        e2e = in_thread(lambda fill=fill: ring(32 * MiB, 8, flat, fill=fill))
        print(f"ring 8x32 thread, pcopy nt={nt}: {e2e}")


if __name__ == "__main__":
    main()
