"""Experiment (not product): where ToDevice's next() spends the loop thread's time in bench_loops' MLP nodes
feed, against Prefetcher + .to(). Run from the repo root: python todevice_parts.py [--smoke] [workers]."""
import collections, functools, sys, threading, time

import psutil
import torch

sys.path.insert(0, "benchmarks")
import bench_loops as bl  # noqa: E402
from torchdata import nodes  # noqa: E402

from gpufeed import _device  # noqa: E402

smoke = "--smoke" in sys.argv
workers = int(next((a for a in sys.argv[1:] if a.isdigit()), "2"))
cfg = bl.parse_args((["--smoke"] if smoke else []) + ["--steps", "mlp"])
spec = bl.step_specs(smoke)["mlp"]
data = bl.StepData(spec, cfg)
data.epoch = 400 if not smoke else 60
trainer = bl.Trainer(spec, cfg.device)
MAIN = threading.get_ident()
spent = collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        if threading.get_ident() != MAIN:
            return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t
    return wrapper


patches = [(nodes.Prefetcher, "next", "upstream next"), (nodes.Prefetcher, "get_state", "upstream state"),
           (torch.Tensor, "is_pinned", "is_pinned"), (torch.Tensor, "to", "Tensor.to"),
           (_device.DeviceStage, "copy", "stage.copy (incl. is_pinned, .to)"),
           (_device.DeviceStage, "hand_over", "stage.hand_over"), (_device.DeviceStage, "asked", "stage.asked")]
for owner, attr, name in patches:
    setattr(owner, attr, timed(name, getattr(owner, attr)))

make_head = bl.nodes_head(data, workers)
for method in ("nodes_to", "todevice_pc", "todevice", "nodes_to", "todevice_pc", "todevice"):
    runner = bl.Runner(method, make_head, cfg.device)
    it = runner.epoch()
    spent.clear()
    calls = [0]

    def step(batch, calls=calls):
        calls[0] += 1
        return trainer(batch)

    proc, me = psutil.Process(), threading.get_native_id()
    main_cpu = lambda: next(sum(t[1:]) for t in proc.threads() if t.id == me)  # noqa: E731
    c0, m0 = sum(proc.cpu_times()[:2]), main_cpu()
    rate, next_us = bl.time_window(step, it, data.warm, 20, 6.0 if not smoke else 1.0, cfg.device)
    c1, m1 = sum(proc.cpu_times()[:2]), main_cpu()
    print(f"    cpu a step: process {(c1 - c0) * 1e3 / calls[0]:.2f} ms, loop thread {(m1 - m0) * 1e3 / calls[0]:.2f} ms")
    print(f"{method:12s} {rate:7.1f} steps/s  next() {next_us / 1e3:7.2f} ms/step")
    for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):  # (warm-up steps included)
        print(f"    {name:36s} {s * 1e6 / calls[0]:9.1f} us/step")
    runner.end(it)
    runner.close()
