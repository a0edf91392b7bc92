"""Where does gpufeed's pageable loop-stream path spend the loop thread's time, against pin_memory + .to?"""
import statistics, time, collections
import torch
from torch import nn
import torch.nn.functional as F
from gpufeed import CudaPrefetcher, _staging, host_memory

dev = torch.device("cuda")
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
acc = collections.defaultdict(float)
pc = time.perf_counter
def lean(data):
    for x, y in data:
        t0 = pc(); px = x.pin_memory(); t1 = pc(); dx = px.to(dev, non_blocking=True); t2 = pc()
        py = y.pin_memory(); t3 = pc(); dy = py.to(dev, non_blocking=True); t4 = pc()
        acc["lean pin x"] += t1 - t0; acc["lean to x"] += t2 - t1; acc["lean pin y"] += t3 - t2; acc["lean to y"] += t4 - t3
        yield dx, dy
def send(self, tensors, device):
    t0 = pc()
    outs = [None] * len(tensors)
    groups = self._groups(tensors)
    t1 = pc(); acc["gf groups"] += t1 - t0
    for group in groups:
        t = tensors[group[0]]
        a = pc(); t = t.contiguous(); p = host_memory.pin(t); b = pc()
        outs[group[0]] = p.to(device, non_blocking=True); c = pc()
        acc[f"gf pin {len(outs)}{group[0]}"] += b - a; acc[f"gf to {len(outs)}{group[0]}"] += c - b
    acc["gf send"] += pc() - t0
    return outs
_staging.Stager.send = send
def epoch(it):
    torch.cuda.synchronize(); t0 = pc(); inside = 0.0; n = 0
    while True:
        a = pc()
        try:
            b = next(it)
        except StopIteration:
            break
        inside += pc() - a; step(b); n += 1
    torch.cuda.synchronize()
    return n / (pc() - t0), inside / n * 1e6
pfs = {d: CudaPrefetcher(pageable, device=dev, depth=d) for d in (1, 2)}
res = collections.defaultdict(list)
for r in range(5):
    acc.clear()
    res["lean"].append(epoch(lean(pageable)))
    for d, pf in pfs.items():
        res[f"gf depth {d}"].append(epoch(iter(pf)))
for k, v in res.items():
    s = [a for a, _ in v]; u = [b for _, b in v]
    print(f"  {k:12s} {statistics.median(s):7.1f} steps/s ({min(s):.0f}-{max(s):.0f})  next() {statistics.median(u):6.1f} us")
print("per batch, last round (gf: both depths summed, so halve):")
for k, v in sorted(acc.items()):
    print(f"  {k:14s} {v / N * 1e6:7.1f} us")
for d, pf in pfs.items():
    print(d, "loop stream", pf.stats.loop_stream_batches, "of", pf.stats.batches)
