"""Is .to(non_blocking=True) straight from pageable memory a cheaper loop-stream copy than pin + .to?"""
import statistics, time
import torch
from torch import nn
import torch.nn.functional as F

dev = torch.device("cuda")
torch.cuda.init()
# 1. does the call block behind queued work? 5 ms of sleep queued, then one copy
print("size_KiB  pageable_nb_us  pin+nb_us  (5 ms of work queued ahead)")
for kib in (16, 64, 256, 512, 1024, 2048, 4096, 8192):
    x = torch.randn(kib * 256)
    for _ in range(2):
        x.to(dev, non_blocking=True); x.pin_memory().to(dev, non_blocking=True)
    torch.cuda.synchronize()
    a = []; b = []
    for _ in range(5):
        torch.cuda._sleep(5_000_000)
        t0 = time.perf_counter(); x.to(dev, non_blocking=True); a.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        torch.cuda._sleep(5_000_000)
        t0 = time.perf_counter(); x.pin_memory().to(dev, non_blocking=True); b.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    print(f"{kib:8d}  {statistics.median(a)*1e6:14.1f}  {statistics.median(b)*1e6:9.1f}")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
def step(b):
    x, y = b
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
N = 600
pageable = [(torch.randn(512, 256), torch.randint(0, 10, (512,))) for _ in range(N)]
def pin_nb(data):
    for x, y in data:
        yield x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
def nb(data):
    for x, y in data:
        yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
def to(data):
    for x, y in data:
        yield x.to(dev), y.to(dev)
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
rows = {k: [] for k in ("pin_nb", "nb_pageable", "to")}
fns = {"pin_nb": pin_nb, "nb_pageable": nb, "to": to}
for r in range(7):
    for k in rows:
        rows[k].append(epoch(fns[k](pageable)))
print("MLP, pageable 516 KiB batches, 7 rounds of 600 steps")
for k, v in rows.items():
    s = [a for a, _ in v]; u = [b for _, b in v]
    print(f"  {k:12s} {statistics.median(s):7.1f} steps/s ({min(s):.0f}-{max(s):.0f})  next() {statistics.median(u):6.1f} us")
