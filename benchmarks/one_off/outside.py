"""Where the thread's time goes a step, MLP/CNN over lists: next() vs the step itself, per method, with GC
time counted; interleaved rounds. One-off (issue 32)."""
import gc, sys, time, statistics, json, itertools
sys.path.insert(0, "benchmarks")
import torch
import bench_loops as bl
from gpufeed import CudaPrefetcher, _device

import os
DRY = os.environ.get("DRY")
dev = torch.device("cpu") if DRY else torch.device("cuda", 0)
_device.RECHECK_EVERY = 1 << 30
gc_t = [0.0, 0, 0.0]
def _gccb(phase, info):
    if phase == "start":
        gc_t[2] = time.perf_counter()
    else:
        gc_t[0] += time.perf_counter() - gc_t[2]; gc_t[1] += 1
gc.callbacks.append(_gccb)

def ahead(src, depth=2, pin=True):
    q = []
    for b in src:
        q.append(bl.to_device(b, dev, non_blocking=True, pin=pin and not DRY))
        if len(q) > depth:
            yield q.pop(0)
    yield from q

def window(trainer, it, warm, secs):
    for _ in range(warm):
        trainer(next(it))
    (torch.cuda.synchronize() if not DRY else None)
    gc_t[0] = 0.0; gc_t[1] = 0
    t0 = time.perf_counter(); n = 0; nx = 0.0; st = 0.0
    while True:
        a = time.perf_counter()
        b = next(it, None)
        c = time.perf_counter()
        nx += c - a
        if b is None:
            break
        trainer(b)
        st += time.perf_counter() - c
        n += 1
        if time.perf_counter() - t0 > secs:
            break
    (torch.cuda.synchronize() if not DRY else None)
    T = time.perf_counter() - t0
    return dict(rate=n / T, next_us=nx / n * 1e6, step_us=st / n * 1e6, gc_us=gc_t[0] / n * 1e6, gcs=gc_t[1])

def make_pf(kind):
    pf = CudaPrefetcher([], device=dev, measure=(kind != "gf_nometer"))
    return pf

def run(stepname, feed, rounds=5, secs=0.5):
    specs = bl.step_specs(bool(DRY))
    spec = specs[stepname]
    cfg = bl.parse_args(["--steps", stepname] + (["--smoke"] if DRY else []))
    trainer = bl.Trainer(spec, dev)
    data = bl.StepData(spec, cfg)
    data.resident = bl.to_device(data.pool[0], dev)
    rate = bl.time_window(trainer, itertools.repeat(data.resident), 20, 20, 0.3, dev)[0]
    data.epoch = int(rate * secs * 1.3) + 60
    lst = data.listed(pinned=(feed == "pinned"))
    pfs = {}
    for k in ("gf", "gf_loop", "gf_copy", "gf_nometer"):
        pfs[k] = CudaPrefetcher(lst, device=dev, measure=(k != "gf_nometer"))
    link = None if DRY else _device.link_cost(dev)
    def its(k):
        if k == "ideal": return itertools.repeat(data.resident)
        if k == "pin_nb": return (bl.to_device(b, dev, non_blocking=True, pin=not DRY) for b in lst)
        if k == "pin_nb_ahead2": return ahead(lst)
        pf = pfs[k]
        c = pf._stage.costs
        if k == "gf_loop": c.link, c.calls_s = link, 1.0
        if k == "gf_copy": c.link = None
        return iter(pf)
    methods = ["ideal", "pin_nb", "pin_nb_ahead2", "gf", "gf_loop", "gf_copy", "gf_nometer"]
    res = {m: [] for m in methods}
    for r in range(rounds):
        for m in methods:
            res[m].append(window(trainer, its(m), 30, secs))
    print(f"== {stepname} list-{feed}  (median of {rounds}; rate range)")
    for m in methods:
        rs = res[m]
        med = lambda key: statistics.median(x[key] for x in rs)
        print(f"{m:14s} rate {med('rate'):7.1f} [{min(x['rate'] for x in rs):6.1f}-{max(x['rate'] for x in rs):6.1f}]"
              f"  period {1e6/med('rate'):7.1f} us  next {med('next_us'):6.1f}  step {med('step_us'):7.1f}"
              f"  gc {med('gc_us'):5.1f} us ({med('gcs')} runs)  loopstream {pfs[m].stats.loop_stream_batches if m in pfs else '-'}")
    for pf in pfs.values(): pf.close()
    return res

for step, feed in [("mlp", "pinned"), ("mlp", "pageable"), ("cnn", "pinned")]:
    run(step, feed)
