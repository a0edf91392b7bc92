"""Where does the whole prefetcher lose against the bare staging ring? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_gap.py

On one machine and the same 24 distinct 64 MiB pageable batches, prints end-to-end GB/s of:
the 4 x 32 MiB ring of ``_diag_ring.py`` from a background thread (what the copy can do here),
``pin_memory()`` + ``non_blocking`` on the main thread, and the CudaPrefetcher over single-tensor
batches and over the benchmark's 4-tensor dict. Each prefetcher row also prints the staging rate gpufeed
measured (``stats.stage_GBps``). (The run that found the dict's 30% loss also swapped how the small
tensors were filled; see ``_diag_shape.py`` for what it was.)
"""

import sys
import time

import torch
from _diag_ring import SIZE, MiB, in_thread, ring

import gpufeed

ITERS = 64


def dict_batches(n):
    rows = SIZE // 256
    return [{"x": torch.full((rows, 60), float(i)), "y": torch.full((rows,), i, dtype=torch.int64),
             "mask": torch.full((rows, 4), i % 2, dtype=torch.bool),
             "idx": torch.full((rows,), i, dtype=torch.int32)} for i in range(n)]


def gbps(fn, reps=3):
    fn()  # warm-up
    best = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best.append(ITERS * SIZE / (time.perf_counter() - t0) / 1e9)
    return round(sorted(best)[len(best) // 2], 1)


def prefetched(batches, **kw):
    pf = gpufeed.CudaPrefetcher([batches[i % len(batches)] for i in range(ITERS)], depth=3, **kw)

    def run():
        for _ in pf:
            pass

    rate = gbps(run)
    stage = round(pf.stats.stage_GBps, 1)
    pf.close()
    return f"{rate} GB/s (stage {stage})"


def pin_loop(batches):
    def run():
        for i in range(ITERS):
            b = batches[i % len(batches)]
            out = {k: v.pin_memory().to("cuda", non_blocking=True) for k, v in b.items()}
        del out

    return f"{gbps(run)} GB/s"


def main():
    print("torch", torch.__version__, "threads", torch.get_num_threads(), sys.argv[1:], flush=True)
    flat = [torch.full((SIZE,), i, dtype=torch.uint8) for i in range(24)]
    dicts = dict_batches(24)
    print("ring 4x32 thread:", in_thread(lambda: ring(32 * MiB, 4, flat)), "GB/s", flush=True)
    print("ring 4x32 main:", ring(32 * MiB, 4, flat), "GB/s", flush=True)
    print("pin_memory loop flat:", pin_loop([{"x": t} for t in flat]), flush=True)
    print("pin_memory loop dict:", pin_loop(dicts), flush=True)
    print("gpufeed flat:", prefetched(flat), flush=True)
    print("gpufeed dict (worker memmove small):", prefetched(dicts), flush=True)
    print("ring 4x32 thread again:", in_thread(lambda: ring(32 * MiB, 4, flat)), "GB/s", flush=True)
    print("gpufeed flat again:", prefetched(flat), flush=True)
    print("gpufeed dict again:", prefetched(dicts), flush=True)


if __name__ == "__main__":
    main()
