"""Where the loop thread's time in gpufeed's next() goes, unloaded (no step between batches), on CUDA:
next() per batch for the one-liner, a bare generator (the .to() calls alone), gpufeed without and with the
verdict's events, over pinned and pageable lists of 1, 4 and 32 tensors; then a cProfile of gpufeed's
epoch over two of them, and the stage's calls timed alone."""

import cProfile
import collections
import io
import pstats
import statistics
import sys
import time

import torch

import gpufeed

SMOKE = "--smoke" in sys.argv
dev = torch.device("cpu" if SMOKE else "cuda")
N = 200 if SMOKE else 3000
ROUNDS = 2 if SMOKE else 5


def batches(total_kib, count, pinned):
    out = []
    for _ in range(N):
        b = [torch.randn(total_kib * 256 // count) for _ in range(count)]
        if pinned and not SMOKE:
            b = [t.pin_memory() for t in b]
        out.append(b)
    return out


def one_liner(lst):
    for b in lst:
        yield [t.pin_memory().to(dev, non_blocking=True) if not SMOKE else t.to(dev) for t in b]


def bare(lst, depth=2):
    ahead = collections.deque()
    for b in lst:
        ahead.append([t.to(dev, non_blocking=True) for t in b])
        if len(ahead) > depth:
            yield ahead.popleft()
    yield from ahead


def per_next(it):
    """us a next(), synchronizing every 32 batches outside the timed calls."""
    inside, n = 0.0, 0
    while True:
        t = time.perf_counter()
        b = next(it, None)
        inside += time.perf_counter() - t
        if b is None:
            break
        n += 1
        if n % 32 == 0 and not SMOKE:
            torch.cuda.synchronize()
    return inside / n * 1e6


def per_batch_wall(it):
    """us a batch over the whole list, one synchronize at the end (the GPU's rate where it is the bound)."""
    if not SMOKE:
        torch.cuda.synchronize()
    t, n = time.perf_counter(), 0
    for _ in it:
        n += 1
    if not SMOKE:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


CASES = [(256, 1), (256, 4), (256, 32), (2048, 1), (2048, 4)]
for pinned in (True, False):
    for kib, count in CASES:
        lst = batches(kib, count, pinned)
        pfs = {"unmeasured": gpufeed.CudaPrefetcher(lst, device=dev, measure=False),
               "gpufeed": gpufeed.CudaPrefetcher(lst, device=dev)}
        got = collections.defaultdict(list)
        for r in range(ROUNDS):
            for m in ("one_liner", "bare", "unmeasured", "gpufeed"):
                it = one_liner(lst) if m == "one_liner" else bare(lst) if m == "bare" else iter(pfs[m])
                got[m].append(per_next(it))
                it = one_liner(lst) if m == "one_liner" else bare(lst) if m == "bare" else iter(pfs[m])
                got[m + "_wall"].append(per_batch_wall(it))
        loop = pfs["gpufeed"].stats.loop_stream_batches
        print(f"{'pinned' if pinned else 'pageable'} {kib} KiB x {count}: " + "  ".join(
            f"{m} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for m, v in got.items())
            + f"  [loop-stream batches {loop}]", flush=True)
        if pinned and count in (1, 4) and kib == (256 if count == 1 else 2048):
            prof = cProfile.Profile()
            it = iter(pfs["unmeasured"])
            prof.enable()
            per_next(it)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(s.getvalue()[-3500:], flush=True)
        for pf in pfs.values():
            pf.close()

# The CUDA runtime calls each method makes a batch of 4 pinned 512 KiB tensors (torch.profiler, CPU side).
if not SMOKE:
    from torch.profiler import ProfilerActivity, profile

    lst = batches(2048, 4, True)[:400]
    pf = gpufeed.CudaPrefetcher(lst, device=dev, measure=False)
    for name, make in (("one_liner", lambda: one_liner(lst)), ("gpufeed", lambda: iter(pf))):
        per_next(make())  # (warm)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            per_next(make())
        print(f"== torch.profiler, {name}, 400 batches of 4 x 512 KiB pinned", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16), flush=True)
    pf.close()
