"""Why pageable batches stage slower than one big tensor: the same prefetcher over three batch shapes.

    PYTHONPATH=src python benchmarks/_diag_staging.py      # GPU machine; prints GB/s and stats.stage_GBps

``dicts``: bench_prefetcher's 64 MiB batches (x 60 MiB + y 2 MiB + mask 1 MiB + idx 1 MiB); ``single``: one
64 MiB tensor; ``x only``: the 60 MiB tensor alone. Then ``pin_memory()`` + ``non_blocking`` over the dicts,
from the main thread and from a fresh thread, as the peer. Seen on an H200 machine (docs/design.md): the
three small tensors cost about as much staging as the big one.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import torch

from gpufeed import CudaPrefetcher

MiB = 1 << 20
HERE = Path(__file__).resolve().parent


def _bench_prefetcher():
    spec = importlib.util.spec_from_file_location("bench_prefetcher", HERE / "bench_prefetcher.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_prefetcher"] = mod
    spec.loader.exec_module(mod)
    return mod


def rate(loader: list, **kw) -> tuple[float, float]:
    """(GB/s over two epochs after a warm-up epoch, stats.stage_GBps)."""
    with CudaPrefetcher(loader, depth=3, **kw) as pf:
        for _ in pf:
            pass
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2):
            for _ in pf:
                pass
        torch.cuda.synchronize()
        gbps = 2 * len(loader) * 64 * MiB / (time.perf_counter() - t0) / 1e9
        return round(gbps, 1), round(pf.stats.stage_GBps, 1)


def pin_loop(data: list) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in data:
        {k: v.pin_memory().to("cuda", non_blocking=True) for k, v in b.items()}
    torch.cuda.synchronize()
    return round(len(data) * 64 * MiB / (time.perf_counter() - t0) / 1e9, 1)


def main() -> None:
    dicts = _bench_prefetcher().make_batches(24, 64 * MiB)
    single = [torch.randn(16 * MiB) for _ in range(24)]

    def cycle(data: list) -> list:
        return [data[i % len(data)] for i in range(64)]

    print("dicts", rate(cycle(dicts)), flush=True)
    print("single", rate(cycle(single)), flush=True)
    print("x only", rate(cycle([{"x": d["x"]} for d in dicts])), flush=True)
    print("dicts chunk64", rate(cycle(dicts), chunk_bytes=64 * MiB), flush=True)
    pin_loop(cycle(dicts))
    print("pin_non_blocking", pin_loop(cycle(dicts)), flush=True)
    box: dict[str, float] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", pin_loop(cycle(dicts))))
    t.start()
    t.join()
    print("pin loop in a fresh thread", box["r"], flush=True)


if __name__ == "__main__":
    main()
