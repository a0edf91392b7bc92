"""Is the staging copy slower inside the prefetcher than in the bare ring? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_fill.py

Times, on the fetch thread, each staging fill (``staging.fill_segments``), each blocking
``PinnedPool.acquire`` and each ``Copier.deliver`` while the CudaPrefetcher moves 24 distinct 64 MiB
4-tensor batches; then runs the 4 x 32 MiB ring of ``_diag_ring.py`` with the same fill from a thread.
"""

import time

import torch
from _diag_gap import ITERS, dict_batches, gbps
from _diag_ring import SIZE, MiB, in_thread, ring

import gpufeed
from gpufeed import _copier, _hostcopy, staging

T = {}


def _count(key, seconds):
    n, s = T.get(key, (0, 0.0))
    T[key] = (n + 1, s + seconds)


def timed(owner, name, key, record=_count):
    """Replace ``owner.name`` by a wrapper that passes ``key`` and the seconds of each call to ``record``."""
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            record(key, time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def report(wall):
    out = [f"wall {wall / ITERS * 1e6:.0f} us/batch"]
    for key, (n, s) in sorted(T.items()):
        out.append(f"{key} {n / ITERS:.1f}x {s / ITERS * 1e6:.0f} us/batch")
    return ", ".join(out)


def main():
    timed(staging, "fill_segments", "fill")
    timed(_hostcopy, "stage", "stage (fill+send)")
    timed(staging.PinnedPool, "acquire", "acquire")
    timed(_copier.Copier, "deliver", "deliver")
    timed(staging.ChunkPipeline, "run", "pipeline")
    timed(staging.ChunkPipeline, "_copy", "h2d issue")
    timed(_copier.Copier, "_begin", "begin")
    timed(_copier.Copier, "seal", "seal")
    timed(_copier, "plan_chunks", "plan")
    timed(_copier, "flatten", "flatten")

    class TorchProxy:  # times torch.empty as the copier calls it
        def __getattr__(self, name):
            return getattr(torch, name)

    _copier.torch = TorchProxy()
    _copier.torch.empty = torch.empty
    timed(_copier.torch, "empty", "empty")
    dicts = dict_batches(24)
    for threads in (0, 16, 12):
        staging.COPY_THREADS = threads
        pf = gpufeed.CudaPrefetcher([dicts[i % 24] for i in range(ITERS)], depth=3)

        def go(pf=pf):
            for _ in pf:
                pass

        rate = gbps(go)
        T.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        go()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        print(f"copy threads {staging.copy_threads()}: gpufeed {rate} GB/s; {report(wall)}", flush=True)
        pf.close()
    flat = [torch.full((SIZE,), i, dtype=torch.uint8) for i in range(24)]

    def fill(dst, src):
        staging.fill_segments(dst, [(src, 0)])

    for threads in (0, 16):
        staging.COPY_THREADS = threads
        T.clear()
        e2e = in_thread(lambda: ring(32 * MiB, 4, flat, fill=fill))
        n, s = T["fill"]
        print(f"ring 4x32 thread, copy threads {staging.copy_threads()}: e2e {e2e} GB/s; "
              f"fill {s / n * 1e6:.0f} us per 32 MiB", flush=True)


if __name__ == "__main__":
    main()
