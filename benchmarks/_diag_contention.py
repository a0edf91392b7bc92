"""Does host staging overlap the H2D copy engine, and does write-combined pinned memory help? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_contention.py

1. H2D from a pinned buffer alone; pageable -> pinned torch copies alone; both at once (each rate).
2. The same with a write-combined pinned buffer (cudaHostAlloc flag 4) as the staging target.
3. End to end (``_diag_ring.ring``): 64 MiB batches through 4 pinned slots, normal vs WC. On an H200
   machine the staging thread never waited for a slot: staging itself was the bottleneck (35 GB/s
   through 4 x 64 MiB).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _diag_ring import SIZE, MiB, ring


def cudart() -> ctypes.CDLL:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libcudart" in line:
            return ctypes.CDLL(line.split()[-1])
    raise RuntimeError("libcudart not loaded")


_keep = []


def host_alloc(n: int, flags: int) -> torch.Tensor:
    lib = cudart()
    ptr = ctypes.c_void_p()
    rc = lib.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(n), ctypes.c_uint(flags))
    assert rc == 0, rc
    arr = (ctypes.c_uint8 * n).from_address(ptr.value)
    _keep.append(arr)
    return torch.frombuffer(arr, dtype=torch.uint8)


def loop_rate(fn, seconds, stop=None):
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds and not (stop and stop.is_set()):
        fn()
        n += 1
    return n, time.perf_counter() - t0


def h2d_fn(src, dst, stream):
    def f():
        with torch.cuda.stream(stream):
            for _ in range(8):
                dst.copy_(src, non_blocking=True)
        stream.synchronize()

    return f, 8 * src.numel()


def stage_fn(srcs, dst):
    i = [0]

    def f():
        dst.copy_(srcs[i[0] % len(srcs)])
        i[0] += 1

    return f, dst.numel()


def concurrent(label, pinned_src, stage_dst, srcs):
    dev = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    h, hb = h2d_fn(pinned_src, dev, stream)
    s, sb = stage_fn(srcs, stage_dst)
    n, t = loop_rate(h, 1.0)
    alone_h = n * hb / t / 1e9
    n, t = loop_rate(s, 1.0)
    alone_s = n * sb / t / 1e9
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("h", loop_rate(h, 1.5)))
    th.start()
    n, t = loop_rate(s, 1.5)
    th.join()
    both_s = n * sb / t / 1e9
    both_h = box["h"][0] * hb / box["h"][1] / 1e9
    print(
        f"{label}: alone h2d {alone_h:.1f} stage {alone_s:.1f} | "
        f"together h2d {both_h:.1f} stage {both_s:.1f}",
        flush=True,
    )


def e2e(label, slots, srcs, chunk=None):
    print(f"e2e {label}: {ring(chunk or SIZE, len(slots), srcs, slots=slots)} GB/s", flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    srcs = [torch.full((SIZE,), i, dtype=torch.uint8) for i in range(16)]  # 1 GiB pageable, faulted in
    pinned_src = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True).fill_(1)
    stage_dst = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    pageable_dst = torch.empty(SIZE, dtype=torch.uint8).fill_(0)
    wc = host_alloc(SIZE, 4)
    wc.fill_(0)
    concurrent("pinned target", pinned_src, stage_dst, srcs)
    concurrent("pageable target", pinned_src, pageable_dst, srcs)
    concurrent("write-combined target", pinned_src, wc, srcs)
    wc_src = host_alloc(SIZE, 4)
    wc_src.fill_(1)
    concurrent("h2d from WC, stage to WC", wc_src, wc, srcs)
    for threads in (16, 8, 4):
        torch.set_num_threads(threads)
        concurrent(f"pinned target, {threads} torch threads", pinned_src, stage_dst, srcs)
    for threads in (16, 12, 8, 6):
        torch.set_num_threads(threads)
        ring = [torch.empty(SIZE, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
        for chunk in (SIZE, 16 * MiB, 4 * MiB):
            e2e(f"ring {threads} threads chunk {chunk >> 20} MiB", ring, srcs, chunk)
    torch.set_num_threads(16)
    e2e("normal pinned ring", [torch.empty(SIZE, dtype=torch.uint8, pin_memory=True) for _ in range(4)], srcs)
    e2e("write-combined ring", [host_alloc(SIZE, 4) for _ in range(4)], srcs)
    torch.set_num_threads(8)
    e2e(
        "normal pinned ring, 8 threads",
        [torch.empty(SIZE, dtype=torch.uint8, pin_memory=True) for _ in range(4)],
        srcs,
    )
    e2e("write-combined ring, 8 threads", [host_alloc(SIZE, 4) for _ in range(4)], srcs)


if __name__ == "__main__":
    main()
