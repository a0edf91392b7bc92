#!/usr/bin/env bash
# Session 3, final GPU call a: cuda tests, reliability report, CLI bench (results for the repository).
set -u
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt"
timeout 200 python3 -m pytest -m cuda tests -q -p no:cacheprovider -rs > "$R/cuda-tests.log" 2>&1
tail -4 "$R/cuda-tests.log"
timeout 170 python3 tests/reliability/report.py --runs 1 > "$R/report.log" 2>&1; tail -2 "$R/report.log"
cp docs/reliability.md tests/reliability/last_run_0.* "$R/"
(cd /tmp && timeout 120 python3 -m gpufeed.cli bench --trace --out "$R/cli-bench" > "$R/cli-bench.log" 2>&1)
tail -9 "$R/cli-bench.log"
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
