"""Experiment (not product): what one next() of CudaPrefetcher costs the loop thread over a list of small
pinned batches, against the one-liner, and where it goes (cProfile), with the cost of each CUDA primitive.
Run from the repo root: python exp/profile_next.py [--smoke]."""
import cProfile, pstats, statistics, sys, time

import torch

from gpufeed import CudaPrefetcher

smoke = "--smoke" in sys.argv
cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
N = 2000 if not smoke else 200


def batches(shapes, pin):
    out = []
    for k in range(8):
        b = [torch.rand(*s) if i == 0 else torch.randint(0, 9, s) for i, s in enumerate(shapes)]
        out.append([t.pin_memory() for t in b] if pin and cuda else b)
    return [out[k % 8] for k in range(N)]


def one_liner(lst):
    for b in lst:
        yield [t.to(dev, non_blocking=True) for t in b]


def per_batch(make, lst, rounds=5):
    best = []
    for _ in range(rounds):
        it = make(lst)
        next(it)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 0
        for b in it:
            n += 1
        if cuda:
            torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(best), min(best), max(best)


def prim(name, fn, n=2000):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"  {name:40s} {(time.perf_counter() - t0) / n * 1e6:7.2f} us")


if cuda:
    t = torch.rand(512, 256).pin_memory()
    s = torch.cuda.Stream()
    ev = torch.cuda.Event()
    print("primitives:")
    prim("t.is_pinned()", t.is_pinned)
    prim("t.to(cuda, non_blocking)", lambda: t.to(dev, non_blocking=True))
    prim("torch.empty(device) + copy_ nb", lambda: torch.empty(t.shape, device=dev).copy_(t, non_blocking=True))
    prim("torch.cuda.current_stream()", torch.cuda.current_stream)
    prim("Event() + record", lambda: torch.cuda.Event().record())
    prim("Event(enable_timing) + record", lambda: torch.cuda.Event(enable_timing=True).record())
    prim("ev.record()", ev.record)
    prim("ev.query()", ev.query)
    prim("stream.wait_event(ev)", lambda: s.wait_event(ev))
    prim("with torch.cuda.stream(s)", lambda: torch.cuda.stream(s).__enter__() and None, 1)
    prim("t.nbytes", lambda: t.nbytes)
    prim("t.is_cuda", lambda: t.is_cuda)

cases = {"mlp 516KiB x2": [(512, 256), (512,)], "64KiB x1": [(64, 256)], "token 128KiB": [(8, 2048)],
         "4KiB x2": [(4, 256), (4,)]}
for name, shapes in cases.items():
    lst = batches(shapes, pin=True)
    print(f"--- {name}, pinned list of {N}")
    for label, make in (("one-liner", one_liner), ("gpufeed", lambda l: iter(CudaPrefetcher(l, device=dev))),
                        ("gpufeed measure=False", lambda l: iter(CudaPrefetcher(l, device=dev, measure=False)))):
        med, lo, hi = per_batch(make, lst)
        print(f"  {label:24s} {med:7.1f} us a batch ({lo:.1f}-{hi:.1f})")
    if name.startswith("mlp") or name.startswith("64KiB"):
        pr = cProfile.Profile()
        it = iter(CudaPrefetcher(lst, device=dev))
        next(it)
        pr.enable()
        for b in it:
            pass
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(28)
