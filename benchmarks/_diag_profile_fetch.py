"""Which calls take the fetch thread's time, with a training step beside it? (GPU machine)

    PYTHONPATH=src python benchmarks/_diag_profile_fetch.py

Runs the prefetcher's background thread under cProfile over 256 64 MiB 4-tensor pageable batches while the
main thread runs _diag_phases's matmul step, and prints the calls with the most own time, per batch. A
torch call's own time includes the wait to take the GIL back after it released it.
"""

import cProfile
import io
import pstats

import torch
from _diag_gap import dict_batches
from _diag_phases import ITERS, matmul_step, run

import gpufeed
from gpufeed import prefetcher


def main():
    produce = prefetcher._produce
    profiles = []

    def profiled(*a, **k):
        prof = cProfile.Profile()
        profiles.append(prof)
        prof.enable()
        try:
            return produce(*a, **k)
        finally:
            prof.disable()

    prefetcher._produce = profiled
    dicts = dict_batches(24)
    step, k = matmul_step(1.2 * 64 * 2**20 / 54e9)
    for name, fn in (("no step", lambda b: None), (f"step {k} matmuls", step)):
        pf = gpufeed.CudaPrefetcher([dicts[i % 24] for i in range(ITERS)], depth=3)
        run(pf, fn)  # warm-up
        profiles.clear()
        wall, nwall, ncpu = run(pf, fn)
        pf.close()
        torch.cuda.synchronize()
        out = io.StringIO()
        stats = pstats.Stats(profiles[-1], stream=out)
        stats.sort_stats("tottime").print_stats(22)
        print(f"== {name}: {wall / ITERS * 1e6:.0f} us/step; consumer next() "
              f"{nwall / ITERS * 1e6:.0f} us wall "
              f"{ncpu / ITERS * 1e6:.0f} us cpu (totals below are for {ITERS} batches)")
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()), flush=True)


if __name__ == "__main__":
    main()
