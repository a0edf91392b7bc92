"""CNN step, 12 MiB pinned batches: does a copy on a side stream cost the loop, and where?"""
import statistics, sys, time, itertools
import torch
from torch import nn
import torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from bench_loops import cnn
from gpufeed import CudaPrefetcher

dev = torch.device("cuda")
torch.manual_seed(0)
model = cnn(100, 32).to(dev).train()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
def step(b):
    x, y = b
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
N = 150
data = [(torch.randn(64, 3, 128, 128).pin_memory(), torch.randint(0, 100, (64,)).pin_memory()) for _ in range(N)]
resident = [(data[0][0].to(dev), data[0][1].to(dev))] * N
def pin_nb(d):
    for x, y in d:
        yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
side_stream = torch.cuda.Stream()
def side(d):  # torchtnt-like: the next batch copied on a side stream, one ahead
    it = iter(d); cur = None
    def issue(b):
        with torch.cuda.stream(side_stream):
            return (b[0].to(dev, non_blocking=True), b[1].to(dev, non_blocking=True))
    nxt = issue(next(it))
    for b in itertools.chain(it, [None]):
        torch.cuda.current_stream().wait_stream(side_stream)
        cur = nxt
        for t in cur:
            t.record_stream(torch.cuda.current_stream())
        nxt = issue(b) if b is not None else None
        yield cur
gf = CudaPrefetcher(data, device=dev)
gf_loop = CudaPrefetcher(data, device=dev)
gf_loop._stage.costs.on_loop_stream = lambda nbytes, count: True
def epoch(it):
    torch.cuda.synchronize(); t0 = time.perf_counter(); inside = 0.0; n = 0
    while True:
        a = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        inside += time.perf_counter() - a; step(b); n += 1
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0), inside / n * 1e6
methods = {"ideal": lambda: iter(resident), "pin_nb": lambda: pin_nb(data), "side": lambda: side(data),
           "gf": lambda: iter(gf), "gf_loop": lambda: iter(gf_loop)}
for m in methods.values():
    epoch(m())
# the step's GPU time alone: one step queued behind a sleep, timed with events
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda._sleep(500_000_000); e0.record(); [step(resident[0]) for _ in range(20)]; e1.record(); torch.cuda.synchronize()
print(f"GPU time a step (20 steps queued): {e0.elapsed_time(e1) / 20 * 1e3:.0f} us")
rows = {k: [] for k in methods}
for r in range(7):
    for k, m in methods.items():
        rows[k].append(epoch(m()))
for k, v in rows.items():
    s = [a for a, _ in v]; u = [b for _, b in v]
    print(f"  {k:8s} {statistics.median(s):7.1f} steps/s ({min(s):.0f}-{max(s):.0f})  next() {statistics.median(u):6.1f} us")
print("gf loop-stream batches", gf.stats.loop_stream_batches, "of", gf.stats.batches, "calls_us", gf._stage.costs.calls_s)
