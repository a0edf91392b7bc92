"""Why is the nanoTabPFN step slower under gpufeed than on resident data? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_step.py

The bench_tabpfn model step on batches that are: resident slices (the ideal); cloned on the current stream;
cloned on a side stream and ``record_stream``ed to the current one (what the prefetcher does); cloned on a
side stream without it (unsafe, timing only); and CudaPrefetcher over pinned and pageable host batches.
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import bench_tabpfn as bt

from gpufeed import CudaPrefetcher

cfg = bt.parse_args(["--out", "/tmp/x"])
N = 100
g = torch.Generator().manual_seed(0)
host_x = torch.randn(N * cfg.batch_size, cfg.rows, cfg.features, generator=g)
host_y = torch.randint(0, bt.CLASSES, (N * cfg.batch_size, cfg.rows), generator=g).float()
x = host_x.cuda()
y = host_y.cuda()
b = cfg.batch_size
side = torch.cuda.Stream()


def slices():
    return ((x[i : i + b], y[i : i + b]) for i in range(0, N * b, b))


def cloned_here():
    return ((x[i : i + b].clone(), y[i : i + b].clone()) for i in range(0, N * b, b))


def cloned_side(record):
    cur = torch.cuda.current_stream()
    for i in range(0, N * b, b):
        with torch.cuda.stream(side):
            xb, yb = x[i : i + b].clone(), y[i : i + b].clone()
            ev = torch.cuda.Event()
            ev.record(side)
        cur.wait_event(ev)
        if record:
            xb.record_stream(cur)
            yb.record_stream(cur)
        yield xb, yb


def prefetched(pinned):
    batches = [{"x": host_x[i : i + b], "y": host_y[i : i + b]} for i in range(0, N * b, b)]
    if pinned:
        batches = [{k: v.pin_memory() for k, v in d.items()} for d in batches]
    with CudaPrefetcher(batches, depth=3) as pf:
        for d in pf:
            yield d["x"], d["y"]


def timed(make):
    tr = bt.Trainer(cfg)
    for xb, yb in make():  # warm-up epoch
        tr.step(xb, yb)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for xb, yb in make():
        tr.step(xb, yb)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / N


variants = {
    "resident slices (ideal)": slices,
    "cloned on current stream": cloned_here,
    "side stream + record_stream": lambda: cloned_side(True),
    "side stream, no record_stream": lambda: cloned_side(False),
    "gpufeed over pinned batches": lambda: prefetched(True),
    "gpufeed over pageable batches": lambda: prefetched(False),
}
res = {k: [] for k in variants}
for _ in range(3):
    for k, make in variants.items():
        res[k].append(timed(make))
base = statistics.median(res["resident slices (ideal)"])
for k, v in res.items():
    m = statistics.median(v)
    print(
        f"{k:36s} {m * 1e3:7.2f} ms/step  {m / base:.3f}x ideal  (runs {[round(t * 1e3, 2) for t in v]})",
        flush=True,
    )
