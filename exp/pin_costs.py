"""The loop thread's cost of each call that pins or asks, on the GPU host: a pageable and a pinned tensor of
bench_loops' MLP (512 KiB) and its labels (4 KiB); median of 7 rounds of 2000 calls, in us a call."""

import statistics
import time

import torch

torch.cuda.init()
dev = torch.device("cuda")
for n in (512 * 256, 512):
    a = torch.randn(n)
    p = a.pin_memory()
    calls = {
        "pageable.is_pinned()": lambda: a.is_pinned(),
        "pinned.is_pinned()": lambda: p.is_pinned(),
        "pinned.pin_memory()": lambda: p.pin_memory(),
        "pageable.pin_memory()": lambda: a.pin_memory(),
        "torch._pin_memory(pageable)": lambda: torch._pin_memory(a),
        "empty_like(pin).copy_(pageable)": lambda: torch.empty_like(a, pin_memory=True).copy_(a),
        "pinned.to(cuda, nb)": lambda: p.to(dev, non_blocking=True),
        "pageable.pin_memory().to(cuda, nb)": lambda: a.pin_memory().to(dev, non_blocking=True),
        "pageable._pin_memory().to(cuda, nb)": lambda: torch._pin_memory(a).to(dev, non_blocking=True),
    }
    print(f"== {n * 4 >> 10} KiB float32", flush=True)
    for name, f in calls.items():
        rounds = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(2000):
                f()
            rounds.append((time.perf_counter() - t0) / 2000 * 1e6)
        torch.cuda.synchronize()
        print(f"  {name:38s} {statistics.median(rounds):7.2f} us ({min(rounds):.2f}-{max(rounds):.2f})", flush=True)
