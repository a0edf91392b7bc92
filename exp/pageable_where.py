"""Where a pageable list batch's next() goes, gpufeed against pin_memory() + .to(non_blocking=True), on the
GPU, in bench_loops' MLP and token steps: torch's pin_memory, .to and copy_ wrapped to count their calls and
time them (both methods pay the wrappers), and gpufeed's stage copy timed; interleaved rounds."""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_loops as bl
from bench_grid import to_device

import gpufeed

SMOKE = "--smoke" in sys.argv
ROUNDS = 2 if SMOKE else 5
dev = torch.device("cpu" if SMOKE else "cuda")
cfg = bl.parse_args(["--steps", "mlp,token", "--seconds", "1.0"] + (["--smoke"] if SMOKE else []))
specs = bl.step_specs(SMOKE)
acc = {}


def wrap(owner, name, key):
    real = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            c = acc.setdefault(key, [0, 0.0])
            c[0] += 1
            c[1] += time.perf_counter() - t0
    setattr(owner, name, timed)


for name in ("pin_memory", "to", "copy_", "is_pinned"):
    wrap(torch.Tensor, name, name)
for step in ("mlp", "token"):
    spec = specs[step]
    trainer = bl.Trainer(spec, dev)
    data = bl.StepData(spec, cfg)
    bl.measure_ideal(trainer, data, cfg)
    lst = data.listed(False)
    pf = gpufeed.CudaPrefetcher(lst, device=dev)
    wrap(pf._stage, "copy", "stage.copy")
    wrap(pf._stage.stager, "send", "stager.send")
    wrap(pf._stage, "_staged", "stage._staged")
    got = {m: [] for m in ("pin_nb", "gpufeed")}
    for r in range(ROUNDS):
        for m in (("pin_nb", "gpufeed") if r % 2 == 0 else ("gpufeed", "pin_nb")):
            it = (to_device(b, dev, non_blocking=True, pin=not SMOKE) for b in lst) if m == "pin_nb" else iter(pf)
            acc.clear()
            t0 = time.perf_counter()
            rate, next_us = bl.time_window(trainer, it, data.warm, spec.min_steps, cfg.seconds, dev)
            steps = rate * (time.perf_counter() - t0)  # (about: the window's steps, warm-up aside)
            got[m].append((rate, next_us, {k: (v[0], v[1]) for k, v in acc.items()}, steps))
            if m == "gpufeed":
                it.close()
    print(f"== {step}, pageable list, {ROUNDS} rounds; calls and us a step (wrapped calls, warm-up included)")
    for m, rows in got.items():
        keys = sorted({k for row in rows for k in row[2]})
        per = {k: statistics.median([row[2].get(k, (0, 0.0))[1] / row[3] * 1e6 for row in rows]) for k in keys}
        calls = {k: statistics.median([row[2].get(k, (0, 0.0))[0] / row[3] for row in rows]) for k in keys}
        print(f"  {m:8s} {statistics.median([r[0] for r in rows]):6.1f} steps/s  next "
              f"{statistics.median([r[1] for r in rows]):6.1f} us | "
              + ", ".join(f"{k} {calls[k]:.2f}x {per[k]:.1f} us" for k in keys), flush=True)
    pf.close()
