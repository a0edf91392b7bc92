"""Why does the consumer's ``xsum += x.sum()`` cost 0.5 ms of host time beside gpufeed? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_touch.py

The CLI bench's consumer touches each 8 MiB batch with two tiny kernel launches; beside an H5Source
prefetcher that took 0.4-0.6 ms of the consumer's thread per batch (``_diag_small.py``), against tens of
microseconds alone. This times the same touch (on a resident tensor) alone and beside one background
activity at a time: reader threads ``preadv``-ing into pinned memory (GIL traffic, no CUDA), a thread
issuing H2D copies and allocations on a side stream (CUDA, little GIL), both, and a gpufeed prefetcher
over a RawSource. Prints the median and p90 microseconds per touch and the background's GB/s.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

MiB = 1 << 20


def touches(n=2000):
    x = torch.randn(2 * MiB, device="cuda")  # 8 MiB float32, as the CLI bench's batches
    xsum = torch.zeros((), dtype=torch.float64, device="cuda")
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        xsum += x.sum()
        ts.append(time.perf_counter() - t)
        time.sleep(0.0002)  # the consumer's wait for its next batch, roughly
    torch.cuda.synchronize()
    ts.sort()
    return round(statistics.median(ts) * 1e6, 1), round(ts[int(0.9 * len(ts))] * 1e6, 1)


class Readers:
    """A driver thread submitting ``pieces`` preadv jobs per 8 MiB batch to ``threads`` workers."""

    def __init__(self, path, threads=8, piece=1 * MiB):
        self.path, self.threads, self.piece = path, threads, piece
        self.stop, self.bytes = threading.Event(), 0

    def run(self):
        buf = torch.empty(8 * MiB, dtype=torch.uint8, pin_memory=True)
        mv = memoryview(buf.numpy())
        fd = os.open(self.path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        with cf.ThreadPoolExecutor(self.threads) as ex:
            off = 0
            while not self.stop.is_set():
                futs = [ex.submit(os.preadv, fd, [mv[o : o + self.piece]], off + o)
                        for o in range(0, 8 * MiB, self.piece)]
                for f in futs:
                    f.result()
                self.bytes += 8 * MiB
                off = (off + 8 * MiB) % (size - 8 * MiB)
        os.close(fd)


class Copies:
    """A thread allocating device batches and copying pinned memory into them on a side stream."""

    def __init__(self):
        self.stop, self.bytes = threading.Event(), 0

    def run(self):
        src = torch.empty(8 * MiB, dtype=torch.uint8, pin_memory=True)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            while not self.stop.is_set():
                d = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
                d.copy_(src, non_blocking=True)
                e = torch.cuda.Event()
                e.record(s)
                while not e.query():
                    time.sleep(20e-6)
                self.bytes += 8 * MiB


def beside(*bgs):
    threads = [threading.Thread(target=b.run, daemon=True) for b in bgs]
    for t in threads:
        t.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    b0 = [b.bytes for b in bgs]
    r = touches()
    dt = time.perf_counter() - t0
    rates = [round((b.bytes - x) / dt / 1e9, 1) for b, x in zip(bgs, b0, strict=True)]
    for b in bgs:
        b.stop.set()
    for t in threads:
        t.join()
    return r, rates


def beside_gpufeed(path, **kw):
    from gpufeed import CudaPrefetcher
    from gpufeed.sources import RawSource

    src = RawSource(path, dtype=torch.float32, shape=1024)
    stop, got = threading.Event(), [0]

    def consume():  # a second consumer thread drains the prefetcher; the touch loop runs on the main one
        with CudaPrefetcher(src, device="cuda", batch_size=2048, **kw) as pf:
            while not stop.is_set():
                for b in pf:
                    x = b["x"] if isinstance(b, dict) else b
                    got[0] += x.numel() * 4
                    if stop.is_set():
                        break

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    time.sleep(0.5)
    g0, t0 = got[0], time.perf_counter()
    r = touches()
    rate = round((got[0] - g0) / (time.perf_counter() - t0) / 1e9, 1)
    stop.set()
    t.join()
    src.close()
    return r, [rate]


def main():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.raw")
        with open(path, "wb") as f:
            block = os.urandom(64 * MiB)
            for _ in range(16):
                f.write(block)
        touches(200)  # warm-up
        print("touch alone (median, p90 us):", touches(), flush=True)
        print("beside 8 readers x 1 MiB:", beside(Readers(path)), flush=True)
        print("beside 8 readers x 4 MiB:", beside(Readers(path, piece=4 * MiB)), flush=True)
        print("beside 2 readers x 4 MiB:", beside(Readers(path, threads=2, piece=4 * MiB)), flush=True)
        print("beside H2D copies:", beside(Copies()), flush=True)
        print("beside both:", beside(Readers(path), Copies()), flush=True)
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        print("beside 8 readers x 1 MiB, switch interval 0.1 ms:", beside(Readers(path)), flush=True)
        sys.setswitchinterval(old)
        print("beside gpufeed RawSource (2048 rows):", beside_gpufeed(path), flush=True)


if __name__ == "__main__":
    main()
