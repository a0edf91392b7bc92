#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call: the cuda-marked tests, then every benchmark.
# Usage there (after the .devwhl prepare line):  bash benchmarks/run_gpu.sh "$OUT"
set -u
out=${1:-benchmarks/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout 240 python3 -m pytest -m cuda tests -q -p no:cacheprovider -rs 2>&1 | tee "$out/cuda-tests.log" | tail -4
timeout 150 python3 benchmarks/bench_prefetcher.py --out "$out" > "$out/bench-prefetcher.log" 2>&1; tail -12 "$out/bench-prefetcher.log"
timeout 200 python3 benchmarks/bench_sources.py --out "$out" > "$out/bench-sources.log" 2>&1; tail -6 "$out/bench-sources.log"
timeout 200 python3 benchmarks/bench_tabpfn.py --out "$out" > "$out/bench-tabpfn.log" 2>&1; tail -14 "$out/bench-tabpfn.log"
(cd /tmp && timeout 120 python3 -m gpufeed.cli bench --out "$out/cli-bench" > "$out/cli-bench.log" 2>&1); tail -9 "$out/cli-bench.log"
# The device tool returns at most 8 files: pack everything into one archive beside the folder.
if [ "${2:-}" = "--pack" ]; then
  tar -C "$(dirname "$out")" -cf "$out.tar" "$(basename "$out")" && rm -rf "$out"
fi
