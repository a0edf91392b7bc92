"""A/B of the stream choice with the loop's stream's spare time (this tree) against the code before it
(exp/base/src), in loops whose bound differs: bench_loops' CNN step over 12 MiB pinned batches at width 32
(bound by its thread) and 64 (bound by the GPU), each with and without ``loss.item()`` every step, and an
empty loop over 4 x 512 KiB pinned batches (the grid's cell). Steps/s and the batches copied on the loop's
stream; the driver runs each tree in its own process, alternating, and pairs their rounds.

    python exp/slack_ab.py            # the driver (on the GPU)
    python exp/slack_ab.py --smoke    # the same on the CPU, tiny
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "--smoke" in sys.argv
TREES = {"before": ROOT / "exp/base/src", "after": ROOT / "src"}


def one_tree() -> None:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_loops import cnn

    import gpufeed

    dev = torch.device("cpu" if SMOKE else "cuda")
    n, rounds = (8, 1) if SMOKE else (120, 3)
    side = 16 if SMOKE else 128
    pin = (lambda t: t) if SMOKE else (lambda t: t.pin_memory())
    images = [(pin(torch.randn(64, 3, side, side)), pin(torch.randint(0, 100, (64,)))) for _ in range(n + 20)]
    small = [[pin(torch.randn(1 << 17)) for _ in range(4)] for _ in range(3000 if not SMOKE else 50)]

    def make(width, sync):
        torch.manual_seed(0)
        model = cnn(100, width).to(dev).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(b):
            loss = F.cross_entropy(model(b[0]), b[1])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sync:
                loss.item()
        return step

    loops = {f"cnn{w}{'-item' if s else ''}": (make(w, s), images) for w in (32, 64) for s in (False, True)}
    loops["empty-2MiBx4"] = (lambda b: None, small)
    out = {}
    for r in range(rounds):
        for name, (step, data) in loops.items():
            pf = gpufeed.CudaPrefetcher(data, device=dev)
            it = iter(pf)
            for _ in range(len(data) // 6):  # (warm-up)
                step(next(it))
            if not SMOKE:
                torch.cuda.synchronize()
            before = pf.stats.loop_stream_batches
            t0, k = time.perf_counter(), 0
            for b in it:
                step(b)
                k += 1
            if not SMOKE:
                torch.cuda.synchronize()
            rate = k / (time.perf_counter() - t0)
            out.setdefault(name, []).append((rate, (pf.stats.loop_stream_batches - before) / k))
            pf.close()
    print(json.dumps(out))


def driver() -> None:
    got = {t: {} for t in TREES}
    order = list(TREES) * (1 if SMOKE else 2)
    for i, tree in enumerate(order):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TREES[tree]), os.environ.get("PYTHONPATH", "")]))
        args = [sys.executable, __file__, "--one"] + (["--smoke"] if SMOKE else [])
        res = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
        if res.returncode:
            print(res.stderr[-3000:], flush=True)
            raise SystemExit(f"{tree} failed")
        for name, rows in json.loads(res.stdout.strip().splitlines()[-1]).items():
            got[tree].setdefault(name, []).extend(rows)
        print(f"run {i}: {tree} done", flush=True)
    for name in got["after"]:
        a, b = got["after"][name], got["before"][name]
        ratios = [x[0] / y[0] for x, y in zip(a, b, strict=True)]
        print(f"{name:14s} before {statistics.median(r for r, _ in b):8.1f} steps/s (loop's stream "
              f"{statistics.median(s for _, s in b):.0%})  after {statistics.median(r for r, _ in a):8.1f} "
              f"({statistics.median(s for _, s in a):.0%})  after/before paired {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    one_tree() if "--one" in sys.argv else driver()
