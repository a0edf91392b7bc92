"""Why gpufeed trails pin_nb in the grid's small pinned cells: time next() (wall and CPU) and the step,
per method and variant, interleaved rounds; then a torch.profiler table of gpufeed's loop."""
import statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
import bench_grid as g
from gpufeed import CudaPrefetcher

cfg = g.parse_args(["--sizes", "0.25", "--tensors", "1"])
rate = g.sleep_cycles_per_s(cfg)
ceiling = g.measure_ceiling(cfg)
dev = cfg.device


def variants(epoch):
    def pin_nb():
        return ({k: v.to(dev, non_blocking=True) for k, v in b.items()} for b in epoch)

    def gf(**kw):
        def make():
            pf = CudaPrefetcher(epoch, device=dev, depth=2, **kw)
            return pf
        return make
    return {"pin_nb": pin_nb, "gpufeed": gf(), "gpufeed_nomeasure": gf(measure=False)}


def run(make_iter, step, n, pf=None, force=None):
    it = iter(pf) if pf is not None else make_iter()
    if force is not None and pf is not None:
        pf._stage.costs.loop_bytes = force
    torch.cuda.synchronize()
    nw = nc = 0.0
    t0 = time.perf_counter()
    k = 0
    while True:
        a = time.perf_counter(); c = time.thread_time()
        b = next(it, None)
        nc += time.thread_time() - c; nw += time.perf_counter() - a
        if b is None:
            break
        step(b)
        k += 1
        if force is not None and pf is not None:
            pf._stage.costs.loop_bytes = force
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return wall / k * 1e6, nw / k * 1e6, nc / k * 1e6


for size, tensors, loop in ((0.25, 1, "compute"), (0.25, 1, "none"), (2.0, 4, "none"), (2.0, 4, "compute"),
                            (2.0, 1, "compute")):
    data = g.make_data(size, tensors, "pinned", cfg)
    epoch = data.epoch
    copy_s = data.batch_bytes / (ceiling * 1e9)
    step = g.make_step(loop, int(copy_s * 1.2 * rate), cfg)
    res = {}
    pfs = {"gpufeed": CudaPrefetcher(epoch, device=dev, depth=2),
           "gpufeed_nomeasure": CudaPrefetcher(epoch, device=dev, depth=2, measure=False),
           "gpufeed_loopstream": CudaPrefetcher(epoch, device=dev, depth=2),
           "gpufeed_copystream": CudaPrefetcher(epoch, device=dev, depth=2)}
    force = {"gpufeed_loopstream": float("inf"), "gpufeed_copystream": 0.0}
    pin_nb = lambda: ({k: v.to(dev, non_blocking=True) for k, v in b.items()} for b in epoch)
    for r in range(5):
        for name in ("pin_nb", *pfs):
            pf = pfs.get(name)
            out = run(pin_nb, step, len(epoch), pf, force.get(name))
            if r:
                res.setdefault(name, []).append(out)
    print(f"\n== {size} MiB x{tensors} pinned {loop}; {len(epoch)} batches; copy {copy_s*1e6:.1f} us")
    for name, rows in res.items():
        med = [statistics.median(x[i] for x in rows) for i in range(3)]
        pf = pfs.get(name)
        extra = ""
        if pf is not None:
            s = pf.stats
            c = pf._stage.costs
            extra = (f" loop_stream {s.loop_stream_batches}/{s.batches} calls_s "
                     f"{(c.calls_s or 0)*1e6:.1f} us idle_s {c.idle_s*1e6:.1f} loop_bytes {c.loop_bytes:.0f}")
        print(f"{name:20s} step {med[0]:7.1f} us  next wall {med[1]:6.1f}  next cpu {med[2]:6.1f}{extra}")
    if (size, loop) == (0.25, "compute"):
        from torch.profiler import profile, ProfilerActivity
        pf = pfs["gpufeed"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(None, step, len(epoch), pf)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(pin_nb, step, len(epoch))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    for pf in pfs.values():
        pf.close()
