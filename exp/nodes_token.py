"""Why ToDevice's loop thread spends more in next() on the token step's nodes feeds (issue 36)."""
import itertools, statistics, sys, time
sys.path.insert(0, "benchmarks")
import torch
import bench_loops as bl
from gpufeed import nodes as gn

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
STEP = sys.argv[2] if len(sys.argv) > 2 else "token"
WORKERS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
SMOKE = not torch.cuda.is_available()
cfg = bl.parse_args(["--steps", STEP, "--feeds", f"nodes{WORKERS}", "--rounds", "3", "--workers", str(WORKERS), "--out", "/tmp/x"] + (["--smoke"] if SMOKE else []))
spec = bl.step_specs(SMOKE)[STEP]
trainer = bl.Trainer(spec, cfg.device)
data = bl.StepData(spec, cfg)
ideal = bl.measure_ideal(trainer, data, cfg)
print(f"ideal {ideal['steps_per_s']:.1f} steps/s gpu_us {ideal.get('gpu_us')} epoch {data.epoch}", flush=True)

inner = {"t": 0.0, "n": 0}
orig_next = gn.ToDevice.next
def timed_next(self):
    t = time.perf_counter()
    try:
        return orig_next(self)
    finally:
        inner["t"] += time.perf_counter() - t; inner["n"] += 1
gn.ToDevice.next = timed_next

import threading
MAIN = threading.get_ident()
parts = {}
def add(k, dt):
    parts[k] = parts.get(k, 0.0) + dt
NOPIN = {"on": False}
_is_pinned, _to = torch.Tensor.is_pinned, torch.Tensor.to
def is_pinned(self, *a, **k):
    if threading.get_ident() != MAIN:
        return _is_pinned(self, *a, **k)
    if NOPIN["on"]:
        return True
    t = time.perf_counter(); r = _is_pinned(self, *a, **k); add("is_pinned", time.perf_counter() - t); return r
def to(self, *a, **k):
    if threading.get_ident() != MAIN:
        return _to(self, *a, **k)
    t = time.perf_counter(); r = _to(self, *a, **k); add("to", time.perf_counter() - t); return r
torch.Tensor.is_pinned, torch.Tensor.to = is_pinned, to
def wrap_stage(stage):
    for name in ("copy", "hand_over", "asked"):
        f = getattr(stage, name)
        def w(*a, _f=f, _n=name):
            t = time.perf_counter()
            try:
                return _f(*a)
            finally:
                add(_n, time.perf_counter() - t)
        setattr(stage, name, w)

from torchdata import nodes
def loader(method, make_head):
    if method == "todevice_nopin":
        return bl.nodes_loader("todevice_pc", make_head, cfg.device)
    if method == "pc_nb":
        return nodes.Loader(nodes.Prefetcher(make_head(gn.pinned_collate), prefetch_factor=2))
    return bl.nodes_loader(method, make_head, cfg.device)

class R(bl.Runner):
    def __init__(self, method, source, device):
        self.method, self.source, self.device = method, source, device
        self.keep = loader(method, source)
    def epoch(self):
        if self.method in ("nodes_pin_nb", "pc_nb"):
            return (bl.to_device(b, self.device, non_blocking=True) for b in self.keep)
        return iter(self.keep)

methods = ["nodes_pin_nb", "todevice_pc", "pc_nb", "todevice_nopin"]
feed = bl.feed_table((WORKERS,))[f"nodes{WORKERS}"]
runners = {m: R(m, feed.make(data), cfg.device) for m in methods}
for m in methods:
    if isinstance(runners[m].keep.root, gn.ToDevice):
        wrap_stage(runners[m].keep.root._stage)
breakdown = {m: [] for m in methods}
rates = {m: [] for m in methods}; nxt = {m: [] for m in methods}; extra = {m: [] for m in methods}
for r in range(ROUNDS):
    for m in methods[r % 4:] + methods[:r % 4]:
        st = None
        root = runners[m].keep.root
        if isinstance(root, gn.ToDevice):
            st = root.stats; f0, b0 = st.fetch_s, st.batches; inner["t"] = 0.0; inner["n"] = 0
        parts.clear(); NOPIN["on"] = m == "todevice_nopin"
        rate, us = bl._window(runners[m], trainer, data, cfg)
        NOPIN["on"] = False
        nb = (st.batches - b0) if st is not None else (data.epoch)
        breakdown[m].append({k: v / max(nb, 1) * 1e6 for k, v in parts.items()})
        rates[m].append(rate); nxt[m].append(us)
        if st is not None and st.batches > b0:
            nb = st.batches - b0
            extra[m].append(((st.fetch_s - f0) / nb * 1e6, (inner["t"] / max(inner["n"], 1)) * 1e6,
                             st.loop_stream_batches))
for m in methods:
    print(f"{m:>14} {statistics.median(rates[m]):7.1f} steps/s  ({min(rates[m]):.1f}-{max(rates[m]):.1f})  "
          f"next {statistics.median(nxt[m]):7.1f} us", flush=True)
    if extra[m]:
        print("     ToDevice: fetch us/batch, next us (inner), loop-stream batches:",
              [tuple(round(x, 1) for x in e) for e in extra[m]])
    keys = sorted({k for d in breakdown[m] for k in d})
    print("     us/batch on the loop thread:", {k: round(statistics.median([d.get(k, 0.0) for d in breakdown[m]]), 1) for k in keys})
base = rates["nodes_pin_nb"]
for m in methods[1:]:
    print(f"{m} / nodes_pin_nb paired: {statistics.median([a / b for a, b in zip(rates[m], base)]):.3f}")
