#!/usr/bin/env bash
# Session 3, GPU call 2: read-ahead for small source batches (issue 4), CUDA tests with the cycle check,
# reliability report (issue 6), CLI bench.
set -u
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt"
timeout 120 python3 benchmarks/_diag_small.py --out "$R/small" > "$R/small.log" 2>&1; grep -v "^('" "$R/small.log"
(cd /tmp && timeout 120 python3 -m gpufeed.cli bench --trace --out "$R/cli-bench" > "$R/cli-bench.log" 2>&1)
tail -9 "$R/cli-bench.log"
timeout 200 python3 -m pytest -m cuda tests -q -p no:cacheprovider -rs > "$R/cuda-tests.log" 2>&1
tail -4 "$R/cuda-tests.log"
timeout 150 python3 tests/reliability/report.py --runs 1 > "$R/report.log" 2>&1; tail -2 "$R/report.log"
cp docs/reliability.md tests/reliability/last_run_0.* "$R/"
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
