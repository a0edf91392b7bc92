"""Where gpufeed's next() spends its time beyond pin_memory() + .to(), on the GPU, in bench_loops' MLP and
token steps over a pinned list (every copy on the loop's stream, nothing pinned): the one-liner; a bare
generator keeping two batches copied ahead as gpufeed does (the copies alone); gpufeed without the verdict's
events (measure=False); gpufeed. Steps/s and the loop thread's time in next(), interleaved rounds."""

import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_loops as bl
from bench_grid import to_device

import gpufeed

SMOKE = "--smoke" in sys.argv
ROUNDS = 2 if SMOKE else 7
dev = torch.device("cpu" if SMOKE else "cuda")
cfg = bl.parse_args(["--steps", "mlp,token", "--seconds", "1.0"] + (["--smoke"] if SMOKE else []))
specs = bl.step_specs(SMOKE)
METHODS = ("pin_nb", "bare", "unmeasured", "gpufeed")


def bare(lst, depth=2):
    ahead = collections.deque()
    for b in lst:
        ahead.append(b.to(dev, non_blocking=True) if isinstance(b, torch.Tensor)
                     else [t.to(dev, non_blocking=True) for t in b])
        if len(ahead) > depth:
            yield ahead.popleft()
    yield from ahead


for step in ("mlp", "token"):
    spec = specs[step]
    trainer = bl.Trainer(spec, dev)
    data = bl.StepData(spec, cfg)
    bl.measure_ideal(trainer, data, cfg)
    lst = data.listed(True)
    pfs = {"unmeasured": gpufeed.CudaPrefetcher(lst, device=dev, measure=False),
           "gpufeed": gpufeed.CudaPrefetcher(lst, device=dev)}
    got = {m: [] for m in METHODS}
    for r in range(ROUNDS):
        for m in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
            if m == "pin_nb":
                it = (to_device(b, dev, non_blocking=True, pin=not SMOKE) for b in lst)
            elif m == "bare":
                it = bare(lst)
            else:
                it = iter(pfs[m])
            got[m].append(bl.time_window(trainer, it, data.warm, spec.min_steps, cfg.seconds, dev))
            if m in pfs:
                it.close()
    print(f"== {step}, pinned list, {ROUNDS} rounds", flush=True)
    for m in METHODS:
        rates, nexts = [g[0] for g in got[m]], [g[1] for g in got[m]]
        d = [g[1] - p[1] for g, p in zip(got[m], got["pin_nb"], strict=True)]
        print(f"  {m:10s} {statistics.median(rates):7.1f} steps/s ({min(rates):.0f}-{max(rates):.0f})  next "
              f"{statistics.median(nexts):6.1f} us ({min(nexts):.0f}-{max(nexts):.0f}), minus pin_nb's "
              f"{statistics.median(d):+.1f} us ({min(d):+.1f} to {max(d):+.1f})", flush=True)
    for pf in pfs.values():
        pf.close()
