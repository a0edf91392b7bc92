"""Experiment (not product): where the MLP step over a pinned list spends the loop thread's time, per
method: next() and the step's own launch time, with and without a sync each step, and gc collections.
Run from the repo root: python exp/pinned_step.py [--smoke] [step]."""
import gc, statistics, sys, time

import torch

sys.path.insert(0, "benchmarks")
import bench_loops as bl  # noqa: E402

from gpufeed import CudaPrefetcher  # noqa: E402

smoke = "--smoke" in sys.argv
stepname = next((a for a in sys.argv[1:] if not a.startswith("-")), "mlp")
cfg = bl.parse_args((["--smoke"] if smoke else []) + ["--steps", stepname])
spec = bl.step_specs(smoke)[stepname]
data = bl.StepData(spec, cfg)
data.epoch = 600 if not smoke else 60
trainer = bl.Trainer(spec, cfg.device)
dev = cfg.device
pinned = data.listed(pinned=True)
resident = bl.to_device(pinned[0], dev)
gcs = [0]
gc.callbacks.append(lambda phase, info: gcs.__setitem__(0, gcs[0] + (phase == "start")))


def source(method):
    if method == "ideal":
        return (resident for _ in pinned)
    if method == "to":
        return (bl.to_device(b, dev) for b in pinned)
    if method == "pin_nb":
        return (bl.to_device(b, dev, non_blocking=True) for b in pinned)
    if method.startswith("gpufeed"):
        kw = {"measure": False} if "nomeasure" in method else {}
        if "d1" in method:
            kw["depth"] = 1
        return iter(CudaPrefetcher(pinned, device=dev, **kw))
    raise ValueError(method)


def window(method, syncing):
    it = source(method)
    for _ in range(30):
        trainer(next(it))
    bl.sync(dev)
    gcs[0] = 0
    nxt, stp, n = 0.0, 0.0, 0
    t0 = time.perf_counter()
    for b in it:
        t1 = time.perf_counter()
        nxt += t1 - t0 if n else 0.0
        trainer(b)
        t2 = time.perf_counter()
        stp += t2 - t1
        if syncing:
            torch.cuda.current_stream().synchronize() if dev.type == "cuda" else None
        n += 1
        t0 = time.perf_counter()
    bl.sync(dev)
    return n, nxt / n * 1e6, stp / n * 1e6, gcs[0]


methods = ["ideal", "to", "pin_nb", "gpufeed", "gpufeed_nomeasure", "gpufeed_d1"]
for syncing in (False, True):
    res = {m: [] for m in methods}
    for r in range(3 if not smoke else 1):
        for m in methods:
            t = time.perf_counter()
            n, nx, st, g = window(m, syncing)
            res[m].append((n / (time.perf_counter() - t), nx, st, g))
    print(f"--- sync each step: {syncing} ({spec.name if hasattr(spec, 'name') else stepname})")
    for m in methods:
        rows = res[m]
        med = lambda i: statistics.median(x[i] for x in rows)  # noqa: E731
        print(f"{m:20s} {med(0):8.1f} steps/s(incl warm)  next {med(1):7.1f} us  step {med(2):7.1f} us  "
              f"gc {med(3):.0f}  stats:{[round(x[0]) for x in rows]}")
