"""A/B on the GPU, one process: gpufeed before this change (``gpufeed_old``, a renamed copy of the package of
``5237248``: a flat batch's pageable leaves staged after asking each whether it is pinned) and after (each
leaf pinned as pin_memory() would, a bare tensor taking the flat path), beside the one-liners, in
bench_loops' MLP and token steps over pinned and pageable lists: steps/s and the loop thread's time in
``next()``, interleaved rounds."""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_loops as bl
import gpufeed_old
from bench_grid import to_device

import gpufeed

SMOKE = "--smoke" in sys.argv
ROUNDS = 2 if SMOKE else 7
dev = torch.device("cpu" if SMOKE else "cuda")
cfg = bl.parse_args(["--steps", "mlp,token", "--seconds", "1.0"] + (["--smoke"] if SMOKE else []))
specs = bl.step_specs(SMOKE)
METHODS = ("to", "pin_nb", "old", "new")

for step in ("mlp", "token"):
    spec = specs[step]
    trainer = bl.Trainer(spec, dev)
    data = bl.StepData(spec, cfg)
    bl.measure_ideal(trainer, data, cfg)
    for pinned in (True, False):
        lst = data.listed(pinned)
        pfs = {"old": gpufeed_old.CudaPrefetcher(lst, device=dev), "new": gpufeed.CudaPrefetcher(lst, device=dev)}
        got = {m: [] for m in METHODS}
        for r in range(ROUNDS):
            order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
            for m in order:
                if m == "to":
                    it = (to_device(b, dev) for b in lst)
                elif m == "pin_nb":
                    it = (to_device(b, dev, non_blocking=True, pin=not SMOKE) for b in lst)
                else:
                    it = iter(pfs[m])
                got[m].append(bl.time_window(trainer, it, data.warm, spec.min_steps, cfg.seconds, dev))
                if m in pfs:
                    it.close()
        print(f"== {step}, {'pinned' if pinned else 'pageable'} list, {ROUNDS} rounds", flush=True)
        for m in METHODS:
            rates = [g[0] for g in got[m]]
            nexts = [g[1] for g in got[m]]
            print(f"  {m:7s} {statistics.median(rates):7.1f} steps/s ({min(rates):.0f}-{max(rates):.0f})  "
                  f"next {statistics.median(nexts):6.1f} us ({min(nexts):.0f}-{max(nexts):.0f})", flush=True)
        paired = [n[0] / o[0] for n, o in zip(got["new"], got["old"], strict=True)]
        best = [n[0] / max(a[0], b[0]) for n, a, b in zip(got["new"], got["to"], got["pin_nb"], strict=True)]
        dn = [n[1] - o[1] for n, o in zip(got["new"], got["old"], strict=True)]
        dp = [n[1] - p[1] for n, p in zip(got["new"], got["pin_nb"], strict=True)]
        print(f"  new/old steps/s, paired: {statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f}); "
              f"new/best one-liner paired: {statistics.median(best):.3f}; next new-old {statistics.median(dn):+.1f} us ({min(dn):+.1f} to {max(dn):+.1f}), new-pin_nb {statistics.median(dp):+.1f} us",
              flush=True)
        for pf in pfs.values():
            pf.close()
