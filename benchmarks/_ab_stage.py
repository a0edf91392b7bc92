"""A/B of staging designs for pageable batches (experiment; its answer goes to docs/design.md)."""

from __future__ import annotations

import argparse
import collections
import json
import queue
import sys
import threading
import time

import torch

MiB = 1 << 20


def align(n):
    return -(-n // 64) * 64


def stage_whole(leaves, dev, ctx):
    return [t.pin_memory().to(dev, non_blocking=True) for t in leaves]


def stage_block(leaves, dev, ctx):
    """One pinned block for the batch (torch's allocator), one H2D copy, views."""
    sizes = [t.nbytes for t in leaves]
    offs, end = [], 0
    for n in sizes:
        offs.append(end)
        end = align(end + n)
    p = torch.empty(end, dtype=torch.uint8, pin_memory=True)
    for t, o, n in zip(leaves, offs, sizes):
        p[o:o + n].copy_(t.reshape(-1).view(torch.uint8))
    d = p.to(dev, non_blocking=True)
    return [d[o:o + n].view(t.dtype).view(t.shape) for t, o, n in zip(leaves, offs, sizes)]


def make_chunked(chunk, window):
    def stage(leaves, dev, ctx):
        sizes = [t.nbytes for t in leaves]
        offs, end = [], 0
        for n in sizes:
            offs.append(end)
            end = align(end + n)
        d = torch.empty(end, dtype=torch.uint8, device=dev)
        srcs = [t.reshape(-1).view(torch.uint8) for t in leaves]
        inflight = ctx.setdefault("inflight", collections.deque())
        for a in range(0, end, chunk):
            b = min(end, a + chunk)
            if window and len(inflight) >= window:
                inflight.popleft().synchronize()
            p = torch.empty(b - a, dtype=torch.uint8, pin_memory=True)
            for s, o, n in zip(srcs, offs, sizes):
                lo, hi = max(a, o), min(b, o + n)
                if lo < hi:
                    p[lo - a:hi - a].copy_(s[lo - o:hi - o])
            d[a:b].copy_(p, non_blocking=True)
            if window:
                ev = torch.cuda.Event()
                ev.record()
                inflight.append(ev)
        return [d[o:o + n].view(t.dtype).view(t.shape) for t, o, n in zip(leaves, offs, sizes)]
    return stage


class BG:
    """A minimal background-thread prefetcher around a stage function."""

    def __init__(self, loader, dev, depth, stage):
        self.loader, self.dev, self.depth, self.stage = loader, dev, depth, stage
        self.stream = torch.cuda.Stream(dev)

    def __iter__(self):
        q = queue.SimpleQueue()
        slots = threading.Semaphore(self.depth)
        consumer = torch.cuda.current_stream(self.dev)
        ctx = {}

        def run():
            torch.cuda.set_device(self.dev)
            for b in self.loader:
                slots.acquire()
                with torch.cuda.stream(self.stream):
                    out = self.stage(list(b.values()), self.dev, ctx)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                for t in out:
                    t.record_stream(consumer)
                q.put((dict(zip(b.keys(), out)), ev))
            q.put(None)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        while True:
            item = q.get()
            if item is None:
                break
            slots.release()
            batch, ev = item
            consumer.wait_event(ev)
            yield batch
        th.join()


def pin_nb_loop(loader, dev):
    for b in loader:
        yield {k: v.pin_memory().to(dev, non_blocking=True) for k, v in b.items()}


def make_batches(nbytes, ntensors, pinned, n):
    per = nbytes // ntensors // 4
    pool_bytes = 1 << 30
    distinct = max(2, min(n, pool_bytes // nbytes))
    pool = []
    for i in range(distinct):
        b = {f"t{j}": torch.empty(per, dtype=torch.float32, pin_memory=pinned).fill_(i + j) for j in range(ntensors)}
        pool.append(b)
    return [pool[i % distinct] for i in range(n)]


def run_epoch(it_factory, loop, sleep_cycles, dev):
    torch.cuda.synchronize()
    ct = 0.0
    n = 0
    t0 = time.perf_counter()
    it = iter(it_factory())
    acc = torch.zeros((), device=dev)
    while True:
        c0 = time.thread_time()
        b = next(it, None)
        ct += time.thread_time() - c0
        if b is None:
            break
        n += 1
        if loop != "none":
            torch.cuda._sleep(sleep_cycles)
            x = next(iter(b.values()))
            acc += x[:1].sum()
            if loop == "sync":
                acc.item()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, ct / max(n, 1) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="new")
    ap.add_argument("--variants", default="")
    ap.add_argument("--shapes", default="8:1,64:1,64:4,256:1,2:32,0.25:1,0.25:32")
    ap.add_argument("--loops", default="none,compute")
    ap.add_argument("--epoch-gib", type=float, default=1.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # ceiling
    src = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    ceil = 10 * 256 * MiB / (time.perf_counter() - t0) / 1e9
    del src, dst
    # sleep calibration: cycles per second
    torch.cuda._sleep(1000000)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); torch.cuda._sleep(10_000_000); e1.record(); torch.cuda.synchronize()
    cps = 10_000_000 / (e0.elapsed_time(e1) / 1e3)
    print(f"ceiling {ceil:.1f} GB/s; sleep {cps/1e9:.2f} Gcycles/s; torch threads {torch.get_num_threads()}",
          flush=True)
    variants = {}
    if a.impl == "old":
        from gpufeed import CudaPrefetcher
        variants["gpufeed_old"] = lambda L: CudaPrefetcher(L, depth=2)
    else:
        variants["pin_nb_loop"] = lambda L: (lambda: pin_nb_loop(L, dev))
        variants["whole"] = lambda L: BG(L, dev, 2, stage_whole)
        variants["block"] = lambda L: BG(L, dev, 2, stage_block)
        for c in (4, 16, 32):
            for w in (0, 2, 4):
                variants[f"chunk{c}w{w}"] = (lambda c, w: lambda L: BG(L, dev, 2, make_chunked(c * MiB, w)))(c, w)
        try:
            from gpufeed import CudaPrefetcher
            variants["gpufeed_new"] = lambda L: CudaPrefetcher(L, depth=2)
        except Exception:
            pass
    if a.variants:
        keep = a.variants.split(",")
        variants = {k: v for k, v in variants.items() if k in keep}
    rows = []
    for shape in a.shapes.split(","):
        mb, nt = shape.split(":")
        nbytes = int(float(mb) * MiB)
        nt = int(nt)
        n = max(16, min(4096, int(a.epoch_gib * (1 << 30) / nbytes)))
        batches = make_batches(nbytes, nt, False, n)
        for loop in a.loops.split(","):
            copy_s = nbytes / (ceil * 1e9)
            cycles = int(1.2 * copy_s * cps)
            # the ideal: batch resident
            resident = {k: v.to(dev) for k, v in batches[0].items()}
            ideal = None
            if loop != "none":
                t, _ = run_epoch(lambda: [resident] * n, loop, cycles, dev)
                t, _ = run_epoch(lambda: [resident] * n, loop, cycles, dev)
                ideal = t
            del resident
            for name, mk in variants.items():
                obj = mk(batches)
                fac = obj if callable(obj) and not hasattr(obj, "__iter__") else (lambda o=obj: o)
                run_epoch(fac, loop, cycles, dev)
                ts = [run_epoch(fac, loop, cycles, dev) for _ in range(2)]
                t = min(x[0] for x in ts)
                cu = min(x[1] for x in ts)
                gbps = n * nbytes / t / 1e9
                row = dict(shape=shape, loop=loop, variant=name, GBps=round(gbps, 2), frac=round(gbps / ceil, 3),
                           consumer_us=round(cu, 1),
                           step_over_compute=None if ideal is None else round(t / ideal, 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if hasattr(obj, "close"):
                    obj.close()
                del obj
        del batches
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(ceiling=ceil, rows=rows), f)


if __name__ == "__main__":
    sys.exit(main())
