"""What do the fetch thread's per-batch torch calls cost, alone and beside a running copy? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_calls.py

Median microseconds per call of the calls the copier makes for each batch (``is_pinned`` on a pageable
tensor, a device ``torch.empty``, a 32 MiB pinned host-to-device ``copy_`` on a side stream, an event
record, ``record_stream``), on the main thread alone and again while another thread runs the compiled
staging copy in a loop (as the copy team does during a batch).
"""

import statistics
import threading
import time

import torch
from _diag_ring import MiB

from gpufeed import staging


def per_call(fn, n=200):
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return round(statistics.median(times) / 1e3, 1), round(sorted(times)[n * 9 // 10] / 1e3, 1)


def main():
    pageable = torch.ones(60 * MiB, dtype=torch.uint8)
    pinned = torch.empty(32 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    ev = torch.cuda.Event(enable_timing=True)

    def h2d():
        with torch.cuda.stream(stream):
            dev.copy_(pinned, non_blocking=True)
        stream.synchronize()

    def h2d_issue_only():
        with torch.cuda.stream(stream):
            dev.copy_(pinned, non_blocking=True)

    calls = {
        "is_pinned (pageable)": pageable.is_pinned,
        "is_pinned (pinned)": pinned.is_pinned,
        "torch.empty 64 MiB cuda": lambda: torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"),
        "h2d copy_ issue (32 MiB, stream)": h2d_issue_only,
        "Event(enable_timing) + record": lambda: torch.cuda.Event(enable_timing=True).record(stream),
        "event record": lambda: ev.record(stream),
        "record_stream": lambda: dev.record_stream(torch.cuda.current_stream()),
        "block slice+view": lambda: dev[64:64 + 4 * MiB].view(torch.float32).view(1024, 1024),
        "stream ctx": lambda: torch.cuda.stream(stream).__enter__(),
    }
    for label in ("alone", "beside the staging copy"):
        stop = threading.Event()
        if label != "alone":
            src = torch.ones(64 * MiB, dtype=torch.uint8)
            buf = torch.empty(64 * MiB, dtype=torch.uint8)

            def loop(stop=stop, buf=buf, src=src):
                while not stop.is_set():
                    staging.fill_segments(buf, [(src, 0)])

            t = threading.Thread(target=loop)
            t.start()
        for name, fn in calls.items():
            p50, p90 = per_call(fn)
            torch.cuda.synchronize()
            print(f"{label}: {name}: p50 {p50} us, p90 {p90} us", flush=True)
        stop.set()
    h2d()


if __name__ == "__main__":
    main()
