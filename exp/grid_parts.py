"""The grid's small pinned cells (every batch on the loop's stream there): where gpufeed's next() goes
beyond pin_nb's. Per-call next() times, so an epoch's fixed costs show apart from the per-batch ones."""
import collections, statistics, sys, time
import numpy as np
import torch
sys.path.insert(0, "benchmarks")
import bench_grid as g
from gpufeed import CudaPrefetcher

cfg = g.parse_args([])
rate = g.sleep_cycles_per_s(cfg)
ceiling = g.measure_ceiling(cfg)
dev = cfg.device


def bare(epoch, check):
    def gen():
        ahead = collections.deque()
        for b in epoch:
            if check:
                leaves = list(b.values())
                if False in [t.is_pinned() for t in leaves]:
                    raise AssertionError
                ahead.append(dict(zip(b, [t.to(dev, non_blocking=True) for t in leaves])))
            else:
                ahead.append({k: v.to(dev, non_blocking=True) for k, v in b.items()})
            if len(ahead) > 2:
                yield ahead.popleft()
        while ahead:
            yield ahead.popleft()
    return gen


def run(it, step, n):
    times = np.empty(n + 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    k = 0
    pc = time.perf_counter
    while True:
        a = pc()
        b = next(it, None)
        times[k] = pc() - a
        if b is None:
            break
        step(b)
        k += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / k * 1e6, times[:k + 1] * 1e6


for size, tensors, loop in ((0.25, 1, "none"), (0.25, 1, "compute"), (2.0, 4, "none"), (2.0, 1, "compute"),
                            (0.25, 4, "none")):
    data = g.make_data(size, tensors, "pinned", cfg)
    epoch = data.epoch
    copy_s = data.batch_bytes / (ceiling * 1e9)
    step = g.make_step(loop, int(copy_s * 1.2 * rate), cfg)
    pf = CudaPrefetcher(epoch, device=dev, depth=2)
    pf2 = CudaPrefetcher(epoch, device=dev, depth=2, measure=False)
    makers = {
        "pin_nb": lambda: ({k: v.to(dev, non_blocking=True) for k, v in b.items()} for b in epoch),
        "pin_nb+is_pinned": lambda: ({k: v.to(dev, non_blocking=True) for k, v in b.items()
                                      if v.is_pinned()} for b in epoch),
        "bare2": bare(epoch, False),
        "bare2+check": bare(epoch, True),
        "gpufeed": lambda: iter(pf),
        "gpufeed_nomeasure": lambda: iter(pf2),
    }
    res = collections.defaultdict(list)
    for r in range(6):
        for name, make in makers.items():
            step_us, t = run(make(), step, len(epoch))
            if r:
                res[name].append((step_us, t.mean(), np.median(t), t[0], t[-1], np.sort(t)[-5:-1].sum()))
    print(f"\n== {size} MiB x{tensors} pinned {loop}; {len(epoch)} batches/epoch")
    print(f"{'method':20s} {'step':>7s} {'next mean':>9s} {'median':>7s} {'first':>7s} {'last':>7s} top4")
    for name, rows in res.items():
        med = [statistics.median(x[i] for x in rows) for i in range(6)]
        print(f"{name:20s} {med[0]:7.1f} {med[1]:9.1f} {med[2]:7.1f} {med[3]:7.1f} {med[4]:7.1f} {med[5]:7.1f}")
    print("gpufeed loop_stream", pf.stats.loop_stream_batches, "of", pf.stats.batches)
    pf.close(); pf2.close()
