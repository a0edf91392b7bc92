"""Where does the fetch thread's time go per batch, with and without a training step? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_phases.py [--fine]

The CudaPrefetcher moves 24 distinct 64 MiB 4-tensor pageable batches (as bench_prefetcher's), 256 steps,
first with an empty consumer, then with a matmul step of 1.2x the pinned copy time (as bench_prefetcher's
``unpinned_compute``). Prints per batch: the fetch thread's time in each timed call (waiting for a slot,
the whole deliver, the staging calls, waiting for a pinned buffer, sealing), deliver's time outside
staging (Python and torch calls), the fetch loop's period, and the consumer's wall and CPU time in next().
``--fine`` also times each call that deliver makes (flatten, plan, views, ``torch.empty``...).
"""

import sys
import time

import _diag_fill
import torch
from _diag_gap import dict_batches

import gpufeed
from gpufeed import _copier, _hostcopy, _worker, staging

ITERS = 256
T: dict[str, list[float]] = {}


def timed(owner, name, key):
    _diag_fill.timed(owner, name, key, lambda k, seconds: T.setdefault(k, []).append(seconds))


def matmul_step(target_s):
    a = torch.randn(1024, 1024, device="cuda")
    c = torch.empty_like(a)
    for _ in range(20):
        torch.mm(a, a, out=c)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        torch.mm(a, a, out=c)
    torch.cuda.synchronize()
    k = max(1, round(target_s / ((time.perf_counter() - t0) / 200)))

    def step(batch):
        for _ in range(k):
            torch.mm(a, a, out=c)
        c[:1, :1].add_(batch["x"][:1, :1])

    return step, k


def run(pf, step):
    wall = cpu = 0.0
    it = iter(pf)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while True:
        c0, w0 = time.thread_time(), time.perf_counter()
        b = next(it, None)
        wall += time.perf_counter() - w0
        cpu += time.thread_time() - c0
        if b is None:
            break
        step(b)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, wall, cpu


def main():
    timed(_worker.Slots, "acquire", "slot wait")
    timed(_copier.Copier, "deliver", "deliver")
    timed(staging.ChunkPipeline, "run_raw", "run_raw")
    timed(_hostcopy, "stage", "stage call")
    timed(staging.PinnedPool, "acquire", "buffer wait")
    timed(_copier.Copier, "_begin", "begin")
    timed(_copier.Copier, "seal", "seal")
    if "--fine" in sys.argv:  # each call deliver makes, timed apart (the timing adds its own cost)
        timed(_copier, "flatten", "flatten")
        timed(_copier, "layout", "layout")
        timed(_copier, "plan_raw", "plan_raw")
        timed(_copier, "_is_pinned", "is_pinned")
        timed(_hostcopy, "_pieces", "_pieces")
        timed(torch.Tensor, "view", "Tensor.view")
        timed(torch.Tensor, "as_strided", "Tensor.as_strided")
        timed(torch.Tensor, "record_stream", "Tensor.record_stream")

        class TorchProxy:  # times torch.empty as the copier calls it
            def __getattr__(self, name):
                return getattr(torch, name)

        proxy = TorchProxy()
        proxy.empty = torch.empty
        _copier.torch = proxy
        timed(proxy, "empty", "torch.empty")
    dicts = dict_batches(24)
    pinned_copy_s = 64 * 2**20 / 54e9
    step, k = matmul_step(1.2 * pinned_copy_s)
    for name, fn in (("no step", lambda b: None), (f"step {k} matmuls", step)):
        pf = gpufeed.CudaPrefetcher([dicts[i % 24] for i in range(ITERS)], depth=3)
        run(pf, fn)  # warm-up epoch
        T.clear()
        wall, nwall, ncpu = run(pf, fn)
        gbps = 64 * 2**20 * ITERS / wall / 1e9
        out = [f"{name}: {wall / ITERS * 1e6:.0f} us/step, {gbps:.1f} GB/s; consumer "
               f"next() {nwall / ITERS * 1e6:.0f} us wall {ncpu / ITERS * 1e6:.0f} us cpu"]
        for key, times in T.items():
            times = times[-ITERS:]
            out.append(f"  {key}: {len(times)}x {sum(times) / ITERS * 1e6:.0f} us/batch "
                       f"(median {sorted(times)[len(times) // 2] * 1e6:.0f}, max {max(times) * 1e6:.0f})")
        d = sum(T["deliver"][-ITERS:]) - sum(T["run_raw"][-ITERS:])
        out.append(f"  deliver outside run_raw: {d / ITERS * 1e6:.0f} us/batch")
        print("\n".join(out), flush=True)
        pf.close()


if __name__ == "__main__":
    main()
