"""Staging ring size: does a small, cache-resident set of pinned buffers beat a large one? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_ring.py

Stages 64 MiB pageable batches in `chunk`-sized pieces through `slots` pinned buffers (each reused once
the copy that read it completed) and copies each piece to the device; prints end-to-end GB/s and the
staging rate alone. On an H200 machine (300 MiB L3, pinned ceiling 55 GB/s): 4 x 16 MiB 54.7 GB/s,
8 x 32 MiB 43, and 4 x 64 MiB 35 (_diag_contention.py, which reuses ``ring`` with its own slots).
"""

import os
import subprocess
import threading
import time

import torch

MiB = 1 << 20
SIZE = 64 * MiB  # one batch


def in_thread(fn, cpus=None):
    """``fn()`` run on a new thread (bound to ``cpus`` when given; threads it starts, such as its OpenMP
    team, inherit that); its result."""
    box = {}

    def run():
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread
        box["r"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box["r"]


def ring(chunk, nslots, srcs, dma=True, slots=None, fill=None):
    """End-to-end GB/s of 64 batches staged in ``chunk`` pieces through ``nslots`` pinned buffers.

    ``slots``: the buffers to use (each at least ``chunk`` bytes), e.g. write-combined ones; default
    ``nslots`` fresh pinned buffers. ``dma=False`` times the staging copies alone. ``fill(dst, src)``:
    the staging copy (default ``dst.copy_(src)``).
    """
    fill = fill or (lambda dst, src: dst.copy_(src))
    if slots is None:
        slots = [torch.zeros(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(nslots)]
    nslots = len(slots)
    stream = torch.cuda.Stream()
    dev = [torch.empty(SIZE, dtype=torch.uint8, device="cuda") for _ in range(4)]
    events = [None] * nslots

    def run(n=64):
        c = 0
        for i in range(n):
            src = srcs[i % len(srcs)]
            for o in range(0, SIZE, chunk):
                j = c % nslots
                c += 1
                if events[j] is not None:
                    events[j].synchronize()
                fill(slots[j][: min(chunk, SIZE - o)], src[o : o + chunk])
                if dma:
                    with torch.cuda.stream(stream):
                        dev[i % 4][o : o + chunk].copy_(slots[j][: min(chunk, SIZE - o)], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(stream)
                    events[j] = ev
        torch.cuda.synchronize()

    run(8)
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    return round(64 * SIZE / wall / 1e9, 1)


def main():
    print(
        subprocess.run(
            "lscpu | grep -i -E 'cache|model name|socket|numa'", shell=True, capture_output=True, text=True
        ).stdout
    )
    srcs = [torch.full((SIZE,), i, dtype=torch.uint8) for i in range(16)]
    for th in (16, 12):
        torch.set_num_threads(th)
        for chunk in (4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB):
            for ns in (2, 3, 4, 8):
                print(
                    f"{th} threads chunk {chunk >> 20} MiB x {ns} slots: e2e {ring(chunk, ns, srcs)} "
                    f"stage-only {ring(chunk, ns, srcs, dma=False)}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
