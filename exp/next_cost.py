"""The loop thread's time a batch over a list of small pinned batches, empty loop: gpufeed against the
one-liner ``.to(non_blocking=True)`` a leaf; run once with each version of the library on PYTHONPATH."""

import os
import statistics
import time

import torch

import gpufeed
from gpufeed import CudaPrefetcher

dev = torch.device("cuda")
N = 2000


def batches(shapes):
    out = [[(torch.rand(*s) if i == 0 else torch.randint(0, 9, s)).pin_memory() for i, s in enumerate(shapes)]
           for _ in range(8)]
    return [out[k % 8] for k in range(N)]


def one_liner(lst):
    for b in lst:
        yield [t.to(dev, non_blocking=True) for t in b]


def per_batch(make, lst, rounds=7):
    got = []
    for _ in range(rounds):
        it = make(lst)
        next(it)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        torch.cuda.synchronize()
        got.append((time.perf_counter() - t0) / n * 1e6)
    return f"{statistics.median(got):6.1f} ({min(got):.1f}-{max(got):.1f})"


label = os.environ.get("LABEL", os.path.dirname(gpufeed.__file__))
cases = {"mlp 516KiB x2": [(512, 256), (512,)], "64KiB x1": [(64, 256)], "token 128KiB": [(8, 2048)],
         "4KiB x2": [(4, 256), (4,)]}
for name, shapes in cases.items():
    lst = batches(shapes)
    print(f"{label:5s} {name:14s} one-liner {per_batch(one_liner, lst)}  "
          f"gpufeed {per_batch(lambda x: iter(CudaPrefetcher(x, device=dev)), lst)}", flush=True)
