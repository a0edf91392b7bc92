"""Run by test_rel_gpu.py under ``TORCH_CUDA_SANITIZER=1``: the prefetcher's stream hand-over, watched by
PyTorch's CUDA sanitizer (CSAN), which prints "CSAN detected a possible data race" on any unsynchronized
access. Unpinned, pinned and device batches; a slow consumer on the default stream and on a side stream;
a source read into the pinned pool (two buffers, reused once their copies completed); batches freed right
after use and batches kept. Prints "CSAN OK".
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from gpufeed import CudaPrefetcher, SourceLoader
from gpufeed.sources import RawSource


def batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b = {"x": torch.randn(int(torch.randint(64, 2048, (1,), generator=g)), 33, generator=g),
             "y": torch.randint(0, 1000, (257,), generator=g),
             "m": torch.rand(96, 7, generator=g) > 0.5}
        if i % 3 == 1:
            b = {k: v.pin_memory() for k, v in b.items()}
        elif i % 3 == 2:
            b["y"] = b["y"].cuda()
        out.append(b)
    return out


def consume(pf: CudaPrefetcher, keep: list) -> float:
    total = torch.zeros((), device="cuda", dtype=torch.float64)
    for k, b in enumerate(pf):
        torch.cuda._sleep(500_000)  # the consumer's stream is busy while later copies run
        total += b["x"].double().sum() + b["y"].double().sum() + b["m"].double().sum()
        if k % 5 == 0:
            keep.append(b)  # kept batches must stay intact while later ones are copied
    return float(total.item())


def main() -> int:
    assert torch.cuda.is_available(), "needs CUDA"
    data = batches(18, seed=1)
    want = sum(float(b["x"].double().sum() + b["y"].double().sum().cpu() + b["m"].double().sum())
               for b in data)
    keep: list = []
    with CudaPrefetcher(data, depth=3) as pf:
        got = consume(pf, keep)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            got2 = consume(pf, keep)
    torch.cuda.synchronize()
    assert abs(got - want) < 1e-6 * abs(want) and abs(got2 - want) < 1e-6 * abs(want), (got, got2, want)
    with tempfile.TemporaryDirectory() as tmp:
        x = np.random.default_rng(0).integers(0, 256, (600, 1024), dtype=np.uint8)
        np.save(Path(tmp) / "x.npy", x)
        loader = SourceLoader(RawSource(Path(tmp) / "x.npy"), batch_size=64, shuffle=True,
                              pinned_budget=128 << 10)  # batches of 64 KiB: two buffers
        with CudaPrefetcher(loader, depth=2) as pf:
            s = torch.zeros((), device="cuda", dtype=torch.int64)
            for b in pf:
                torch.cuda._sleep(500_000)
                s += b["x"].long().sum()
        assert int(s.item()) == int(x.astype(np.int64).sum())
    print("CSAN OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
