"""The calls that pin a pageable leaf, timed alone on the loop's thread (us a call, median of 5 runs of
2000): is_pinned() on pinned and on pageable memory, pin_memory() against the staging's pin_pageable."""

import statistics
import time

import torch

from gpufeed.host_memory import pin_pageable


def us(fn, n=2000):
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return f"{statistics.median(runs):6.2f} ({min(runs):.2f}-{max(runs):.2f})"


for name, shape in (("516 KiB", (512, 256)), ("2 KiB", (512,))):
    page = torch.rand(*shape)
    pinned = page.pin_memory()
    print(f"{name}: is_pinned() pinned {us(pinned.is_pinned)}  pageable {us(page.is_pinned)}  "
          f"pin_memory() {us(page.pin_memory)}  pin_pageable {us(lambda p=page: pin_pageable(p))}",
          flush=True)
