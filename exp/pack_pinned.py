"""Many small pinned tensors: the loop thread's time a batch, each tensor's own .to(non_blocking=True)
against one pack (Stager.send: a pinned block, one gathering copy, one copy, views), and gpufeed, in an
empty loop, median of 5 rounds (min-max)."""

import statistics
import time

import torch

from gpufeed import CudaPrefetcher
from gpufeed._staging import Stager

dev = torch.device("cuda")
stager = Stager()


def rounds(run, n_rounds=5):
    out = []
    for _ in range(n_rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        k = run()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / k * 1e6)
    return f"{statistics.median(out):7.1f} ({min(out):.1f}-{max(out):.1f})"


def each(batches):
    for b in batches:
        [t.to(dev, non_blocking=True) for t in b]
    return len(batches)


def packed(batches):
    for b in batches:
        stager.send(b, dev)
    return len(batches)


def fed(pf):
    return sum(1 for _ in pf)


print("leaves KiB | .to() each | one pack | gpufeed (us a batch)")
for kib in (4, 16, 64):
    for n in (2, 4, 8, 16, 32):
        batches = [[torch.randn(kib * 256).pin_memory() for _ in range(n)] for _ in range(64)] * 8
        got = stager.send(batches[0], dev)
        assert all(torch.equal(g.cpu(), t) for g, t in zip(got, batches[0], strict=True))
        with CudaPrefetcher(batches) as pf:
            print(f"{n:>6} {kib:>3} | {rounds(lambda b=batches: each(b))} | "
                  f"{rounds(lambda b=batches: packed(b))} | {rounds(lambda p=pf: fed(p))}", flush=True)
