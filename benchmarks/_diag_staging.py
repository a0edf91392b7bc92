import sys, time, torch, importlib.util
sys.path.insert(0, "benchmarks")
spec = importlib.util.spec_from_file_location("bp", "benchmarks/bench_prefetcher.py"); bp = importlib.util.module_from_spec(spec); sys.modules["bp"] = bp; spec.loader.exec_module(bp)
from gpufeed import CudaPrefetcher
MiB = 1 << 20
def rate(loader, **kw):
    with CudaPrefetcher(loader, depth=3, **kw) as pf:
        for _ in pf: pass
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(2):
            for _ in pf: pass
        torch.cuda.synchronize(); dt = time.perf_counter() - t0
        return round(2 * 64 * 64 * MiB / dt / 1e9, 1), round(pf.stats.stage_GBps, 1)
dicts = bp.make_batches(24, 64 * MiB)
single = [torch.randn(16 * MiB) for _ in range(24)]
cyc = lambda data: [data[i % len(data)] for i in range(64)]
xonly = [{"x": d["x"]} for d in dicts]
print("dicts", rate(cyc(dicts)), flush=True)
print("single", rate(cyc(single)), flush=True)
print("x only", rate(cyc(xonly)), flush=True)
print("dicts chunk64", rate(cyc(dicts), chunk_bytes=64 * MiB), flush=True)
def pin_loop(data):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for b in data:
        {k: v.pin_memory().to("cuda", non_blocking=True) for k, v in b.items()}
    torch.cuda.synchronize(); return round(len(data) * 64 * MiB / (time.perf_counter() - t0) / 1e9, 1)
pin_loop(cyc(dicts)); print("pin_non_blocking", pin_loop(cyc(dicts)), flush=True)
print("dicts after pin", rate(cyc(dicts)), flush=True)
import threading
box = {}
def in_thread(): box["r"] = pin_loop(cyc(dicts))
t = threading.Thread(target=in_thread); t.start(); t.join(); print("pin loop in a fresh thread", box["r"], flush=True)
