"""Which part of the 4-tensor dict batch costs the prefetcher a third of its rate? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_shape.py

Same 64 MiB per batch, 24 distinct batches, different structures; for each, end-to-end GB/s of the
CudaPrefetcher, its staging rate, and the fetch thread's time per batch blocked in ``PinnedPool.acquire``
and in the staging copies (torch ``copy_`` into pinned buffers).

Found on an H200 machine, when each small tensor was filled by one worker ``memmove``: x 60 MiB alone
44.7 GB/s, with one 4 MiB tensor 30.6, with 2 + 1 + 1 MiB 28.3 (the pin_memory() loop: 50-57 for all).
With the leaves laid end to end (``staging.plan_chunks``), next run: 39.8, 37.1 and 33.9.
"""

import time

import torch
from _diag_gap import ITERS, gbps, pin_loop
from _diag_ring import SIZE, MiB

import gpufeed
from gpufeed import staging

T = {"acquire": 0.0, "copy": 0.0, "n": 0}
_acquire = staging.PinnedPool.acquire


def acquire(self, *a, **k):
    t0 = time.perf_counter()
    try:
        return _acquire(self, *a, **k)
    finally:
        T["acquire"] += time.perf_counter() - t0


staging.PinnedPool.acquire = acquire
def structures():
    rows = SIZE // 256
    mk = lambda n, dt=torch.uint8, i=0: torch.full((n,), i, dtype=dt)  # noqa: E731
    yield "flat 64 MiB uint8", [{"x": mk(SIZE, i=i)} for i in range(24)]
    yield "x only, 60 MiB float32", [{"x": torch.full((rows, 60), float(i))} for i in range(24)]
    yield "x 60 MiB + one 4 MiB", [{"x": mk(60 * MiB, i=i), "y": mk(4 * MiB, i=i)} for i in range(24)]
    yield "two 32 MiB", [{"a": mk(32 * MiB, i=i), "b": mk(32 * MiB, i=i)} for i in range(24)]
    yield "x 60 MiB + 2+1+1 MiB", [{"x": mk(60 * MiB, i=i), "y": mk(2 * MiB, i=i), "m": mk(MiB, i=i),
                                     "i": mk(MiB, i=i)} for i in range(24)]


def prefetch(batches):
    pf = gpufeed.CudaPrefetcher([batches[i % len(batches)] for i in range(ITERS)], depth=3)

    def go():
        for _ in pf:
            pass

    rate = gbps(go)
    T.update(acquire=0.0, n=0)
    t0 = time.perf_counter()
    go()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s = pf.stats
    out = (f"{rate} GB/s, stage {s.stage_GBps:.1f}; per batch: wall {wall / ITERS * 1e6:.0f} us, "
           f"acquire-blocked {T['acquire'] / ITERS * 1e6:.0f} us, allocations {pf._pool.allocations}")
    pf.close()
    return out


def main():
    for name, batches in structures():
        print(f"{name}: pin loop {pin_loop(batches)}; gpufeed {prefetch(batches)}", flush=True)
    staging.HOT_CHUNKS = 6
    for name, batches in structures():
        if "2+1+1" in name:
            print(f"{name}, hot 6: gpufeed {prefetch(batches)}", flush=True)


if __name__ == "__main__":
    main()
