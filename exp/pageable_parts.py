"""Where the pageable list's extra next() time goes in bench_loops' MLP step, on the GPU: the one-liner
(pin_memory() + .to(non_blocking=True)), the same with an is_pinned() check a leaf, the same taken
depth (2) batches ahead through a deque, a minimal prefetcher doing both, and gpufeed; pinned and
pageable lists, interleaved rounds, one process."""

import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_loops as bl

import gpufeed

SMOKE = "--smoke" in sys.argv
ROUNDS = 2 if SMOKE else 6
dev = torch.device("cpu" if SMOKE else "cuda")
cfg = bl.parse_args(["--steps", "mlp", "--seconds", "1.0"] + (["--smoke"] if SMOKE else []))
spec = bl.step_specs(SMOKE)["mlp"]
trainer = bl.Trainer(spec, dev)
data = bl.StepData(spec, cfg)
bl.measure_ideal(trainer, data, cfg)


def move(t, check):
    if check and t.is_pinned():
        return t.to(dev, non_blocking=True)
    return (t if SMOKE else t.pin_memory()).to(dev, non_blocking=True)


def oneliner(lst, check=False):
    for b in lst:
        yield tuple(move(t, check) for t in b)


def ahead(lst, check=False, depth=2):
    q = collections.deque()
    for b in lst:
        q.append(tuple(move(t, check) for t in b))
        if len(q) > depth:
            yield q.popleft()
    while q:
        yield q.popleft()


METHODS = ("oneliner", "checked", "ahead", "ahead_checked", "gpufeed")
for pinned in (True, False):
    lst = data.listed(pinned)
    pf = gpufeed.CudaPrefetcher(lst, device=dev)
    makers = {"oneliner": lambda: oneliner(lst), "checked": lambda: oneliner(lst, True),
              "ahead": lambda: ahead(lst), "ahead_checked": lambda: ahead(lst, True), "gpufeed": lambda: iter(pf)}
    got = {m: [] for m in METHODS}
    for r in range(ROUNDS):
        for m in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
            it = makers[m]()
            got[m].append(bl.time_window(trainer, it, data.warm, spec.min_steps, cfg.seconds, dev))
            it.close()
    print(f"== mlp, {'pinned' if pinned else 'pageable'} list, {ROUNDS} rounds", flush=True)
    for m in METHODS:
        rates = [g[0] for g in got[m]]
        nexts = [g[1] for g in got[m]]
        d = [g[1] - o[1] for g, o in zip(got[m], got["oneliner"], strict=True)]
        print(f"  {m:14s} {statistics.median(rates):7.1f} steps/s ({min(rates):.0f}-{max(rates):.0f})  next "
              f"{statistics.median(nexts):6.1f} us ({min(nexts):.0f}-{max(nexts):.0f}), over the one-liner paired "
              f"{statistics.median(d):+.1f}", flush=True)
    pf.close()
