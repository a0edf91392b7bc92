"""Diagnose where time goes: each stage of gpufeed's two host paths timed alone, in one process.

    PYTHONPATH=src python benchmarks/profile_paths.py --out DIR

Source path (a 2 GiB .npy in the page cache, 48 MiB batches): 16-thread ``preadv`` into pinned memory;
the same pieces through ``RawSource.read`` (with the share of each call spent inside ``preadv``); and
``CudaPrefetcher(RawSource)``. Staging path (64 MiB pageable batches): torch ``copy_`` into pinned memory
from the main thread and from a background thread, and gpufeed per ``chunk_bytes``. Writes
``paths-profile-<card>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from gpufeed import CudaPrefetcher, RawSource

MiB = 1 << 20


def rate(nbytes: int, fn, reps: int = 3) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return reps * nbytes / (time.perf_counter() - t0) / 1e9


def source_path(tmp: Path, res: dict) -> None:
    rows, sample = 174_762, (3, 64, 64)
    rb = 3 * 64 * 64
    path = tmp / "x.npy"
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(rows, *sample))
    arr[:] = 7
    arr.flush()
    del arr
    total = rows * rb
    batch = 4096
    pinned = torch.empty(batch * rb, dtype=torch.uint8, pin_memory=True)
    mv = memoryview(pinned.numpy())
    fd = os.open(path, os.O_RDONLY)
    off = 128
    ex = ThreadPoolExecutor(16)
    inside = [0.0]
    lock = threading.Lock()
    real = os.preadv

    def timed(*a):
        t0 = time.perf_counter()
        r = real(*a)
        with lock:
            inside[0] += time.perf_counter() - t0
        return r

    def ceiling() -> None:
        for a in range(0, rows - batch, batch):
            step = -(-batch * rb // 16)
            base = off + a * rb
            list(ex.map(lambda o, base=base, step=step: real(fd, [mv[o : o + step]], base + o),
                        range(0, batch * rb, step)))

    src = RawSource(path)
    out = pinned.view(batch, *sample)

    def via_source() -> None:
        step = -(-batch // 16)
        for a in range(0, rows - batch, batch):
            list(ex.map(lambda r, a=a: src.read(range(a + r, a + r + step), {"x": out[r : r + step]}),
                        range(0, batch, step)))

    nb = (rows // batch - 1) * batch * rb
    res["pread16_pinned"] = rate(nb, ceiling)
    res["rawsource_read16_pinned"] = rate(nb, via_source)
    os.preadv = timed
    try:
        inside[0] = 0.0
        t0 = time.perf_counter()
        via_source()
        wall = time.perf_counter() - t0
        res["rawsource_read16_share_in_preadv_per_thread"] = inside[0] / 16 / wall
    finally:
        os.preadv = real
    for threads in (4, 8, 16):
        def gf(threads=threads) -> None:
            with CudaPrefetcher(RawSource(path), batch_size=batch, depth=3, num_threads=threads) as pf:
                for _ in pf:
                    pass
        res[f"gpufeed_raw_t{threads}"] = rate(total, gf, reps=2)
    for chunk in (16 * MiB, 64 * MiB):
        def gfc(chunk=chunk) -> None:
            with CudaPrefetcher(RawSource(path), batch_size=batch, depth=3, chunk_bytes=chunk) as pf:
                for _ in pf:
                    pass
        res[f"gpufeed_raw_chunk{chunk // MiB}"] = rate(total, gfc, reps=2)
    with CudaPrefetcher(RawSource(path), batch_size=batch, depth=3, trace=True) as pf:
        for _ in pf:
            pass
        torch.cuda.synchronize()
        res["gpufeed_raw_stats"] = pf.stats.as_dict()
        pf.export_trace(tmp / "trace.json")
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)


def staging_path(res: dict) -> None:
    n = 64 * MiB
    srcs = [torch.randn(n // 4) for _ in range(8)]
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def main_copy() -> None:
        for s in srcs:
            dst.copy_(s.view(torch.uint8))

    res["copy64_main_thread"] = rate(8 * n, main_copy)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", rate(8 * n, main_copy)))
    t.start()
    t.join()
    res["copy64_other_thread"] = box["r"]
    loader = [srcs[i % 8] for i in range(48)]
    for chunk in (32 * MiB, 64 * MiB, 128 * MiB):
        with CudaPrefetcher(loader, depth=3, chunk_bytes=chunk, pinned_budget=1024 * MiB) as pf:
            def ep() -> None:
                for _ in pf:
                    pass
            res[f"gpufeed_unpinned_chunk{chunk // MiB}"] = rate(48 * n, ep)
    shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()
             if "copy" in k or "unpinned" in k}
    print(shown, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tmp", default="/tmp/gpufeed-profile")
    args = p.parse_args(argv)
    card = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    res: dict = {"card": card, "torch": torch.__version__}
    source_path(tmp, res)
    staging_path(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"paths-profile-{card}.json").write_text(json.dumps(res, indent=1))
    if (tmp / "trace.json").exists():
        (out / "trace-raw.json").write_bytes((tmp / "trace.json").read_bytes())


if __name__ == "__main__":
    main()
