"""Experiment (not product): timm's own PrefetchLoader against gpufeed over its uint8 DataLoader, with and
without worker slots, interleaved rounds; the loop thread's CPU and the process's a step.
Run from the repo root: python exp/timm_slots.py [--smoke] [rounds]."""
import functools, statistics, sys, time

import psutil

sys.path.insert(0, "benchmarks")
import bench_trainers as bt  # noqa: E402

smoke = "--smoke" in sys.argv
rounds = int(next((a for a in sys.argv[1:] if a.isdigit()), "6"))
cfg = bt.parse_args(["--smoke"] if smoke else [])
work = bt.works(cfg)[0]
real = bt.CudaPrefetcher
variants = {"own": ("own", real), "uint8": ("gpufeed_uint8", real),
            "uint8_noslots": ("gpufeed_uint8", functools.partial(real, worker_slots=False)),
            "uint8_depth1": ("gpufeed_uint8", functools.partial(real, depth=1))}
rates = {k: [] for k in variants}
cpu = {k: [] for k in variants}
proc = psutil.Process()
for r in range(rounds):
    for name, (method, cls) in variants.items():
        bt.CudaPrefetcher = cls
        c0 = sum(proc.cpu_times()[:2])
        rates[name].append(bt.run_timm(method, cfg, work))
        cpu[name].append(sum(proc.cpu_times()[:2]) - c0)
        bt.CudaPrefetcher = real
for name in variants:
    own = rates["own"]
    paired = [a / b for a, b in zip(rates[name], own)]
    print(f"{name:14s} {statistics.median(rates[name]):7.2f} steps/s ({min(rates[name]):.2f}-{max(rates[name]):.2f})"
          f"  paired vs own {statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})"
          f"  main-process cpu a round {statistics.median(cpu[name]):.2f} s")
