"""Where gpufeed's next() goes in the MLP step of bench_loops over a list (pageable, pinned), beside
pin_memory() + .to(non_blocking=True): steps/s, next() a step, and from the stats the staging, the
loader and the share of batches on the loop's stream; gpufeed forced to either stream, and gpufeed with
its copy and hand-over timed in place. 4 interleaved rounds of 1.5 s."""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_loops as bl
from bench_grid import to_device

from gpufeed import CudaPrefetcher, _device, host_memory

PIN_PAGEABLE = host_memory.pin_pageable

SMOKE = "--smoke" in sys.argv
dev = torch.device("cpu" if SMOKE else "cuda")
cfg = bl.parse_args(["--steps", "mlp", "--seconds", "1.5"] + (["--smoke"] if SMOKE else []))
spec = bl.step_specs(SMOKE)["mlp"]
trainer = bl.Trainer(spec, dev)
data = bl.StepData(spec, cfg)
bl.measure_ideal(trainer, data, cfg)


class Timed:
    """Accumulates the seconds spent in a wrapped function."""

    def __init__(self, fn):
        self.fn, self.s, self.n = fn, 0.0, 0

    def __call__(self, *a):
        t = time.perf_counter()
        try:
            return self.fn(*a)
        finally:
            self.s += time.perf_counter() - t
            self.n += 1


def make(method, lst):
    if method == "pin_nb":
        return None
    pf = CudaPrefetcher(lst, device=dev)
    st = pf._stage
    if method == "gf_copy_stream":
        st.costs.link = None
    if method == "gf_timed":
        st.copy = Timed(st.copy)
        st.hand_over = Timed(st.hand_over)
    return pf


def window(method, pf, lst):
    if pf is None:
        it = (to_device(b, dev, non_blocking=True, pin=not SMOKE) for b in lst)
    else:
        it = iter(pf)
        s = pf.stats
        before = (s.batches, s.loop_stream_batches, s.stage_s, s.fetch_s)
        if method == "gf_timed":
            t0 = (pf._stage.copy.s, pf._stage.copy.n, pf._stage.hand_over.s)
    recheck = _device.RECHECK_EVERY
    if method == "gf_pin_memory":  # the staging's pin as before: pin_memory(), which checks is_pinned() again
        host_memory.pin_pageable = host_memory.pin
    if method == "gf_loop_stream":
        _device.RECHECK_EVERY = 1 << 40
        if pf._stage.costs.link is not None:
            pf._stage.costs.link = (0.0, float("inf"))
    try:
        rate, next_us = bl.time_window(trainer, it, data.warm, spec.min_steps, cfg.seconds, dev)
    finally:
        _device.RECHECK_EVERY = recheck
        host_memory.pin_pageable = PIN_PAGEABLE
    extra = {}
    if pf is not None:
        s = pf.stats
        n = s.batches - before[0]
        extra = {"loop": (s.loop_stream_batches - before[1]) / n,
                 "stage_us": (s.stage_s - before[2]) / n * 1e6, "fetch_us": (s.fetch_s - before[3]) / n * 1e6}
        if method == "gf_timed":
            c = pf._stage.copy
            extra["copy_us"] = (c.s - t0[0]) / (c.n - t0[1]) * 1e6
            extra["hand_us"] = (pf._stage.hand_over.s - t0[2]) / n * 1e6
    return rate, next_us, extra


methods = ["pin_nb", "gpufeed", "gf_pin_memory", "gf_timed"]
for pinned in (False,):
    lst = data.listed(pinned)
    pfs = {m: make(m, lst) for m in methods}
    got = {m: [] for m in methods}
    for r in range(4):
        for m in methods[r % len(methods):] + methods[:r % len(methods)]:
            got[m].append(window(m, pfs[m], lst))
    print(f"== MLP, {'pinned' if pinned else 'pageable'} list", flush=True)
    for m in methods:
        rates = [g[0] for g in got[m]]
        nexts = [g[1] for g in got[m]]
        ex = {k: statistics.median([g[2][k] for g in got[m]]) for k in got[m][0][2]}
        exs = " ".join(f"{k} {v:.2f}" for k, v in ex.items())
        print(f"  {m:15s} {statistics.median(rates):6.1f} steps/s ({min(rates):.0f}-{max(rates):.0f})  "
              f"next {statistics.median(nexts):6.1f} us   {exs}", flush=True)
    for pf in pfs.values():
        if pf is not None:
            pf.close()
