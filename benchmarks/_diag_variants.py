"""Staging designs side by side on bench_prefetcher's 64 MiB pageable batches (GPU machine).

    PYTHONPATH=src python benchmarks/_diag_variants.py

Each variant moves the same 64 batches (24 distinct, cycled) host -> device and prints end-to-end GB/s
(wall time to a device synchronize). Stage-only rates (pageable -> pinned, no DMA) are printed first.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_prefetcher as bp
from _diag_ring import in_thread

from gpufeed import CudaPrefetcher

MiB = 1 << 20
N = 64
BATCH = 64 * MiB


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def info() -> None:
    print(
        "cpus",
        os.cpu_count(),
        "affinity",
        len(os.sched_getaffinity(0)),
        "torch threads",
        torch.get_num_threads(),
        "interop",
        torch.get_num_interop_threads(),
        "libc",
        platform.libc_ver(),
        flush=True,
    )
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(ln for ln in cpuinfo if ln.startswith("model name")).strip()
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        print(model, "| thp", thp, flush=True)
    except OSError:
        pass
    print(torch.__config__.parallel_info(), flush=True)


def stage_only(data) -> None:
    pinned = torch.empty(BATCH, dtype=torch.uint8, pin_memory=True)
    xs = [flat(d["x"]) for d in data]
    smalls = [[flat(d[k]) for k in ("y", "mask", "idx")] for d in data]

    def torch_x():
        for i in range(N):
            pinned[: xs[i % 24].numel()].copy_(xs[i % 24])

    def torch_all():
        for i in range(N):
            off = 0
            for t in [xs[i % 24], *smalls[i % 24]]:
                pinned[off : off + t.numel()].copy_(t)
                off += t.numel()

    def torch_smalls():
        for i in range(N):
            off = 0
            for t in smalls[i % 24]:
                pinned[off : off + t.numel()].copy_(t)
                off += t.numel()

    def memmove_1(parts_fn):
        def run():
            for i in range(N):
                off = 0
                for t in parts_fn(i):
                    ctypes.memmove(pinned.data_ptr() + off, t.data_ptr(), t.numel())
                    off += t.numel()

        return run

    def threads_k(k):
        # k persistent threads, each copies a 1/k stripe of x with one memmove per batch
        bar = threading.Barrier(k + 1)
        idx = [0]
        stop = [False]

        def worker(j):
            while True:
                bar.wait()
                if stop[0]:
                    return
                x = xs[idx[0] % 24]
                n = x.numel()
                lo, hi = n * j // k // 64 * 64, (n * (j + 1) // k // 64 * 64 if j < k - 1 else n)
                ctypes.memmove(pinned.data_ptr() + lo, x.data_ptr() + lo, hi - lo)
                bar.wait()

        ts = [threading.Thread(target=worker, args=(j,), daemon=True) for j in range(k)]
        for t in ts:
            t.start()

        def run():
            for i in range(N):
                idx[0] = i
                bar.wait()
                bar.wait()

        def close():
            stop[0] = True
            bar.wait()

        return run, close

    def rate(fn, nbytes_per):
        fn()
        t0 = time.perf_counter()
        fn()
        return round(N * nbytes_per / (time.perf_counter() - t0) / 1e9, 1)

    xb = xs[0].numel()
    sb = sum(t.numel() for t in smalls[0])
    for what, fn, nbytes in (("x", torch_x, xb), ("smalls", torch_smalls, sb), ("all", torch_all, BATCH)):
        print(f"stage-only torch {what} main", rate(fn, nbytes), "thread",
              in_thread(lambda fn=fn, nbytes=nbytes: rate(fn, nbytes)), flush=True)
    print(
        "stage-only memmove1 x",
        rate(memmove_1(lambda i: [xs[i % 24]]), xb),
        "smalls",
        rate(memmove_1(lambda i: smalls[i % 24]), sb),
        flush=True,
    )
    for k in (4, 8, 12, 16):
        run, close = threads_k(k)
        print(f"stage-only memmove {k} threads x", rate(run, xb), flush=True)
        close()


class Ring:
    """Pinned slots guarded by events; H2D per tensor on a side stream."""

    def __init__(self, slots=4):
        self.bufs = [torch.empty(BATCH, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.events = [None] * slots
        self.i = 0

    def get(self):
        j = self.i % len(self.bufs)
        self.i += 1
        if self.events[j] is not None:
            self.events[j].synchronize()
        return j, self.bufs[j]


def e2e_torch(data, chunk=None):
    ring = Ring()
    stream = torch.cuda.Stream()
    dev = [{k: torch.empty_like(v, device="cuda") for k, v in d.items()} for d in data[:4]]

    def run():
        for i in range(N):
            d = data[i % 24]
            out = dev[i % 4]
            j, buf = ring.get()
            off = 0
            with torch.cuda.stream(stream):
                for k, v in d.items():
                    src = flat(v)
                    n = src.numel()
                    for o in range(0, n, chunk or n):
                        m = min(chunk or n, n - o)
                        buf[off + o : off + o + m].copy_(src[o : o + m])
                        flat(out[k])[o : o + m].copy_(buf[off + o : off + o + m], non_blocking=True)
                    off += -(-n // 64) * 64
                ev = torch.cuda.Event()
                ev.record(stream)
                ring.events[j] = ev
        torch.cuda.synchronize()

    return run


def e2e_rate(fn):
    fn()
    t0 = time.perf_counter()
    fn()
    fn()
    return round(2 * N * BATCH / (time.perf_counter() - t0) / 1e9, 1)


def gpufeed_rate(data, **kw):
    loader = [data[i % 24] for i in range(N)]
    with CudaPrefetcher(loader, depth=3, **kw) as pf:

        def run():
            for _ in pf:
                pass
            torch.cuda.synchronize()

        return e2e_rate(run), round(pf.stats.stage_GBps, 1)


def main() -> None:
    info()
    data = bp.make_batches(24, BATCH)
    stage_only(data)
    print(
        "e2e torch per-tensor main",
        e2e_rate(e2e_torch(data)),
        "thread",
        in_thread(lambda: e2e_rate(e2e_torch(data))),
        flush=True,
    )
    print(
        "e2e torch chunk16 thread",
        in_thread(lambda: e2e_rate(e2e_torch(data, 16 * MiB))),
        "chunk32",
        in_thread(lambda: e2e_rate(e2e_torch(data, 32 * MiB))),
        flush=True,
    )
    print("gpufeed default", gpufeed_rate(data), flush=True)
    print("gpufeed chunk64", gpufeed_rate(data, chunk_bytes=64 * MiB), flush=True)
    for nt in (1, 2, 4):
        print(f"gpufeed num_threads={nt}", gpufeed_rate(data, num_threads=nt), flush=True)


if __name__ == "__main__":
    main()
