"""What the stream choice is worth in loops of either bound (each batch forced on the loop's stream, on the
copy stream, or left to the rule), and whether NVML's utilization tells the bounds apart. On the GPU."""
import json
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
from bench_loops import cnn

import gpufeed

dev = torch.device("cuda")
try:
    import pynvml
    pynvml.nvmlInit()
    H = pynvml.nvmlDeviceGetHandleByIndex(0)
except Exception as e:
    print("no pynvml:", repr(e))
    H = None


def util():
    return pynvml.nvmlDeviceGetUtilizationRates(H).gpu if H is not None else -1


class Sampler:
    def __init__(self):
        self.vals, self.stop = [], threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.wait(0.05):
            self.vals.append(util())

    def end(self):
        self.stop.set()
        self.t.join()
        v = self.vals[len(self.vals) // 4:] or [-1]
        return statistics.median(v)


if H is not None:
    t0 = time.perf_counter()
    for _ in range(100):
        util()
    print(f"nvmlDeviceGetUtilizationRates: {(time.perf_counter() - t0) * 1e4:.1f} us a call")
    t0 = time.perf_counter()
    for _ in range(100):
        torch.cuda.utilization(dev)
    print(f"torch.cuda.utilization: {(time.perf_counter() - t0) * 1e4:.1f} us a call")
    # what counts: idle, copies only, kernels only
    time.sleep(1.5)
    print("idle", util())
    host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    d = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    s = Sampler()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        for _ in range(10):
            d.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    print("H2D copies back to back: util", s.end())
    time.sleep(1.0)
    a = torch.randn(4096, 4096, device=dev)
    s = Sampler()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    print("matmuls back to back: util", s.end())
    s = Sampler()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        a @ a
        torch.cuda.synchronize()
        time.sleep(0.002)
    print("one matmul then 2 ms asleep: util", s.end(), flush=True)


def force(pf, mode):
    if mode == "calls":  # the rule before: the calls alone
        pf._stage.idle = None
    if mode in ("auto", "calls"):
        return
    c = pf._stage.costs
    c._update = lambda: None
    c.loop_bytes = float("inf") if mode == "loop" else 0.0


pin = lambda t: t.pin_memory()  # noqa: E731
images8 = [(pin(torch.randn(64, 3, 128, 128)), pin(torch.randint(0, 100, (64,)))) for _ in range(8)]
images = [images8[i % 8] for i in range(200_000)]
small8 = [[pin(torch.randn(1 << 17)) for _ in range(4)] for _ in range(8)]
small = [small8[i % 8] for i in range(2_000_000)]


def make(width, sync):
    torch.manual_seed(0)
    model = cnn(100, width).to(dev).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(b):
        loss = F.cross_entropy(model(b[0]), b[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sync:
            loss.item()
    return step


loops = {f"cnn{w}{'-item' if s else ''}": (make(w, s), images) for w in (32, 64) for s in (False, True)}
loops["empty-512KiBx4"] = (lambda b: None, small)
modes = ("calls", "auto", "loop")
out = {}
for r in range(5):
    for name, (step, data) in loops.items():
        for mode in modes:
            pf = gpufeed.CudaPrefetcher(data, device=dev)
            force(pf, mode)
            it = iter(pf)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 1.3:
                step(next(it))
            torch.cuda.synchronize()
            before = pf.stats.loop_stream_batches
            s = Sampler()
            t0, k = time.perf_counter(), 0
            while time.perf_counter() - t0 < 1.0:
                step(next(it))
                k += 1
            torch.cuda.synchronize()
            rate = k / (time.perf_counter() - t0)
            u = s.end()
            out.setdefault(name, {}).setdefault(mode, []).append(
                (rate, (pf.stats.loop_stream_batches - before) / k, u, pf._stage.costs.idle_s * 1e6,
                 pf._stage.costs.loop_bytes / 2**20))
            pf.close()
    print(f"round {r} done", flush=True)

for name, d in out.items():
    base = d["calls"]
    line = [f"{name:15s}"]
    for mode in modes:
        rows = d[mode]
        paired = [x[0] / y[0] for x, y in zip(rows, base, strict=True)]
        line.append(f"{mode}: {statistics.median(x[0] for x in rows):8.1f}/s "
                    f"({min(x[0] for x in rows):.0f}-{max(x[0] for x in rows):.0f}) "
                    f"x{statistics.median(paired):.3f} loop {statistics.median(x[1] for x in rows):.0%} "
                    f"util {statistics.median(x[2] for x in rows):.0f}% "
                    f"idle {statistics.median(x[3] for x in rows):.0f}us "
                    f"loop_bytes {statistics.median(x[4] for x in rows):.1f}MiB")
    print("\n   ".join(line), flush=True)
print(json.dumps(out))
