"""Time each stage of gpufeed's staging alone, then together, to tune chunk size and threads.

Run on the GPU machine::

    PYTHONPATH=src python benchmarks/profile_staging.py --out benchmarks/results

Prints (and writes ``staging-profile-<card>.json``): pinned H2D GB/s per copy size; pageable->pinned memcpy
GB/s per thread count (``ctypes.memmove`` from worker threads, as gpufeed does); and gpufeed end to end on
64 MiB unpinned batches for each (chunk_bytes, num_threads).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gpufeed import CudaPrefetcher

MiB = 1 << 20


def h2d(size: int, reps: int = 20) -> float:
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    b.record()
    b.synchronize()
    return size * reps / (a.elapsed_time(b) / 1e3) / 1e9


def torch_copy(piece: int, total: int = 512 * MiB) -> float:
    """Pageable -> pinned with torch's own (intra-op parallel) copy, ``piece`` bytes per call."""
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(3):
        for o in range(0, total, piece):
            dst[o : o + piece].copy_(src[o : o + piece])
    return 3 * total / (time.perf_counter() - t0) / 1e9


def torch_copy_during_dma(piece: int = 32 * MiB, total: int = 512 * MiB) -> float:
    """The same pageable -> pinned copy while the copy engine streams other pinned memory to the GPU:
    both compete for host memory bandwidth, as in gpufeed's pipeline."""
    big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(12):  # about 0.25 s of DMA
            dev.copy_(big, non_blocking=True)
    rate = torch_copy(piece, total)
    s.synchronize()
    return rate


def memcpy(threads: int, total: int = 512 * MiB, piece: int = 4 * MiB) -> float:
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    with ThreadPoolExecutor(threads) as ex:
        def run() -> None:
            list(ex.map(lambda o: ctypes.memmove(dst.data_ptr() + o, src.data_ptr() + o, piece),
                        range(0, total, piece)))
        run()
        t0 = time.perf_counter()
        for _ in range(3):
            run()
        return 3 * total / (time.perf_counter() - t0) / 1e9


def gpufeed_rate(chunk: int, threads: int, batch: int = 64 * MiB, n: int = 16, iters: int = 48) -> dict:
    data = [torch.randn(batch // 4) for _ in range(n)]
    loader = [data[i % n] for i in range(iters)]
    with CudaPrefetcher(loader, depth=3, chunk_bytes=chunk, num_threads=threads) as pf:
        for _b in pf:  # warm-up epoch: allocates the pool
            pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _b in pf:
            pass
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        s = pf.stats
    return {"chunk_mib": chunk / MiB, "threads": threads, "GBps": batch * iters / dt / 1e9,
            "h2d_GBps_stat": s.h2d_GBps, "stage_GBps_stat": s.stage_GBps,
            "pool_mib": pf._pool.allocated / MiB}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    card = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    res: dict = {"card": card, "torch": torch.__version__, "cpus": len(__import__("os").sched_getaffinity(0))}
    sizes = (2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 64 * MiB)
    res["h2d"] = {f"{s // MiB}MiB": round(h2d(s * 1), 1) for s in sizes}
    print("pinned H2D GB/s by copy size:", res["h2d"], flush=True)
    res["memcpy"] = {t: round(memcpy(t), 1) for t in (8, 16)}
    print("pageable->pinned memcpy GB/s by threads:", res["memcpy"], flush=True)
    res["torch_copy"] = {f"{p // MiB}MiB": round(torch_copy(p), 1) for p in (4 * MiB, 16 * MiB, 64 * MiB)}
    print(f"pageable->pinned torch copy_ GB/s by piece ({torch.get_num_threads()} intra-op threads):",
          res["torch_copy"], flush=True)
    res["torch_copy_during_dma"] = round(torch_copy_during_dma(), 1)
    print("torch copy_ GB/s while DMA runs:", res["torch_copy_during_dma"], flush=True)
    res["gpufeed"] = []
    for chunk in (2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB):
        for threads in (16,):
            r = gpufeed_rate(chunk, threads)
            res["gpufeed"].append(r)
            shown = {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}
            print("gpufeed", shown, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"staging-profile-{card}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
